"""Coordinate check (Tensor Programs V, fig. 5): does an activation's or an update's size grow with width or depth?

    python benchmarks/coord_check.py --out benchmarks/results/coord_check.png [--optim adamw|muon] [--steps 4]

Trains each shape for a few steps (one process, Zipf-distributed random tokens, the same batches for
every shape, the trainer's model and optimizer) and records, at every step t, the RMS of each
module's output in the forward of step t (the weights after t - 1 updates): the token
embedding, each block's attention and feed-forward branches (their multiplier included) and the
block's output, and the logits; and the RMS of each weight's update at step t. Widths 64 ... 1024
under sp and mup (base_dim = the smallest width), depths 2 ... 32 under completep (base_n_layers
2, width 64). Under a parametrization that transfers, every curve is flat in width (depth);
under sp, the branches' outputs and the logits grow with width after the first update.
The PNG has one row per parametrization and quantity and one column per step. tests/test_parametrization.py
runs a small version of it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import ModelArgs, Transformer  # noqa: E402
from optimization.optimizers import OptimConfig, build_optimizer  # noqa: E402

VOCAB, SEQ, BATCH, HEADS = 256, 32, 8, 4
KINDS = ("embedding", "attention", "feed_forward", "block", "logits")
"""Activation kinds recorded (block: a block's output, the residual stream; branches and blocks averaged over layers)."""
UPDATES = ("embedding", "hidden", "output")
"""Weight kinds whose update RMS is recorded (hidden: the blocks' matrices, averaged)."""


def shape(width: int, depth: int, parametrization: str, base_dim: int, base_n_layers: int) -> ModelArgs:
    """The model of one point: HEADS heads (head_dim grows with the width), an MLP 4x as wide."""
    return ModelArgs(dim=width, n_layers=depth, n_heads=HEADS, n_kv_heads=HEADS, vocab_size=VOCAB, ffn_dim=4 * width,
                     max_seq_len=SEQ, parametrization=parametrization,
                     base_dim=base_dim if parametrization != "sp" else 0,
                     base_n_layers=base_n_layers if parametrization == "completep" else 0)


def _kind(name: str) -> str | None:
    if name == "tok_embeddings":
        return "embedding"
    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "layers":
        return "block"
    if len(parts) == 3 and parts[2] in ("attention", "feed_forward"):
        return parts[2]
    return None


def _update_kind(name: str) -> str | None:
    return {"tok_embeddings.weight": "embedding", "output.weight": "output"}.get(
        name, "hidden" if name.startswith("layers.") and not name.endswith("norm.weight") else None)


def rms(t: torch.Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


def record(args: ModelArgs, steps: int, lr: float, optim: str = "adamw", seed: int = 0) -> list[dict[str, float]]:
    """[{kind: RMS}] for steps 1..steps: activations in the forward of step t, updates of step t ('update:KIND').

    Branch outputs include completep's residual multiplier (what the residual stream adds);
    logits include mup's 1/m_N. Shapes (batch BATCH, seq SEQ) of tokens drawn from seed.
    """
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights(seed)
    opt, sched = build_optimizer(model, OptimConfig(name=optim, lr=lr, warmup_steps=0, schedule="wsd",
                                                    decay_fraction=1e-6, weight_decay=0.0), 10**6, fused=False)
    gen = torch.Generator().manual_seed(seed)
    # Zipf-distributed tokens (p(k) ~ 1/(k+1), as words in text): a frequent token recurs in every batch, so
    # successive gradients share directions as on real data; uniform tokens would make every update noise.
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    batches = torch.multinomial(zipf / zipf.sum(), steps * BATCH * (SEQ + 1), replacement=True,
                                generator=gen).view(steps, BATCH, SEQ + 1)
    seen: dict[str, list[float]] = {}

    def hook(name):
        kind = _kind(name)
        scale = model.layers[0].residual_scale if kind in ("attention", "feed_forward") else 1.0

        def fn(_module, _inputs, out):
            seen.setdefault(kind, []).append(rms(out) * scale)
        return fn

    for name, module in model.named_modules():
        if _kind(name):
            module.register_forward_hook(hook(name))
    out = []
    for t in range(steps):
        seen.clear()
        before = {n: p.detach().clone() for n, p in model.named_parameters() if _update_kind(n)}
        logits = model(batches[t, :, :-1])
        row = {k: sum(v) / len(v) for k, v in seen.items()}
        row["logits"] = rms(logits)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batches[t, :, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        ups: dict[str, list[float]] = {}
        for n, p in model.named_parameters():
            if n in before:
                ups.setdefault(_update_kind(n), []).append(rms(p.detach() - before[n]))
        row.update({f"update:{k}": sum(v) / len(v) for k, v in ups.items()})
        row["loss"] = loss.item()
        out.append(row)
    return out


def spread(rows_by_size: dict[int, list[dict]], key: str, step: int) -> float:
    """Largest over smallest value of key at step (1-based) across the sizes: 1.0 is perfectly flat."""
    values = [rows[step - 1][key] for rows in rows_by_size.values()]
    return max(values) / min(values)


def growth(rows_by_size: dict[int, list[dict]], key: str, step: int) -> float:
    """Value of key at step at the largest size over that at the smallest."""
    sizes = sorted(rows_by_size)
    return rows_by_size[sizes[-1]][step - 1][key] / rows_by_size[sizes[0]][step - 1][key]


def sweep(parametrization: str, widths: list[int], depths: list[int], steps: int, lr: float, optim: str
          ) -> dict[int, list[dict]]:
    """{size: record(...)} over widths (depth depths[0]) or, with several depths, over depths (width widths[0])."""
    if len(depths) > 1:
        return {d: record(shape(widths[0], d, parametrization, widths[0], depths[0]), steps, lr, optim)
                for d in depths}
    return {w: record(shape(w, depths[0], parametrization, widths[0], depths[0]), steps, lr, optim) for w in widths}


def draw(panels: list[tuple[str, dict[int, list[dict]], tuple[str, ...], str]], steps: int, path: str) -> None:
    """One row per (title, sweep, keys, x label), one column per step: RMS against size, log-log."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), steps, figsize=(3.2 * steps, 2.6 * len(panels)), squeeze=False)
    for r, (title, rows_by_size, keys, xlabel) in enumerate(panels):
        sizes = sorted(rows_by_size)
        for t in range(steps):
            ax = axes[r][t]
            for key in keys:
                ax.plot(sizes, [rows_by_size[s][t].get(key, math.nan) for s in sizes], marker="o", label=key)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{title}, step {t + 1}", fontsize=8)
            ax.set_xlabel(xlabel, fontsize=8)
            if t == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--optim", default="adamw", choices=["adamw", "muon"])
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--widths", default="64,128,256,512,1024")
    parser.add_argument("--depths", default="2,4,8,16,32")
    a = parser.parse_args()
    widths, depths = [int(x) for x in a.widths.split(",")], [int(x) for x in a.depths.split(",")]
    acts, ups = KINDS, tuple(f"update:{k}" for k in UPDATES)
    panels = []
    for p in ("sp", "mup"):
        s = sweep(p, widths, [2], a.steps, a.lr, a.optim)
        panels += [(f"{p} activations", s, acts, "width"), (f"{p} updates", s, ups, "width")]
        print(f"{p}: largest / smallest width at step {a.steps}: " +
              ", ".join(f"{k} {growth(s, k, a.steps):.2f}x" for k in acts + ups), flush=True)
    for p in ("sp", "completep"):
        s = sweep(p, [widths[0]], depths, a.steps, a.lr, a.optim)
        panels += [(f"{p} over depth", s, acts + ups, "n_layers")]
        print(f"{p} over depth: largest/smallest at step {a.steps}: " +
              ", ".join(f"{k} {growth(s, k, a.steps):.2f}x" for k in acts + ups), flush=True)
    draw(panels, a.steps, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
