"""Benchmark of context parallelism (parallel.cp, Ulysses): activation memory per rank, tokens/s, all-to-all bytes.

    python benchmarks/cp_bench.py --cps 1,2,4 --seq_len 8192 --steps 3 [--config ... --section.field value ...]

For each cp the driver launches `torchrun --nproc_per_node=cp` of this file (one CP group, dp 1),
which builds the run as the trainer does (build_trainable on layout.build_mesh with
cp), then on one synthetic sequence of seq_len tokens (one global batch, the same on every rank):

- step peak MiB: the profiler's peak of allocated CPU memory during one training step, above
  what was allocated before it (parameters and AdamW state stay out; activations, gradients and
  transients are in), on rank 0 (torch.cuda.max_memory_allocated on CUDA);
- saved MiB: bytes of the tensors autograd saves for backward in one forward (distinct storages),
  the activation memory proper;
- tokens/s: seq_len over the median step time of --steps timed steps (after one warm-up);
- all-to-all: elements into each Ulysses all-to-all of one forward, per layer and rank, counted on
  the calls, against the formula (2 n_heads + 2 n_kv_heads) x head_dim x seq_len / cp (the
  backward moves as many again; (cp - 1) / cp of them leave the rank).

Prints a markdown table and writes every figure as JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import config as config_lib  # noqa: E402
from parallel import context_parallel, distributed  # noqa: E402
from parallel import layout as parallel_layout  # noqa: E402
from training.step import build_trainable, train_step  # noqa: E402

MIB = 2 ** 20
DEFAULTS = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--model.n_kv_heads", "4",
            "--train.global_batch_size", "1", "--train.log_interval", "1"]


def step_peak_bytes(s, batch) -> int:
    """Peak allocated bytes above the start during one train_step (CPU: profiler memory events)."""
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
        start = torch.cuda.memory_allocated(s.device)
        train_step(s, batch)
        return torch.cuda.max_memory_allocated(s.device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(s, batch)
    running = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        if e.device_type() == torch.autograd.DeviceType.CPU:
            running += e.nbytes()
            peak = max(peak, running)
    return peak


def saved_bytes(s, batch) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of batch (then backward)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
                pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        train_step(s, batch)
    return sum(seen.values())


def worker(args, rest) -> None:
    cfg = config_lib.parse_config([*DEFAULTS, "--data.seq_len", str(args.seq_len), "--model.max_seq_len",
                                   str(max(args.seq_len, 512)), "--parallel.cp", str(args.cp), *rest])
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = parallel_layout.build_mesh(device, world, cfg.parallel)
    s = build_trainable(cfg, rank, mesh, device)
    gen = torch.Generator().manual_seed(0)  # the same sequence on every rank: one CP group's global batch
    window = torch.randint(3, cfg.model.vocab_size, (1, args.seq_len + 1), generator=gen)
    batch = [(window[:, :-1], window[:, 1:])]

    calls = []
    inner = context_parallel.funcol.all_to_all_single_autograd

    def counting(x, *a, **k):
        calls.append(x.numel())
        return inner(x, *a, **k)

    train_step(s, batch)  # warm-up
    context_parallel.funcol.all_to_all_single_autograd = counting
    with torch.no_grad():
        inputs, labels, layout = context_parallel.shard_batch(s.model, window[:, :-1], window[:, 1:], mesh.cp)
        s.model(inputs, layout=layout)
    context_parallel.funcol.all_to_all_single_autograd = inner
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        train_step(s, batch)
        dist.barrier()
        times.append(time.perf_counter() - t)
    peak = step_peak_bytes(s, batch)
    saved = saved_bytes(s, batch)
    m = cfg.model
    formula = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim * args.seq_len // args.cp if args.cp > 1 else 0
    out = {"cp": args.cp, "seq_len": args.seq_len, "step_s": statistics.median(times), "step_s_all": times,
           "tokens_per_s": args.seq_len / statistics.median(times), "step_peak_mib": peak / MIB,
           "saved_mib": saved / MIB, "a2a_calls_per_forward": len(calls),
           "a2a_elements_per_layer": sum(calls) / m.n_layers, "a2a_formula_per_layer": formula,
           "a2a_bytes_leaving_per_layer": sum(calls) / m.n_layers * 4 * (args.cp - 1) / args.cp}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    distributed.finish_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cps", default="1,2,4", help="comma-separated CP degrees to measure")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cp (median)")
    parser.add_argument("--json", default="", help="write every figure here")
    parser.add_argument("--cp", type=int, default=0, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.cp:
        return worker(args, rest)
    results = []
    tmp = tempfile.mkdtemp(prefix="cp_bench_")
    for cp in [int(c) for c in args.cps.split(",")]:
        out = os.path.join(tmp, f"cp{cp}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
               os.path.abspath(__file__), "--cp", str(cp), "--out", out, "--seq_len", str(args.seq_len),
               "--steps", str(args.steps), "--run_dir", os.path.join(tmp, f"run{cp}"), *rest]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            results.append(json.load(f))
    base = results[0]
    print("| cp | step s (median) | tokens/s | step peak MiB (rank 0) | vs cp 1 | saved for backward MiB | vs cp 1 "
          "| all-to-all elements per layer (fwd) | formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['cp']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['step_peak_mib']:.0f} | "
              f"{r['step_peak_mib'] / base['step_peak_mib']:.2f}x | {r['saved_mib']:.0f} | "
              f"{r['saved_mib'] / base['saved_mib']:.2f}x | {r['a2a_elements_per_layer']:,.0f} | "
              f"{r['a2a_formula_per_layer']:,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
