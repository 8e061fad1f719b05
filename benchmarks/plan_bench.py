"""plan.py's predicted step time against real runs on this CPU: tokens/s per layout, the error of each.

    python benchmarks/plan_bench.py --out benchmarks/results/FILE.md [--steps 12] [--workdir DIR] [--rows 'A,B']

Each row trains the trainer itself (torchrun, gloo, OMP_NUM_THREADS=1 per rank, one row at a
time) for --steps steps, logged every step, no validation or checkpoints, on data prepared once;
measured tokens/s is the median of the train records' tokens_per_sec after the first 2 steps.
Then `plan.py --gpu cpu --json` plans the same command; the error is predicted / measured - 1.
The debug model (dim 128, 4 layers, seq 128) and a wider one (dim 512, 8 layers, seq 256).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = ("--model.dim", "512", "--model.n_layers", "8", "--model.n_heads", "8", "--model.n_kv_heads", "4",
        "--model.ffn_dim", "1536", "--data.seq_len", "256")
MOE = ("--model.n_experts", "8", "--model.experts_per_token", "2", "--parallel.ep", "2")
ROWS = {
    "debug 1 fsdp": (1, ()), "debug 2 fsdp": (2, ()), "debug 4 fsdp": (4, ()),
    "debug 2 tp2": (2, ("--parallel.tp", "2")), "debug 4 dp2 tp2": (4, ("--parallel.tp", "2")),
    "debug 2 ep2": (2, MOE), "debug 4 ep2": (4, MOE),
    "wide 1 fsdp": (1, WIDE), "wide 2 fsdp": (2, WIDE), "wide 2 tp2": (2, (*WIDE, "--parallel.tp", "2")),
    "wide 2 ep2": (2, (*WIDE, *MOE)),
}


def run(cmd: list[str], timeout: float = 1800) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def measure(world: int, overrides: tuple, steps: int, work: str, prepared: str) -> float:
    """Median tokens/s of a real run after its first 2 steps."""
    script = "train_2d.py" if "--parallel.tp" in overrides else "train_fsdp.py"
    run_dir = os.path.join(work, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", script,
         "--config", "configs/debug.toml", "--run_dir", run_dir, "--data.prepared", prepared, *overrides,
         "--train.steps", str(steps), "--train.log_interval", "1", "--train.val_interval", "0",
         "--checkpoint.interval", "100000"])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        tps = [r["tokens_per_sec"] for r in map(json.loads, f) if "tokens_per_sec" in r and r["step"] > 2]
    return statistics.median(tps)


def predict(world: int, overrides: tuple, work: str) -> dict:
    out = os.path.join(work, "plan.json")
    run([sys.executable, "plan.py", "--config", "configs/debug.toml", "--world_size", str(world), "--gpu", "cpu",
         *overrides, "--json", out])
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workdir", default="")
    p.add_argument("--rows", default=",".join(ROWS))
    a = p.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="plan_bench_")
    prepared = os.path.join(work, "prep")
    if not os.path.isdir(os.path.join(prepared, "data")):
        run([sys.executable, "prepare.py", "--config", "configs/debug.toml", "--run_dir", prepared])
    lines = ["| row | measured tokens/s | predicted | error | predicted compute / exposed comm / optimizer (s) |",
             "|---|---|---|---|---|"]
    for name in a.rows.split(","):
        world, overrides = ROWS[name]
        started = time.time()
        measured = measure(world, overrides, a.steps, work, os.path.join(prepared, "data"))
        plan = predict(world, overrides, work)
        r = plan["ranks"][0]
        lines.append(f"| {name} | {measured:,.0f} | {plan['predicted_tokens_per_sec']:,.0f} | "
                     f"{plan['predicted_tokens_per_sec'] / measured - 1:+.0%} | {r['compute_s']:.3f} / "
                     f"{r['exposed_comm_s']:.3f} / {r['optimizer_s']:.3f} |")
        print(lines[-1], f"({time.time() - started:.0f} s)", flush=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
