"""Muon against AdamW on the same ranks, paired: median step time and optimizer state bytes of the matrices.

    torchrun --standalone --nproc_per_node=2 benchmarks/muon_bench.py [--batches 16,128] [--steps 6]

The debug model (configs/debug.toml) under FSDP2; for each global batch (x seq 128) both
optimizers alternate step by step on random tokens (train_step, the loop's own step),
the first 2 steps of each are warm-up. Rank 0 prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_config  # noqa: E402
from nn.roles import roles  # noqa: E402
from optimization.muon import is_muon_matrix  # noqa: E402
from parallel import distributed  # noqa: E402
from parallel.layout import build_mesh  # noqa: E402
from training.step import build_trainable, train_step  # noqa: E402


def state_bytes(tr) -> int:
    """Bytes of this rank's optimizer state for the blocks' matrices (local shards)."""
    total, role = 0, roles(tr.model)
    for name, p in tr.model.named_parameters():
        if is_muon_matrix(role[name]):
            for v in tr.optimizer.state.get(p, {}).values():
                if torch.is_tensor(v) and v.ndim:
                    total += (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="16,128")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rank, world, device = distributed.init_distributed("cpu")
    rows = []
    for batch in map(int, args.batches.split(",")):
        trs = {}
        for name in ("adamw", "muon"):
            cfg = parse_config(["--config", "configs/debug.toml", "--optim.name", name, "--train.global_batch_size",
                                str(batch), "--train.steps", "1000"])
            trs[name] = build_trainable(cfg, rank, build_mesh(device, world), device)
        times = {n: [] for n in trs}
        gen = torch.Generator().manual_seed(rank)
        for i in range(args.steps):
            for name, tr in trs.items():
                tokens = torch.randint(0, 4096, (batch // world, 129), generator=gen)
                t = time.perf_counter()
                train_step(tr, [(tokens[:, :-1], tokens[:, 1:])])
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
        a, m = statistics.median(times["adamw"]), statistics.median(times["muon"])
        rows.append(f"| {batch} x 128 = {batch * 128:,} | {a * 1e3:.0f} | {m * 1e3:.0f} | {m / a:.3f}x | "
                    f"{state_bytes(trs['adamw']):,} | {state_bytes(trs['muon']):,} | "
                    f"{state_bytes(trs['muon']) / state_bytes(trs['adamw']):.2f}x |")
    if rank == 0:
        print(f"{world} FSDP ranks, debug model, medians of {args.steps - 2} steps\n")
        print("| tokens/step | AdamW ms | Muon ms | Muon/AdamW | AdamW state B/rank (matrices) | "
              "Muon state B/rank | ratio |\n|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
