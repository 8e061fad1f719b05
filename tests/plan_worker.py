"""A real run's accounting of its second step on every rank, for the planner's fidelity tests.

    torchrun --nproc_per_node=N tests/plan_worker.py --jobs FILE --out FILE

FILE of --jobs: a JSON list of argument lists, each a config and overrides (--config ... --parallel.tp 2);
one launch runs them all in turn. For each, the run is built as the trainers build it
(training.step.build_trainable on Layout.build's mesh, train_2d's plan under TP), one step
runs (it creates the optimizer state), then a second step of the same micro-batches runs
inside parallel.accounting.account_step: what plan.py's dry run measures, measured on real
tensors and gloo. Rank 0 writes --out: a JSON list (one entry per job) of lists (one per rank)
of {"held", "peak_bytes", "at_peak", "comm": {"collective role": bytes}}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_2d  # noqa: E402
from config import parse_config  # noqa: E402
from parallel import distributed  # noqa: E402
from parallel.accounting import account_step, held_bytes  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from planning.dryrun import role_of  # noqa: E402
from training.step import build_trainable, train_step  # noqa: E402


def account(argv: list[str], rank: int, world: int, device) -> dict:
    """This rank's accounting of the second step of the run argv configures."""
    cfg = parse_config(argv, require_file=True)
    layout = Layout.of(cfg.parallel, world)
    mesh = layout.build(device)
    tr = build_trainable(cfg, rank, mesh, device, train_2d.PLAN if cfg.parallel.tp > 1 else None)
    dp = mesh.size("data")
    micro = cfg.train.micro_batch(dp)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len), generator=g),
                torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len), generator=g))
               for _ in range(cfg.train.global_batch_size // dp // micro)]
    train_step(tr, batches)
    held = {}
    with account_step(tr.model, tr.optimizer) as step:
        train_step(tr, batches, lambda model: held.update(held_bytes(model, tr.optimizer)))
    comm = {}
    for (kind, ranks), nbytes in step.comm.items():
        name = f"{kind} {role_of(layout, ranks, rank, kind)}"
        comm[name] = comm.get(name, 0) + nbytes
    return {"held": held, "peak_bytes": step.peak_bytes, "at_peak": step.at_peak, "comm": comm}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with open(a.jobs) as f:
        jobs = json.load(f)
    rank, world, device = distributed.init_distributed("cpu")
    results = []
    for argv in jobs:
        mine = account(argv, rank, world, device)
        every = [None] * world
        dist.all_gather_object(every, mine)
        results.append(every)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
