"""Know before launch: dry-run a training run at its real world size on this machine, and say what fits and how fast.

    python plan.py --config configs/llama3_8b_2d.toml --world_size 64 --gpus_per_node 8 --gpu h100
    python plan.py --config configs/debug.toml --world_size 2 --gpu cpu --search

The trainer's own checks refuse what it would refuse, with its own `error:` line. Then the
trainer's own build and step run for one rank of each pipeline stage, on fake tensors over a
fake process group of --world_size ranks (planning/dryrun.py): no data is read, no tokenizer
trained, no GPU needed. Printed per rank: the memory held (parameters, gradients, optimizer
state), the step's peak by category and with the margins no tracker sees against the GPU's
memory, the bytes of each collective, and the predicted step time, tokens/s and MFU
(planning/estimate.py, the GPU's figures in planning/gpus.py). --search plans the layouts
worth trying and prints the command that starts each, the fastest that fits first.
Any --section.field VALUE is the trainer's override. docs/planning.md has the details.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch

from config import compute_dtype, parse_config
from core import cli
from core.cli import exit_command
from core.errors import ConfigError, UserError, report
from planning.gpus import GPUS, gpu_named
from planning.planner import plan_run, write_json
from planning.search import command, fit_batch, none_fits, search


def main(argv: list[str] | None = None) -> int:
    """plan.py's command: exit 0 with the plan printed, 2 with one 'error: ...' line on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, usage="python plan.py --config FILE --world_size N "
                                "[--gpus_per_node G] [--gpu NAME] [--json FILE] [--search] [--plan.moe_max_load X] "
                                "[--section.field VALUE ...]")
    parser.add_argument("--world_size", type=cli.number(int, lambda v: v >= 1, "an integer >= 1"), required=True,
                        help="the ranks (GPUs) of the run planned")
    parser.add_argument("--gpus_per_node", type=cli.number(int, lambda v: v >= 1, "an integer >= 1"),
                        help="GPUs per node (default: 8, or the world size when smaller; cpu: the world size)")
    parser.add_argument("--gpu", default="h100", help=f"the device: {', '.join(GPUS)} (default h100)")
    parser.add_argument("--json", default="", help="also write the plan as JSON to this file")
    parser.add_argument("--search", action="store_true", help="plan the layouts worth trying, the best first")
    parser.add_argument("--plan.moe_max_load", dest="moe_max_load", default=1.0,
                        type=cli.number(float, lambda v: 1 <= v < math.inf, "a finite number >= 1"),
                        help="a mixture of experts' planned load: the busiest expert's tokens over the mean (1: "
                             "balanced; the runs in docs/moe.md measured about 1.3)")
    try:
        a, rest = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or a bad flag already reported as one error line
        return e.code
    try:
        gpu = gpu_named(a.gpu)
        per_node = a.gpus_per_node or (a.world_size if gpu.name == "cpu" else min(8, a.world_size))
        if a.world_size % per_node:
            raise ConfigError(f"--world_size {a.world_size} is not a multiple of --gpus_per_node {per_node}: a run "
                              f"fills whole nodes; use --world_size {math.ceil(a.world_size / per_node) * per_node}")
        check_output(a.json)
        cfg = parse_config(rest, require_file=True)
        if cfg.train.float8 != "off" and not gpu.fp8_flops and gpu.name != "cpu":
            raise ConfigError(f"train.float8 {cfg.train.float8} needs float8 matmuls (compute capability 8.9 or newer: "
                              f"h100, h200, b200, mi300x); --gpu {gpu.name} has none; use --train.float8 off")
        # Planned as it would run on the GPU: its dtype ('auto' is bf16 there), whatever this machine has.
        cfg.train.dtype = compute_dtype(cfg.train, torch.device("cpu" if gpu.name == "cpu" else "cuda"))
        given = any(w == "--train.global_batch_size" or w.startswith("--train.global_batch_size=") for w in rest)
        if a.search:
            return run_search(cfg, a, rest, gpu, per_node, given)
        note = fit_batch(cfg, a.world_size, given)
        plan = plan_run(cfg, a.world_size, gpu, per_node, a.moe_max_load)
        if note:
            plan.notes.insert(0, note)
        print("\n".join(plan.lines()), flush=True)
        if a.json:
            write_json(plan.to_json(), a.json)
        return 0
    except UserError as e:
        report(e)
        return 2


def check_output(path: str) -> None:
    """Refuse a --json path that cannot be written (a folder, or in a folder that does not exist) before any work."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"--json {path} is a folder; give a file name, e.g. {os.path.join(path, 'plan.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--json {path}: the folder {parent} does not exist; create it or give another path")


def run_search(cfg, a, rest: list[str], gpu, per_node: int, given: bool) -> int:
    """--search: every candidate's line as it is planned, then the commands of the fitting ones, the best first."""
    print(f"search: {a.world_size} x {gpu.name} ({per_node} per node)", flush=True)
    pinned = frozenset(w.lstrip("-").split("=")[0] for w in rest if w.startswith("--") and "." in w)
    tried = search(cfg, a.world_size, gpu, per_node, given, a.moe_max_load, log=lambda line: print(line, flush=True),
                   pinned=pinned)
    fitting = [c for c in tried if c.plan is not None and c.plan.fits]
    if not fitting:
        raise none_fits(tried, gpu)
    print("fastest first (predicted tokens/s):")
    for i, c in enumerate(fitting):
        print(f"  {i + 1}. {c.plan.tokens_per_sec:,.0f} tokens/s, MFU {c.plan.mfu:.1%}: "
              f"{command(c, rest, a.world_size, per_node)}", flush=True)
    if a.json:
        write_json([{"settings": c.settings, "refused": c.refused, **(c.plan.to_json() if c.plan else {})}
                    for c in tried], a.json)
    return 0


if __name__ == "__main__":
    # A mixture of experts' FSDP-wrapped experts return a view, which FSDP2 warns about whatever the run does with
    # it; the trainer's own tests hold its gradients (tests/test_moe.py). Not the planner's news.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    exit_command(main())
