"""One Muon update of the debug model's matrices under a parallel layout, for parity with torch.optim.Muon.

    torchrun --nproc_per_node=N tests/muon_worker.py --out FILE [--tp T] --config configs/debug.toml \
        --run_dir DIR [--parallel.dp_replicate R]
    torchrun --nproc_per_node=N tests/muon_worker.py --jobs FILE    # a JSON list of such argument lists, in turn

Builds the run as the trainers do (build, train_2d's plan with --tp T > 1), sets every
gradient to a fixed random matrix from a seeded generator (the same on every rank, then this
rank's shard of it), takes two optimizer steps and rank 0 saves with torch.save
{"init": {name: full param}, "grads": [{name: full grad}] per step, "after": {name: full param}}.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_2d  # noqa: E402
from config import parse_config  # noqa: E402
from launch import job_list  # noqa: E402
from parallel import distributed  # noqa: E402
from training.session import build  # noqa: E402

STEPS = 2


def run_job(argv: list[str]) -> None:
    """One job: build the run of argv with Muon, take STEPS optimizer steps on seeded gradients; rank 0 saves."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args, overrides = parser.parse_known_args(argv)
    cfg = parse_config([*overrides, "--parallel.tp", str(args.tp), "--optim.name", "muon"])
    plan = train_2d.PLAN if args.tp > 1 else None
    if not dist.is_initialized():
        distributed.init_distributed(cfg.train.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = distributed.resolve_device(cfg.train.device, distributed.local_rank())
    s = build(cfg, rank, world, device, plan, resume=False)
    result = {"init": {n: p.full_tensor().detach().clone() for n, p in s.model.named_parameters()}, "grads": []}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in s.model.named_parameters()}
        for n, p in s.model.named_parameters():
            p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements, src_data_rank=None)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        result["grads"].append(grads)
    result["after"] = {n: p.full_tensor().detach().clone() for n, p in s.model.named_parameters()}
    if rank == 0:
        torch.save(result, args.out)
    del s
    gc.collect()


def main() -> None:
    gc.freeze()  # the imports' objects: out of reach of each job's collection and the exit's (core.cli.exit_command)
    for argv in job_list(sys.argv[1:]):
        run_job(argv)
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
