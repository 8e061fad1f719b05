"""Tokens to a target validation loss: AdamW + cosine (baseline) against AdamW + WSD, Muon + WSD (+ batch ramp).

    python benchmarks/recipe_bench.py --out benchmarks/results/FILE.md [--steps 80] [--workdir DIR]

One process per run (torchrun --nproc_per_node=1 train_fsdp.py, configs/debug.toml's offline
stdlib corpus), a model a few times the debug model (SHAPE below: dim 192, 6 layers, 2.36M
parameters outside the embedding and output), the same data order for every recipe (the
same train.seed). Each recipe's LR is swept over LRS at seed 0; the best LR (lowest final
val_loss) is run again at seed 1. Reported: the final val_loss at the fixed budget (mean of
the 2 seeds), and the tokens each recipe's runs need to first reach the tuned baseline's final
val_loss (validated every VAL_EVERY steps), as a ratio of the baseline's budget. The ramp
recipe trains at half the batch for the first quarter of the steps, and steps // 8 more steps
after, so that its budget in tokens is the others' (the LR schedule runs in samples).
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
sys.path.insert(0, ROOT)

from model import PRESETS, ModelArgs, num_params  # noqa: E402

SHAPE = {"dim": 192, "n_layers": 6, "n_heads": 6, "n_kv_heads": 2, "ffn_dim": 512}
"""The benchmark's model: [model] fields over configs/debug.toml's debug preset."""
ADAMW_LRS = ["3e-4", "1e-3", "3e-3", "1e-2"]
MUON_LRS = ["1e-3", "3e-3", "1e-2"]
VAL_EVERY = 8
RECIPES = {  # name: (overrides, LRs swept)
    "adamw+cosine": (["--optim.name", "adamw", "--optim.schedule", "cosine"], ADAMW_LRS),
    "adamw+wsd": (["--optim.name", "adamw", "--optim.schedule", "wsd"], ADAMW_LRS),
    "muon+wsd": (["--optim.name", "muon", "--optim.schedule", "wsd"], MUON_LRS),
    "muon+wsd+ramp": (["--optim.name", "muon", "--optim.schedule", "wsd", "--config", "RAMP"], MUON_LRS),
}


def non_embedding_params() -> int:
    """Parameters of SHAPE outside the embedding and the output projection (model.num_params less both)."""
    a = ModelArgs(**{**PRESETS["debug"], **SHAPE})
    return num_params(a) - 2 * a.vocab_size * a.dim


def shape_flags() -> list[str]:
    """SHAPE as --model.FIELD VALUE overrides."""
    return [x for k, v in SHAPE.items() for x in (f"--model.{k}", str(v))]


def run(workdir: str, name: str, overrides: list[str], steps: int, warmup: int, seed: int, data: str | None,
        log) -> list[dict]:
    run_dir = os.path.join(workdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    if data:  # the corpus tokenized once, for every run
        shutil.copytree(data, os.path.join(run_dir, "data"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "train_fsdp.py"), "--config", os.path.join(ROOT, "configs", "debug.toml"),
           "--run_dir", run_dir, *shape_flags(), "--train.steps", str(steps), "--train.seed", str(seed),
           "--optim.warmup_steps", str(warmup), "--train.val_interval", str(VAL_EVERY),
           "--checkpoint.interval", "100000", "--train.log_interval", str(VAL_EVERY), *overrides]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    print(f"{name}: {time.perf_counter() - t:.0f} s, final val_loss "
          f"{[r['val_loss'] for r in records if 'val_loss' in r][-1]:.4f}", flush=True)
    return records


def curve(records: list[dict]) -> list[tuple[int, int, float]]:
    """[(step, tokens_seen, val_loss)] of a run: the train record of every validated step holds its tokens
    (log_interval = VAL_EVERY), exact under a batch ramp too."""
    tokens = {r["step"]: r["tokens_seen"] for r in records if "tokens_seen" in r}
    return [(r["step"], tokens[r["step"]], r["val_loss"]) for r in records if "val_loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "recipe_bench"))
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    ramp = os.path.join(args.workdir, "ramp.toml")
    with open(os.path.join(ROOT, "configs", "debug.toml")) as f:
        base = f.read()
    with open(ramp, "w") as f:  # 8 sequences a step for the first quarter, then the debug batch of 16
        f.write(base.replace("global_batch_size = 16", "global_batch_size = 8") +
                f"\n[[train.batch_stages]]\nstart_step = {args.steps // 4}\nglobal_batch_size = 16\n")
    log = open(os.path.join(args.workdir, "runs.log"), "w")
    data, results = None, {}
    for recipe, (overrides, lrs) in RECIPES.items():
        steps = args.steps + args.steps // 8 if "RAMP" in overrides else args.steps
        warmup = max(1, args.steps // 10)
        overrides = [ramp if o == "RAMP" else o for o in overrides]
        sweep = {}
        for lr in lrs:
            sweep[lr] = run(args.workdir, f"{recipe}_lr{lr}_s0", [*overrides, "--optim.lr", lr], steps, warmup, 0,
                            data, log)
            data = data or os.path.join(args.workdir, f"{recipe}_lr{lr}_s0", "data")
        best = min(sweep, key=lambda lr: curve(sweep[lr])[-1][2])
        seed1 = run(args.workdir, f"{recipe}_lr{best}_s1", [*overrides, "--optim.lr", best], steps, warmup, 1,
                    data, log)
        results[recipe] = {"sweep": {lr: curve(r)[-1][2] for lr, r in sweep.items()}, "best": best,
                           "curves": [curve(sweep[best]), curve(seed1)]}
    base_curves = results["adamw+cosine"]["curves"]
    target = sum(c[-1][2] for c in base_curves) / 2
    budget = base_curves[0][-1][1]
    lines = [f"Target: the tuned baseline's final val_loss (mean of 2 seeds) = {target:.4f} at {budget:,} tokens "
             f"({args.steps} steps x 16 x 128); non-embedding parameters {non_embedding_params():,}.", "",
             "| recipe | LR sweep (final val_loss, seed 0) | best LR | val_loss at budget (seeds 0, 1) | "
             "tokens to target (seeds 0, 1) | ratio to baseline |", "|---|---|---|---|---|---|"]
    for recipe, r in results.items():
        reach = [next((tok for _, tok, v in c if v <= target), None) for c in r["curves"]]
        finals = [c[-1][2] for c in r["curves"]]
        ratio = (f"{sum(reach) / len(reach) / budget:.2f}x" if all(x is not None for x in reach) else
                 "not reached" + (" by a seed" if any(x is not None for x in reach) else ""))
        lines.append(f"| {recipe} | " + ", ".join(f"{lr}: {v:.4f}" for lr, v in r["sweep"].items()) +
                     f" | {r['best']} | {finals[0]:.4f}, {finals[1]:.4f} (mean {sum(finals) / 2:.4f}) | "
                     + ", ".join(f"{x:,}" if x is not None else "-" for x in reach) + f" | {ratio} |")
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
