"""A run that diverges, side by side: no guard, the spike guard (train.spike_skip), and rollback (train.rollback).

    python benchmarks/rollback_bench.py --out benchmarks/results/FILE.md [--lr 3e-2] [--steps 150] [--workdir DIR]

One process per run (torchrun --nproc_per_node=1 train_fsdp.py, configs/debug.toml's model and
offline corpus), the same seed and data order, at an LR high enough for the debug model to
diverge without help. Reported per arm: the final val_loss, the lowest train loss over the last
10 steps, updates skipped, rollbacks, the steps lost to them (trained and then undone: the
divergent step minus the step rolled back to, summed), batches skipped, and the wall-clock of
the whole run (start-up included). A fourth arm lowers the LR by half after each rollback
(train.rollback_lr_factor).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD = ["--train.spike_skip", "3", "--train.spike_window", "16"]
ARMS = {
    "no guard": [],
    "spike_skip 3": GUARD,
    "rollback 8 (spike_skip 3, rollback_after 2)": [*GUARD, "--train.rollback", "8", "--train.rollback_after", "2"],
    "rollback 8, rollback_lr_factor 0.5": [*GUARD, "--train.rollback", "8", "--train.rollback_after", "2",
                                           "--train.rollback_lr_factor", "0.5"],
}


def run(workdir: str, name: str, extra: list[str], args, data: str | None, log) -> tuple[list[dict], float]:
    run_dir = os.path.join(workdir, "arm" + str(list(ARMS).index(name)))
    shutil.rmtree(run_dir, ignore_errors=True)
    if data:  # the corpus tokenized once, for every arm
        shutil.copytree(data, os.path.join(run_dir, "data"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "train_fsdp.py"), "--config", os.path.join(ROOT, "configs", "debug.toml"),
           "--run_dir", run_dir, "--train.steps", str(args.steps), "--optim.lr", args.lr,
           "--train.val_interval", str(args.steps), "--checkpoint.interval", "10", "--checkpoint.keep", "3",
           "--train.nonfinite", "skip", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    seconds = time.perf_counter() - start
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return records, seconds


def summary(records: list[dict], seconds: float, steps: int) -> dict:
    train = {r["step"]: r for r in records if "loss" in r}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    rollbacks = [r for r in records if "rollback" in r]
    last = [train[s]["loss"] for s in range(steps - 9, steps + 1) if s in train]
    return {"val_loss": val[-1] if val else float("nan"), "last10_min_loss": min(last) if last else float("nan"),
            "skipped_updates": sum(1 for r in train.values() if r.get("skipped")),
            "rollbacks": len(rollbacks), "steps_lost": sum(r["step"] - r["rollback"]["to_step"] for r in rollbacks),
            "batches_skipped": sum(r["rollback"]["skip"][1] - r["rollback"]["skip"][0] + 1 for r in rollbacks),
            "finished": max(train, default=0) == steps, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--lr", default="3e-2")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--workdir", default="/tmp/rollback_bench")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows, data = {}, None
    with open(os.path.join(args.workdir, "log.txt"), "w") as log:
        for name, extra in ARMS.items():
            rows[name] = summary(*run(args.workdir, name, extra, args, data, log), args.steps)
            data = data or os.path.join(args.workdir, "arm0", "data")
            print(name, rows[name], flush=True)
    lines = [f"# Rollback benchmark: debug model at lr {args.lr}, {args.steps} steps, 1 process",
             "", f"`python benchmarks/rollback_bench.py --lr {args.lr} --steps {args.steps} --out {args.out}`", "",
             "| arm | final val_loss | min train loss, last 10 steps | updates skipped | rollbacks | steps lost | "
             "batches skipped | finished | wall-clock s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['val_loss']:.4f} | {r['last10_min_loss']:.4f} | {r['skipped_updates']} | "
                     f"{r['rollbacks']} | {r['steps_lost']} | {r['batches_skipped']} | {r['finished']} | "
                     f"{r['seconds']:.0f} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
