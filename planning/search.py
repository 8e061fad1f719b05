"""plan.py --search: the layouts worth trying for a model at a world size, each planned, the best first.

The candidates are tensor parallelism inside a node (1, 2, 4, 8) times pipeline stages across
nodes (1, 2, 4; 1F1B) for a dense model, expert parallelism over a node (or none) for a mixture
of experts, and activation checkpointing (none, then full only where none does not fit: full
only recomputes), with the config's CP and micro-batch; each goes through the trainer's own checks
(a layout it refuses is listed with its reason) and a dry run. The fitting ones are ranked by
predicted tokens/s; each is printed with the torchrun command that starts it.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import shlex

from config import Config
from core.errors import SetupError, UserError
from planning.gpus import GIB, GPU
from planning.planner import Plan, check_floor, device_total, plan_run, size, trainer_of

TP = (1, 2, 4, 8)
PP = (1, 2, 4)


@dataclasses.dataclass
class Candidate:
    """One layout tried: its settings, and its plan or the reason it was refused."""

    settings: dict
    """{'parallel.tp': 2, ...}: what differs from the config (as command-line flags)."""
    plan: Plan | None = None
    refused: str = ""


def with_settings(cfg: Config, settings: dict) -> Config:
    """A copy of cfg with settings ({'section.field': value}) applied."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, field = key.split(".")
        setattr(getattr(out, section), field, value)
    return out


def fit_batch(cfg: Config, world_size: int, given: bool) -> str:
    """Make the global batch split over world_size's data-parallel ranks (x train.micro_batch_size when set), when
    the user did not give it (given: --train.global_batch_size was on the command line): the smallest multiple at or
    above the config's. Returns a note saying so, or ''. A layout that does not divide world_size is left to the
    checks."""
    t, p = cfg.train, cfg.parallel
    if given or t.batch_stages or world_size % (p.pp * p.cp * p.tp):
        return ""
    dp = p.data_parallel(world_size)
    unit = dp * (t.micro_batch_size or 1)
    if t.global_batch_size % unit == 0:
        return ""
    was = t.global_batch_size
    t.global_batch_size = -(-was // unit) * unit
    per = f" x train.micro_batch_size {t.micro_batch_size}" if t.micro_batch_size else ""
    return (f"train.global_batch_size {was} does not split over {dp} data-parallel ranks{per}: planned at "
            f"{t.global_batch_size} (give --train.global_batch_size to choose)")


def candidates(cfg: Config, world_size: int, gpus_per_node: int) -> list[dict]:
    """The settings --search tries, in the order it tries them: for a dense model tensor parallelism inside a node,
    times pipeline stages across nodes; for a mixture of experts, expert parallelism over a node's ranks (or the
    experts, when fewer) at tp 1: EP x TP runs (parallel/moe_sequence.py) but is not searched, to keep the search
    to two plans per setting (the field trains its MoEs without TP: fine-grained experts are too narrow to split)."""
    out = []
    if cfg.model.n_experts:
        eps = sorted({1, math.gcd(gpus_per_node, cfg.model.n_experts, world_size)})
        return [{"parallel.tp": 1, "parallel.pp": 1, "parallel.ep": ep} for ep in eps]
    # Pipelines across nodes only (their point-to-point traffic is what crosses them): pp 1, and 2 and 4 where there
    # are as many nodes.
    pps = [pp for pp in PP if pp == 1 or world_size >= pp * gpus_per_node and cfg.model.n_layers % pp == 0]
    for pp in pps:
        for tp in TP:
            if tp <= gpus_per_node and world_size % (tp * pp) == 0:
                s = {"parallel.tp": tp, "parallel.pp": pp}
                if pp > 1:
                    s["parallel.pp_schedule"] = "1F1B"
                out.append(s)
    return out


def search(cfg: Config, world_size: int, gpu: GPU, gpus_per_node: int, batch_given: bool, max_load: float = 1.0,
           log=print, pinned: frozenset = frozenset()) -> list[Candidate]:
    """Plan every candidate layout (activation checkpointing 'full' only where 'none' does not fit); returns them all,
    the fitting ones first, fastest first. log(line): progress, one line per plan. pinned: the 'section.field's the
    user gave, which every candidate keeps at the config's value. Raises planner.check_floor's SetupError when
    the parameters, gradients and optimizer state alone do not fit."""
    check_floor(cfg, world_size, gpus_per_node, gpu)  # one line, before any candidate, for a model too big for all
    tried, seen = [], set()
    for base in candidates(cfg, world_size, gpus_per_node):
        base = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) if k in pinned else v
                for k, v in base.items()}
        if tuple(base.items()) in seen:
            continue
        seen.add(tuple(base.items()))
        acs = [cfg.train.activation_checkpointing] if "train.activation_checkpointing" in pinned else ["none", "full"]
        for ac in acs:
            settings = {**base, "train.activation_checkpointing": ac}
            c = Candidate(settings)
            run = with_settings(cfg, settings)
            note = fit_batch(run, world_size, batch_given)
            if note:
                c.settings["train.global_batch_size"] = run.train.global_batch_size
            try:
                c.plan = plan_run(run, world_size, gpu, gpus_per_node, max_load)
            except UserError as e:
                c.refused = str(e)
            tried.append(c)
            log(describe(c, gpu))
            if c.refused or c.plan.fits:
                break
    tried.sort(key=lambda c: (c.plan is None or not c.plan.fits, -(c.plan.tokens_per_sec if c.plan else 0)))
    return tried


def describe(c: Candidate, gpu: GPU) -> str:
    """One line on a candidate: its settings, then its plan's figures or why it was refused."""
    flags = " ".join(f"{k.split('.')[1]} {v}" for k, v in c.settings.items())
    if c.plan is None:
        return f"  {flags}: refused: {c.refused}"
    p = c.plan
    total = max(device_total(r.peak_bytes, gpu) for r, _ in p.ranks)
    return (f"  {flags}: {size(total)} of {size(p.memory)}, "
            f"{'fits' if p.fits else 'does not fit'}, {p.tokens_per_sec:,.0f} tokens/s, MFU {p.mfu:.1%} "
            f"(dry run {p.seconds:.1f} s)")


def command(c: Candidate, argv: list[str], world_size: int, gpus_per_node: int) -> str:
    """The torchrun command line that starts candidate c: the trainer's script, the user's own arguments (argv: the
    config and overrides given to plan.py), then c's settings."""
    nodes = world_size // gpus_per_node
    launch = (["torchrun", "--standalone", f"--nproc_per_node={world_size}"] if nodes == 1 else
              ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={gpus_per_node}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=HOST:29500"])
    flags = [w for k, v in c.settings.items() for w in (f"--{k}", str(v))]
    own, skip = [], False
    for w in argv:  # the user's arguments but those the candidate sets
        if skip:
            skip = False
        elif w.lstrip("-").split("=")[0] in c.settings:
            skip = "=" not in w
        else:
            own.append(w)
    return shlex.join(launch + [trainer_of(c.plan.cfg)] + own + flags)


def none_fits(tried: list[Candidate], gpu: GPU) -> SetupError:
    """The error of a search where no layout fits: the smallest peak found and what it needs."""
    planned = [c for c in tried if c.plan is not None]
    if not planned:
        return SetupError(f"--search: the trainer refuses every layout it tried; the first: {tried[0].refused}"
                          if tried else "--search: no layout divides this world size")
    best = min(planned, key=lambda c: max(device_total(r.peak_bytes, gpu) for r, _ in c.plan.ranks))
    need = max(device_total(r.peak_bytes, gpu) for r, _ in best.plan.ranks)
    flags = " ".join(f"--{k} {v}" for k, v in best.settings.items())
    return SetupError(f"--search: no layout fits {gpu.name}'s {best.plan.memory / GIB:.0f} GiB per rank; the smallest is {flags} "
                      f"at {need / GIB:.1f} GiB per rank: use more GPUs (--world_size), a smaller "
                      f"train.micro_batch_size or data.seq_len, train.loss_chunk_size, or a GPU with more memory")
