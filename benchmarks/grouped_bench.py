"""The MoE experts' grouped matmul against the loop over experts: the trainer's step time, one process, paired.

    OMP_NUM_THREADS=1 python benchmarks/grouped_bench.py --experts 8,64 --steps 15 [--threads 1] [train flags]

Variants, all built in this process from the same seed (benchmarks/bench.py's OursStep: the trainer's
train_step, forward, backward and AdamW step, on random tokens of the debug config unless flags say
otherwise): the dense model, and for each E an MoE of E experts top-2 of width ffn_dim / 2 (the dense
model's active parameters, as benchmarks/moe_bench.py), once with nn/grouped_mm.py's choice (the
kernel, torch._grouped_mm, where it runs) and once with the loop over experts forced (the code before
the kernel ran on CPU). Each timed round steps every variant once, the order rotated; printed: each
variant's median step time and tokens/s, the median of paired (same round) ratios loop / grouped,
and each MoE's time per token over dense's (the same tokens per step).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import bench  # benchmarks/bench.py: puts the checkout on sys.path
import config as config_lib
from nn import grouped_mm
from parallel import distributed, layout


@contextlib.contextmanager
def loop_forced(on: bool):
    """nn/grouped_mm.py's loop for every grouped matmul inside, when on."""
    if not on:
        yield
        return
    saved = grouped_mm.kernel_applies
    grouped_mm.kernel_applies = lambda x, w: False
    try:
        yield
    finally:
        grouped_mm.kernel_applies = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,64", help="expert counts, comma-separated")
    p.add_argument("--steps", type=int, default=15, help="timed rounds (each steps every variant once)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--threads", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    base = ["--config", os.path.join(bench.ROOT, "configs", "debug.toml"),
            "--run_dir", os.path.join(bench.ROOT, "runs", "grouped_bench"), *rest]
    cfg = config_lib.parse_config(base)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = layout.build_mesh(device, world)
    ffn = cfg.model.ffn_dim
    variants = [("dense", bench.OursStep("dense", cfg, mesh, device), False)]
    for e in (int(x) for x in args.experts.split(",")):
        flags = ["--model.n_experts", str(e), "--model.experts_per_token", "2", "--model.expert_ffn_dim", str(ffn // 2)]
        for path in ("grouped", "loop"):
            name = f"E={e} {path}"
            variants.append((name, bench.OursStep(name, config_lib.parse_config(base + flags), mesh, device),
                             path == "loop"))
    batches = bench.synthetic_batches(cfg, world, args.warmup + args.steps)
    for _, v, loop in variants:
        for i in range(args.warmup):
            with loop_forced(loop):
                v.step(batches[i])
    times = {name: [] for name, _, _ in variants}
    for r, i in enumerate(range(args.warmup, args.warmup + args.steps)):
        for name, v, loop in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotate the order
            with loop_forced(loop):
                t0 = time.perf_counter()
                v.step(batches[i])
                times[name].append(time.perf_counter() - t0)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    print(f"`OMP_NUM_THREADS={args.threads} python benchmarks/grouped_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
          f" (torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.steps} rounds after {args.warmup} "
          f"warm-up steps, {tokens} tokens a step)\n")
    print("| variant | step s, median (min-max) | tokens/s | per token vs dense, median of paired | loop / grouped, median of paired |")
    print("|---|---|---|---|---|")
    dense = times["dense"]
    for name, _, _ in variants:
        t = times[name]
        vs_dense = statistics.median(a / b for a, b in zip(t, dense))
        pair = ""
        if name.endswith("grouped"):
            pair = f"{statistics.median(a / b for a, b in zip(times[name.replace('grouped', 'loop')], t)):.2f}x"
        print(f"| {name} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | {tokens / statistics.median(t):.0f} | "
              f"{vs_dense:.2f}x | {pair} |", flush=True)
    dist.barrier()
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
