"""Runs that diverge, side by side: no guard, the spike guard (train.spike_skip), rollback (train.rollback) +- an LR factor.

    python benchmarks/rollback_bench.py --out benchmarks/results/FILE.md [--steps 150] [--workdir DIR]

One process per run (torchrun --nproc_per_node=1 train_fsdp.py, configs/debug.toml's model and
offline corpus), the same seed and data order, in two scenarios:

- lr: the LR is too high for the model (lr 1, no gradient clipping, a warmup of 50 steps):
  the loss blows up as the LR ramps, whatever the data;
- data: the debug LR, and a data stage of random characters for 20 steps in the middle of the
  run (the acceptance check's fault): the data, not the LR, makes the loss diverge.

Reported per arm: the final val_loss (of the clean source in the data scenario), the lowest train loss over the last 10 steps, updates
skipped, rollbacks, the steps lost to them (trained and then undone: the divergent step minus
the step rolled back to, summed), batches skipped, whether the run reached the last step (a
spent rollback budget stops it with exit status 2), and the wall-clock of the whole run
(start-up included).
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
GUARD = ["--train.spike_skip", "3", "--train.spike_window", "8"]
SCENARIOS = {
    "lr": ["--optim.lr", "1", "--optim.grad_clip", "0", "--optim.warmup_steps", "50"],
    "data": ["--config", "POISON"],
}
ARMS = {
    "no guard": [],
    "spike_skip 3": GUARD,
    "rollback 8 (spike_skip 3, rollback_after 2)": [*GUARD, "--train.rollback", "8", "--train.rollback_after", "2"],
    "rollback 8, rollback_lr_factor 0.5": [*GUARD, "--train.rollback", "8", "--train.rollback_after", "2",
                                           "--train.rollback_lr_factor", "0.5"],
}


def poison_config(workdir: str) -> str:
    """configs/debug.toml with a source of random characters that takes every sample of batches 61-70."""
    import random
    rng = random.Random(0)
    poison = os.path.join(workdir, "poison.jsonl")
    with open(poison, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": "".join(chr(rng.randrange(0x21, 0x2400)) for _ in range(3000))}) + "\n")
    path = os.path.join(workdir, "poison.toml")
    with open(os.path.join(ROOT, "configs", "debug.toml")) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text + f'\n[[data.sources]]\nname = "clean"\ndataset = "stdlib"\nweight = 1.0\n'
                f'[[data.sources]]\nname = "poison"\ndataset = "{poison}"\nweight = 0.0\n'
                '[[data.stages]]\nstart_step = 60\nweights = { clean = 0.0, poison = 1.0 }\n'
                '[[data.stages]]\nstart_step = 70\nweights = { clean = 1.0, poison = 0.0 }\n')
    return path


def run(run_dir: str, extra: list[str], steps: int, data: str | None, log) -> tuple[list[dict], float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    if data:  # the corpus tokenized once, for every arm of a scenario
        shutil.copytree(data, os.path.join(run_dir, "data"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "train_fsdp.py"), "--config", os.path.join(ROOT, "configs", "debug.toml"),
           "--run_dir", run_dir, "--train.steps", str(steps), "--train.val_interval", str(steps),
           "--checkpoint.interval", "10", "--checkpoint.keep", "3", "--train.nonfinite", "skip", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    seconds = time.perf_counter() - start
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return records, seconds


def summary(records: list[dict], seconds: float, steps: int) -> dict:
    """The table's figures of one run, from its metrics.jsonl records."""
    train = {r["step"]: r for r in records if "loss" in r}
    val = [r.get("val_loss/clean", r["val_loss"]) for r in records if "val_loss" in r]  # the poison's own aside
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
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--workdir", default="/tmp/rollback_bench")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    poison = poison_config(args.workdir)
    lines = ["# Rollback benchmark: the debug model, 1 process, " + f"{args.steps} steps", "",
             f"`python benchmarks/rollback_bench.py --steps {args.steps} --out {args.out}`", ""]
    with open(os.path.join(args.workdir, "log.txt"), "w") as log:
        for scenario, flags in SCENARIOS.items():
            flags = [poison if f == "POISON" else f for f in flags]
            lines += [f"## {scenario}: `{' '.join(flags)}`", "",
                      "| arm | final val_loss | min train loss, last 10 steps | updates skipped | rollbacks | "
                      "steps lost | batches skipped | finished | wall-clock s |", "|---|---|---|---|---|---|---|---|---|"]
            data = None
            for i, (name, extra) in enumerate(ARMS.items()):
                run_dir = os.path.join(args.workdir, f"{scenario}{i}")
                r = summary(*run(run_dir, [*flags, *extra], args.steps, data, log), args.steps)
                data = data or os.path.join(run_dir, "data")
                print(scenario, name, r, flush=True)
                lines.append(f"| {name} | {r['val_loss']:.4f} | {r['last10_min_loss']:.4f} | {r['skipped_updates']} "
                             f"| {r['rollbacks']} | {r['steps_lost']} | {r['batches_skipped']} | {r['finished']} | "
                             f"{r['seconds']:.0f} |")
            lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
