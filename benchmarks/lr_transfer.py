"""Does the best learning rate stay put as the model grows? sp against mup across width, mup against completep across depth.

    python benchmarks/lr_transfer.py --out benchmarks/results/FILE.md [--steps 200] [--workers 2]

About an hour on 2 cores with the defaults (55 minutes measured). Every point trains the trainer's model and
optimizer (model.py, optimization/) in one process on one thread, on the offline stdlib corpus
(configs/debug.toml's data with a 1024-token tokenizer, windows of SEQ tokens), the same
batches in the same order for every point, a fixed budget (steps x BATCH x SEQ tokens), WSD
(warmup steps/10, decay over the last 20%, to 0), weight decay 0.1, gradient clipping at 1.
The score is the final validation loss on VAL_WINDOWS held-out windows (a diverged run scores
inf). LRs: a x2 grid, LRS. Sweeps, for AdamW and for Muon:
- width: dim 32, 64, 128, 256 (8x) at 2 layers, head_dim 32, ffn 8/3 dim; sp and mup (base_dim 32);
- depth: 2, 4, 8, 16 layers (8x) at dim 64; mup (no depth rule) and completep (base_n_layers 2).
Reported: the best LR of every size, how many grid steps it moves across the sizes, the loss
table, and a PNG of loss against LR, one curve per size (the mup paper's figure 1).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEQ, BATCH, VAL_WINDOWS, VOCAB = 64, 16, 64, 1024
LRS = [2.0 ** -k for k in range(11, 4, -1)]  # 4.9e-4 ... 3.1e-2
WIDTHS, DEPTHS = [32, 64, 128, 256], [2, 4, 8, 16]
SWEEPS = {  # name: (parametrization, sizes, axis)
    "sp width": ("sp", WIDTHS, "dim"),
    "mup width": ("mup", WIDTHS, "dim"),
    "mup depth": ("mup", DEPTHS, "n_layers"),
    "completep depth": ("completep", DEPTHS, "n_layers"),
}


def corpus(workdir: str):
    """The stdlib corpus tokenized once into workdir/data (prepare.prepare), as a PackedCorpus of SEQ windows."""
    import prepare
    from config import parse_config
    from data import PackedCorpus

    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "debug.toml"), "--run_dir", workdir,
                        "--model.vocab_size", str(VOCAB), "--data.tokenizer_vocab_size", str(VOCAB),
                        "--data.seq_len", str(SEQ)])
    folder = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(folder, "meta.json")):
        prepare.prepare(cfg.data, folder)
    return PackedCorpus(folder, cfg.data)


def model_args(parametrization: str, axis: str, size: int):
    from model import ModelArgs

    dim = size if axis == "dim" else 64
    n_layers = size if axis == "n_layers" else 2
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=dim // 32, n_kv_heads=dim // 32, vocab_size=VOCAB,
                     ffn_dim=32 * math.ceil(8 * dim / 3 / 32), max_seq_len=SEQ, parametrization=parametrization,
                     base_dim=32 if parametrization != "sp" and axis == "dim" else (64 if parametrization != "sp"
                                                                                    else 0),
                     base_n_layers=2 if parametrization == "completep" else 0)


def train_point(job: tuple) -> tuple:
    """(job, final val loss) of one (optimizer, sweep, size, lr, steps, workdir) point."""
    optim, sweep, size, lr, steps, workdir = job
    import torch
    import torch.nn.functional as F

    from model import Transformer
    from optimization.optimizers import OptimConfig, build_optimizer

    torch.set_num_threads(1)
    data = corpus(workdir)
    src = data.sources[0]
    parametrization, _, axis = SWEEPS[sweep]
    model = Transformer(model_args(parametrization, axis, size))
    model.init_weights(0)
    cfg = OptimConfig(name=optim, lr=lr, schedule="wsd", warmup_steps=max(1, steps // 10), decay_fraction=0.2,
                      weight_decay=0.1, grad_clip=1.0)
    opt, sched = build_optimizer(model, cfg, steps, fused=False)
    order = torch.randperm(src.n_train, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(steps):
        idx = [order[(step * BATCH + i) % len(order)] for i in range(BATCH)]
        x, y = data.batches([(0, i) for i in idx], BATCH)[0]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            return job, math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    val = [src.n_train + i for i in range(min(VAL_WINDOWS, src.n_val))]
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
                    for x, y in data.batches([(0, i) for i in val], BATCH))
    score = total / (len(val) * SEQ)
    return job, score if math.isfinite(score) else math.inf


def best_lr(scores: dict[float, float]) -> float | None:
    finite = {lr: s for lr, s in scores.items() if math.isfinite(s)}
    return min(finite, key=finite.get) if finite else None


def report(results: dict, steps: int) -> list[str]:
    """Markdown: per optimizer and sweep, the best LR per size and its move in grid steps, then the loss table."""
    lines = [f"Budget: {steps} steps x {BATCH} x {SEQ} = {steps * BATCH * SEQ:,} tokens per point; LR grid "
             + ", ".join(f"{lr:.2g}" for lr in LRS) + ".", "",
             "| optimizer | sweep | best LR per size | moves (grid steps of 2x) |", "|---|---|---|---|"]
    for optim in ("adamw", "muon"):
        for sweep, (_, sizes, axis) in SWEEPS.items():
            best = [best_lr(results[optim, sweep, s]) for s in sizes]
            idx = [LRS.index(b) for b in best if b is not None]
            moves = max(idx) - min(idx) if idx else "-"
            lines.append(f"| {optim} | {sweep} | " + ", ".join(
                f"{axis} {s}: {b:.2g}" if b else f"{axis} {s}: -" for s, b in zip(sizes, best)) + f" | {moves} |")
    lines += ["", "Final validation loss (inf: diverged):", "",
              "| optimizer | sweep | size | " + " | ".join(f"{lr:.2g}" for lr in LRS) + " |",
              "|---|---|---|" + "---|" * len(LRS)]
    for (optim, sweep, size), scores in results.items():
        lines.append(f"| {optim} | {sweep} | {size} | " + " | ".join(f"{scores[lr]:.3f}" for lr in LRS) + " |")
    return lines


def draw(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SWEEPS), figsize=(4 * len(SWEEPS), 6.4), squeeze=False)
    for r, optim in enumerate(("adamw", "muon")):
        for c, (sweep, (_, sizes, axis)) in enumerate(SWEEPS.items()):
            ax = axes[r][c]
            for s in sizes:
                ys = [results[optim, sweep, s][lr] for lr in LRS]
                ax.plot(LRS, [y if math.isfinite(y) else math.nan for y in ys], marker="o", label=f"{axis} {s}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{optim}: {sweep}", fontsize=9)
            ax.set_xlabel("optim.lr", fontsize=8)
            ax.set_ylabel("final val loss", fontsize=8)
            finite = [v for s in sizes for v in results[optim, sweep, s].values() if math.isfinite(v)]
            if finite:
                ax.set_ylim(min(finite) - 0.05, min(finite) + 1.0)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="markdown to append to; the PNG is written beside it")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "lr_transfer"))
    a = parser.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    corpus(a.workdir)  # tokenize once, before the workers
    jobs = [(optim, sweep, s, lr, a.steps, a.workdir) for optim in ("adamw", "muon")
            for sweep, (_, sizes, _) in SWEEPS.items() for s in sizes for lr in LRS]
    jobs.sort(key=lambda j: -(j[2] ** 2 if SWEEPS[j[1]][2] == "dim" else 64 ** 2 * j[2] / 2))  # largest first
    results: dict = {}
    t = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
        for n, (job, score) in enumerate(pool.imap_unordered(train_point, jobs), 1):
            optim, sweep, size, lr = job[:4]
            results.setdefault((optim, sweep, size), {})[lr] = score
            print(f"[{n}/{len(jobs)} {time.perf_counter() - t:.0f} s] {optim} {sweep} {size} lr {lr:.2g}: "
                  f"{score:.4f}", flush=True)
    results = {k: results[k] for k in sorted(results, key=lambda k: (k[0], list(SWEEPS).index(k[1]), k[2]))}
    png = os.path.splitext(a.out)[0] + ".png"
    draw(results, png)
    lines = report(results, a.steps) + ["", f"Figure: {os.path.relpath(png, ROOT)}; {time.perf_counter() - t:.0f} s "
                                            f"with {a.workers} workers."]
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
