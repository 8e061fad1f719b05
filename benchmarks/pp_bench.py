"""Pipeline parallelism on CPU: each schedule's measured bubble against its theory, tokens/s against FSDP at the same
world size, and memory per rank at pp 1, 2, 4.

    python benchmarks/pp_bench.py --out benchmarks/results/FILE.md [--steps 5] [--workdir DIR] [--rows 'A,B']

The debug model with 8 layers (configs/debug.toml, n_kv_heads 4), seq 128, global batch 16,
random tokens, fp32, AdamW. Each row is this script as a torchrun worker (--worker; every
process with OMP_NUM_THREADS=1, one row at a time): world 2 and 4, FSDP alone (dp = world) and
pp = world with each schedule run here (8 micro-batches; every schedule but 1F1B and GPipe with
2 stages per rank). Per rank and step, over --steps steps after 2 (the first infers the shapes):

- bubble: 1 - (time inside the stages' forward and backward calls) / (time inside the
  schedule's step; the weight-gradient passes of the zero-bubble schedules count as compute), the
  idle share of the pipelined part of the step; the median over steps,
  averaged over ranks. Theory: (p - 1) / (v m + p - 1) with v stages per rank (Narayanan et
  al. 2021 for 1F1B, GPipe and interleaved 1F1B; Lamy-Poirier 2023 for breadth-first);
- tokens/s: the global batch's tokens over the median whole-step time (the slowest rank);
- memory per rank: this rank's parameters and AdamW state (local shards), the peak of the
  bytes autograd holds for backward (saved-tensor hooks: each saved tensor counted from its
  save until the graph drops it), and the process's peak RSS; the largest over ranks.

With 4 processes on 2 cores the ranks share cores, so the pp 4 bubble and speed read high and
low; pp 2 runs one process per core.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BASE = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--model.n_layers", "8", "--model.n_kv_heads", "4",
        "--data.seq_len", "128", "--train.global_batch_size", "16", "--train.dtype", "float32",
        "--train.steps", "1000", "--optim.warmup_steps", "10"]
MICRO = 8
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ROWS = [(1, "pp 1 (1 process)", []), (2, "FSDP 2", [])] + [
    (2, f"pp 2 {s}", ["--parallel.pp", "2", "--parallel.pp_schedule", s]) for s in SCHEDULES] + [
    (4, "FSDP 4", [])] + [(4, f"pp 4 {s}", ["--parallel.pp", "4", "--parallel.pp_schedule", s]) for s in SCHEDULES]
"""(world, label, flags) of each row."""


class _Saved:
    """A tensor autograd saved for backward, counted in _Saved.live from its save until the graph drops it."""

    live = peak = 0

    def __init__(self, t):
        self.t, self.n = t, t.numel() * t.element_size()
        _Saved.live += self.n
        _Saved.peak = max(_Saved.peak, _Saved.live)

    def __del__(self):
        _Saved.live -= self.n


def worker(argv: list[str]) -> None:
    """One row (under torchrun): build the trainer's model and optimizer, time the steps, rank 0 writes the json."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import stage as pp_stage

    from bench import local_bytes, synthetic_batches, worker_trainable
    from training.step import train_step

    a, cfg, rank, world, mesh, t = worker_trainable(argv, 5)
    busy = [0.0, 0.0]  # [inside the stages' compute, inside the schedule's step] this step, seconds

    def timed(fn, slot):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[slot] += time.perf_counter() - t0
        return wrapper

    base = pp_stage._PipelineStageBase
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, name, timed(getattr(base, name), 0))
    if mesh.pp is not None:
        t.runner.schedule.step = timed(t.runner.schedule.step, 1)

    batches = synthetic_batches(cfg, mesh.size("data"), 2 + a.steps)
    for b in batches[:2]:  # shape inference, then a first ordinary step
        train_step(t, b)
    state = [v for s in t.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    walls, idle = [], []
    _Saved.peak = 0
    for b in batches[2:]:
        dist.barrier()
        busy[:] = [0.0, 0.0]
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda s: s.t):
            train_step(t, b)
        walls.append(time.perf_counter() - t0)
        if busy[1]:
            idle.append(1 - busy[0] / busy[1])
    out = torch.tensor([statistics.median(walls), statistics.median(idle) if idle else 0.0, local_bytes(t.model.parameters()),
                        local_bytes(state), _Saved.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0],
                       dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    if rank == 0:
        g = torch.stack(gathered)
        with open(a.json, "w") as f:
            json.dump({"step_s": g[:, 0].max().item(), "bubble": g[:, 1].mean().item(),
                       "params": g[:, 2].max().item(), "optim": g[:, 3].max().item(),
                       "saved": g[:, 4].max().item(), "rss": g[:, 5].max().item(),
                       "tokens": cfg.train.global_batch_size * cfg.data.seq_len}, f)
    dist.destroy_process_group()


def theory(label: str) -> str:
    """(p - 1) / (v m + p - 1) for a pipelined row, '-' otherwise; about 0 for the zero-bubble schedules (Qi et al.
    2024, when a forward, an input-gradient and a weight-gradient pass take the same time)."""
    if not label.startswith("pp ") or label.startswith("pp 1"):
        return "-"
    if label.endswith(("ZeroBubble", "DualPipeV")):
        return "~0"
    p = int(label.split()[1])
    v = 2 if label.endswith(("Interleaved1F1B", "LoopedBFS")) else 1
    return f"{(p - 1) / (v * MICRO + p - 1):.0%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="the Markdown table's file (required but in --worker)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row")
    ap.add_argument("--workdir", default="/tmp/pp_bench", help="scratch folder (each row's json and log)")
    ap.add_argument("--rows", default="", help="comma-separated row labels to run (e.g. 'FSDP 2,pp 2 1F1B'); all "
                                                "by default")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        worker(["--steps", str(args.steps), *rest])
        return 0
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.workdir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    lines = ["| layout (world) | step s | tokens/s | bubble measured | bubble theory | params / rank | AdamW state / rank "
             "| saved activations peak / rank | peak RSS / rank |", "|---|---|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    cmds = []
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(wanted) - {label for _, label, _ in ROWS})
    if unknown:
        ap.error(f"--rows: unknown label(s) {', '.join(unknown)}; the rows are: {', '.join(r[1] for r in ROWS)}")
    for i, (world, label, flags) in enumerate(ROWS):
        if wanted and label not in wanted:
            continue
        js = os.path.join(args.workdir, f"row{i}.json")
        micro = ["--parallel.pp_microbatches", str(MICRO)] if flags else []
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__, "--worker",
               "--steps", str(args.steps), "--json", js, *BASE, *flags, *micro]
        cmds.append("torchrun " + shlex.join(cmd[2:]).replace(ROOT + "/", ""))
        with open(os.path.join(args.workdir, f"row{i}.log"), "w") as log:
            subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                           check=True, timeout=900)
        with open(js) as f:
            r = json.load(f)
        lines.append(f"| {label} ({world}) | {r['step_s']:.3f} | {r['tokens'] / r['step_s']:,.0f} | "
                     f"{r['bubble']:.0%} | {theory(label)} | {mib(r['params'])} | {mib(r['optim'])} | "
                     f"{mib(r['saved'])} | {mib(r['rss'])} |" if "pp " in label and "pp 1" not in label else
                     f"| {label} ({world}) | {r['step_s']:.3f} | {r['tokens'] / r['step_s']:,.0f} | - | - | "
                     f"{mib(r['params'])} | {mib(r['optim'])} | {mib(r['saved'])} | {mib(r['rss'])} |")
        print(lines[-1], flush=True)
    text = "\n".join(["# Pipeline schedules on CPU: bubble, speed against FSDP, memory per rank", "",
                      "```bash", f"python benchmarks/pp_bench.py --out {args.out} --steps {args.steps}"
                      + (f" --rows {shlex.quote(args.rows)}" if wanted else ""), "```", "",
                      f"Rows, each a torchrun launch (e.g. `{cmds[-1]}`); the script's docstring defines every "
                      f"column. Micro-batches m = {MICRO}.", "", *lines, ""])
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
