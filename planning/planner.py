"""A plan: the trainer's checks, a dry run of each distinct rank, the memory against the GPU, the step's time.

plan_run is what plan.py and its --search call for one layout. Its figures per rank are the dry
run's (dryrun.py); whether the rank fits adds the memory no tracker sees (CUDA_CONTEXT, NCCL_BUFFERS,
FRAGMENTATION); the step time is estimate.py's model on the GPU's figures (gpus.py).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import train_2d
from config import Config, validate_layout
from model import num_params
from parallel.composition import check_composition
from parallel.layout import Layout
from parallel.memory import check_fits
from planning.dryrun import RankPlan, dry_run, planned_ranks
from planning.estimate import StepEstimate, estimate, flops_per_step
from planning.gpus import GIB, GPU, rank_memory

CUDA_CONTEXT = int(0.5 * GIB)
"""Bytes a CUDA context with cuBLAS and NCCL's communicators takes before any tensor (about 500 MiB on Hopper with
torch 2.x; an allocator's max_memory_allocated does not see it)."""
NCCL_BUFFERS = int(0.5 * GIB)
"""NCCL's own buffers per rank across its communicators (NCCL_BUFFSIZE 4 MiB x channels x peers), stated."""
FRAGMENTATION = 0.05
"""The caching allocator reserves more than it allocates: 5% of the peak on top (expandable segments keep it low)."""


def device_total(peak_bytes: int, gpu: GPU) -> int:
    """What a rank needs of the device: the accounted peak, the allocator's fragmentation on it, the CUDA context and
    NCCL's buffers (none on the cpu entry, whose ranks are processes in host memory)."""
    if gpu.name == "cpu":
        return peak_bytes
    return int(peak_bytes * (1 + FRAGMENTATION)) + CUDA_CONTEXT + NCCL_BUFFERS


@dataclasses.dataclass
class Plan:
    """One layout's plan: per distinct rank its dry run and predicted step, and the run's figures."""

    cfg: Config
    world_size: int
    gpus_per_node: int
    gpu: GPU
    ranks: list[tuple[RankPlan, StepEstimate]]
    seconds: float
    """How long the dry runs took here."""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def step_s(self) -> float:
        """The slowest rank's step (the others wait for it)."""
        return max(e.step_s for _, e in self.ranks)

    @property
    def tokens_per_sec(self) -> float:
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len / self.step_s

    @property
    def mfu(self) -> float:
        return flops_per_step(self.cfg) / (self.step_s * self.world_size * self.gpu.bf16_flops)

    @property
    def memory(self) -> int:
        """The bytes a rank has (gpus.rank_memory)."""
        return rank_memory(self.gpu, self.gpus_per_node)

    @property
    def fits(self) -> bool:
        return all(device_total(r.peak_bytes, self.gpu) <= self.memory for r, _ in self.ranks)

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r, _ in self.ranks)

    def to_json(self) -> dict:
        """DESIGN.md's --json object."""
        return {"world_size": self.world_size, "gpu": self.gpu.name, "gpus_per_node": self.gpus_per_node,
                "fits": self.fits, "total_params": num_params(self.cfg.model),
                "active_params": num_params(self.cfg.model, active=True),
                "flops_per_step": flops_per_step(self.cfg), "predicted_step_s": self.step_s,
                "predicted_tokens_per_sec": self.tokens_per_sec, "predicted_mfu": self.mfu,
                "rank_memory_bytes": self.memory, "global_batch_size": self.cfg.train.global_batch_size, "seq_len": self.cfg.data.seq_len,
                "layout": layout_flags(self.cfg), "dry_run_s": self.seconds, "notes": self.notes,
                "ranks": [{"rank": r.rank, "stage": r.stage, "params_bytes": r.held["params"],
                           "grads_bytes": r.held["grads"], "optimizer_bytes": r.held["optimizer"],
                           "activations_bytes": r.at_peak.get("activations", 0),
                           "temporaries_bytes": r.at_peak.get("temporaries", 0),
                           "collective_buffers_bytes": r.at_peak.get("collectives", 0),
                           "peak_bytes": r.peak_bytes, "device_total_bytes": device_total(r.peak_bytes, self.gpu),
                           "at_peak": r.at_peak, "comm_bytes": r.comm, "comm_calls": r.calls,
                           "micro_batches": r.micro_batches, "predicted_step_s": e.step_s,
                           "compute_s": e.compute_s, "exposed_comm_s": e.exposed_comm_s, "bubble_s": e.bubble_s,
                           "optimizer_s": e.optimizer_s, "comm_s": e.comm_s} for r, e in self.ranks]}

    def lines(self) -> list[str]:
        """The plan as text: one block per distinct rank, then the run's figures."""
        g, n = self.gpu, num_params(self.cfg.model)
        count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        out = [f"plan: {self.world_size} x {g.name} ({self.gpus_per_node} per node), {layout_flags(self.cfg) or 'fsdp'}"
               f", {count} parameters, global batch {self.cfg.train.global_batch_size} x {self.cfg.data.seq_len} "
               f"tokens; dry run {self.seconds:.1f} s"]
        for r, e in self.ranks:
            total = device_total(r.peak_bytes, g)
            parts = ", ".join(f"{k} {size(v)}" for k, v in r.at_peak.items() if v)
            margins = "with context, NCCL and fragmentation " if g.name != "cpu" else ""
            out.append(f"  rank {r.rank} (stage {r.stage}, {r.micro_batches} micro-batch"
                       f"{'es' if r.micro_batches > 1 else ''}): holds params "
                       f"{size(r.held['params'])}, grads {size(r.held['grads'])}, optimizer "
                       f"{size(r.held['optimizer'])}; peak {size(r.peak_bytes)} ({parts}); {margins}{size(total)} of "
                       f"{size(self.memory)}: {'fits' if total <= self.memory else 'DOES NOT FIT'}")
            comm = ", ".join(f"{k} {size(v)} in {e.comm_s[k] * 1e3:.0f} ms" for k, v in sorted(r.comm.items()))
            out.append(f"    step {e.step_s:.3f} s = compute {e.compute_s:.3f} + exposed communication "
                       f"{e.exposed_comm_s:.3f} + bubble {e.bubble_s:.3f} + optimizer {e.optimizer_s:.3f}; "
                       f"collectives: {comm or 'none'}")
        out.append(f"predicted: {self.step_s:.3f} s per step, {self.tokens_per_sec:,.0f} tokens/s, MFU "
                   f"{self.mfu:.1%}; {'fits' if self.fits else 'does not fit'} ({size(self.peak_bytes)} "
                   f"peak before margins)")
        return out + [f"note: {n}" for n in self.notes]


def size(nbytes: float) -> str:
    """Bytes in words: '11.57 GiB', '102.2 MiB', '264 B'."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2 ** 20:.1f} MiB" if nbytes >= 2 ** 20 else f"{nbytes:.0f} B" if nbytes < 1024 \
        else f"{nbytes / 1024:.1f} KiB"


def layout_flags(cfg: Config) -> str:
    """The command-line flags of cfg's layout that differ from one FSDP group ('--parallel.tp 8 ...')."""
    p, out = cfg.parallel, []
    for name in ("tp", "cp", "ep", "pp", "dp_replicate"):
        if getattr(p, name) != 1:
            out.append(f"--parallel.{name} {getattr(p, name)}")
    if p.pp > 1:
        out.append(f"--parallel.pp_schedule {p.pp_schedule}")
    return " ".join(out)


def trainer_of(cfg: Config) -> str:
    """The entry script that runs cfg: train_2d.py under tensor parallelism, else train_fsdp.py."""
    return "train_2d.py" if cfg.parallel.tp > 1 else "train_fsdp.py"


def check_layout_run(cfg: Config, world_size: int, gpus_per_node: int, gpu: GPU) -> None:
    """The trainer's checks that need no data or collective, in its order (command.check_run): composition, the TP
    plan's layout checks (train_2d.py), config.validate_layout, then parallel.memory.check_fits against gpu's memory
    (check_floor: parameters, gradients and optimizer state, which rule a layout out before any dry run). Raises
    the trainer's UserError."""
    check_composition(cfg, trainer_of(cfg))
    if cfg.parallel.tp > 1:
        train_2d.check_tp_layout(cfg, world_size)
    validate_layout(cfg, world_size, gpus_per_node)
    check_floor(cfg, world_size, gpus_per_node, gpu)


def check_floor(cfg: Config, world_size: int, gpus_per_node: int, gpu: GPU) -> None:
    """parallel.memory.check_fits, the trainer's own, against gpu's memory (or the cpu entry's, shared by the
    node's ranks); nothing under parallel.cpu_offload, whose host memory the GPU table does not know. Raises its
    SetupError. The floor is the same for every layout but HSDP's, so --search checks it once, first."""
    if cfg.parallel.cpu_offload:
        return
    shared = gpus_per_node if gpu.cores else 0
    where = (f"CPU memory, shared by {gpus_per_node} ranks" if shared > 1 else "CPU memory") if gpu.cores \
        else f"the {gpu.name}'s memory"
    check_fits(cfg.model, cfg.optim.name, world_size, cfg.parallel.dp_replicate, rank_memory(gpu, gpus_per_node),
               where, shared)


def plan_run(cfg: Config, world_size: int, gpu: GPU, gpus_per_node: int, max_load: float = 1.0) -> Plan:
    """Check cfg's layout as the trainer does, dry-run each distinct rank (one per pipeline stage), and estimate its
    step on gpu.

    cfg is not changed (a copy is planned: eager, no memory tracking of its own). Raises the
    trainer's UserError for a layout it refuses.
    """
    check_layout_run(cfg, world_size, gpus_per_node, gpu)
    cfg = copy.deepcopy(cfg)
    notes = []
    if cfg.train.compile:
        notes.append("planned eager: torch.compile's fusions lower the activations and temporaries of a compiled run")
        cfg.train.compile = False
    cfg.train.track_memory = False
    layout = Layout.of(cfg.parallel, world_size)
    started = time.perf_counter()
    ranks = []
    for rank in planned_ranks(layout):
        rp = dry_run(cfg, world_size, rank, train_2d.PLAN if cfg.parallel.tp > 1 else None, max_load)
        ranks.append((rp, estimate(rp, cfg, world_size, gpu, gpus_per_node)))
    if cfg.model.n_experts:
        notes.append(f"the experts' all-to-all and grouped matmuls planned at a load of {max_load:g} "
                     f"(the busiest expert's tokens over the mean; --plan.moe_max_load)")
    return Plan(cfg, world_size, gpus_per_node, gpu, ranks, time.perf_counter() - started, notes)


def write_json(obj, path: str) -> None:
    """obj (a plan's to_json(), or --search's list of them) as JSON to path (written whole, then renamed into
    place)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
