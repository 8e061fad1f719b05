"""Does the best learning rate stay put as the model grows? sp against mup across width, sp against completep across depth.

    python benchmarks/lr_transfer.py --out benchmarks/results/FILE.md [--steps 200] [--workers 2]
        [--optimizers adamw,muon] [--sweeps 'sp depth,completep depth'] [--dataset GLOB]

About an hour on 2 cores with the defaults (55 minutes measured). Every point trains the trainer's model and
optimizer (model.py, optimization/) in one process on one thread, on the offline stdlib corpus
(configs/debug.toml's data with a 1024-token tokenizer, windows of SEQ tokens), the same
batches in the same order for every point, a fixed budget (steps x BATCH x SEQ tokens), WSD
(warmup steps/10, decay over the last 20%, to 0), weight decay 0.1, gradient clipping at 1.
The score is the final validation loss on VAL_WINDOWS held-out windows (a diverged run scores
inf). LRs: a x2 grid, LRS. Sweeps, for AdamW and for Muon:
- width: dim 32, 64, 128, 256 (8x) at 2 layers, head_dim 32, ffn 8/3 dim; sp and mup (base_dim 32);
- depth: 2, 4, 8, 16 layers (8x) at dim 64; sp (no depth rule) and completep (base_dim 64, base_n_layers 2).
Reported: the best LR of every size, how many grid steps it moves across the sizes, the loss
table, and a PNG of loss against LR, one curve per size (the mup paper's figure 1). With both depth
sweeps: completep at its 2-layer proxy's best LR against sp at its best LR per depth (the transfer goal).
--optimizers, --sweeps and --dataset (data.dataset; default the stdlib corpus) select a part.

    python benchmarks/lr_transfer.py --tune --steps 150 --out FILE.md [--dataset GLOB] [--widths 32,64,128,256] [--seeds 3]

--tune (AdamW; 12 minutes on 2 cores for the stdlib with --seeds 3): tunes optim.lr and the base multipliers
model.mup_output_mult (OUTPUT_MULTS) and model.mup_input_mult (INPUT_MULTS) on the width-32 proxy (one head
of 32), then trains every wider width at the proxy's settings, tuned and LR only, against sp at its best
LR of a x2 grid per width (extended until the best is inside it), with head_dim fixed and with n_heads
fixed (HEADS); it prints the tuned settings as the flags to train with. --seeds K scores every point by
the median of K seeds (init and data order), so that one seed's spike near the largest stable LR does not
decide the tuning or the verdict.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import re
import statistics
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
    "sp depth": ("sp", DEPTHS, "n_layers"),
    "completep depth": ("completep", DEPTHS, "n_layers"),
}


def corpus(workdir: str, dataset: str = ""):
    """The corpus (the stdlib, or data.dataset) tokenized once into workdir/data (prepare.prepare), as a
    PackedCorpus of SEQ windows."""
    from config import parse_config
    from data import PackedCorpus

    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "debug.toml"), "--run_dir", workdir,
                        "--model.vocab_size", str(VOCAB), "--data.tokenizer_vocab_size", str(VOCAB),
                        "--data.seq_len", str(SEQ), *(["--data.dataset", dataset] if dataset else [])])
    folder = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(folder, "meta.json")):
        import prepare  # the tokenizer's libraries: only to prepare

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
    """(job, final val loss) of one (optimizer, sweep, size, lr, steps, workdir, dataset) point."""
    optim, sweep, size, lr, steps, workdir, dataset = job
    parametrization, _, axis = SWEEPS[sweep]
    return job, train(model_args(parametrization, axis, size), optim, lr, steps, workdir, dataset)


def train(args, optim: str, lr: float, steps: int, workdir: str, dataset: str = "", seed: int = 0) -> float:
    """Final validation loss of model.ModelArgs args trained steps steps at lr (inf: diverged); seed draws the
    initial weights and the order of the training windows (the validation windows are always the same)."""
    import torch
    import torch.nn.functional as F

    from model import Transformer
    from optimization.optimizers import OptimConfig, build_optimizer

    torch.set_num_threads(1)
    data = corpus(workdir, dataset)
    src = data.sources[0]
    model = Transformer(args)
    model.init_weights(seed)
    cfg = OptimConfig(name=optim, lr=lr, schedule="wsd", warmup_steps=max(1, steps // 10), decay_fraction=0.2,
                      weight_decay=0.1, grad_clip=1.0)
    opt, sched = build_optimizer(model, cfg, steps, fused=False)
    order = torch.randperm(src.n_train, generator=torch.Generator().manual_seed(seed)).tolist()
    for step in range(steps):
        idx = [order[(step * BATCH + i) % len(order)] for i in range(BATCH)]
        x, y = data.batches([(0, i) for i in idx], BATCH)[0]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            return math.inf
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
    return score if math.isfinite(score) else math.inf


def best_lr(scores: dict[float, float]) -> float | None:
    finite = {lr: s for lr, s in scores.items() if math.isfinite(s)}
    return min(finite, key=finite.get) if finite else None


def report(results: dict, steps: int) -> list[str]:
    """Markdown: per optimizer and sweep, the best LR per size and its move in grid steps, then the loss table."""
    lines = [f"Budget: {steps} steps x {BATCH} x {SEQ} = {steps * BATCH * SEQ:,} tokens per point; LR grid "
             + ", ".join(f"{lr:.2g}" for lr in LRS) + ".", "",
             "| optimizer | sweep | best LR per size | moves (grid steps of 2x) |", "|---|---|---|---|"]
    optims, sweeps = _present(results)
    for optim in optims:
        for sweep in sweeps:
            _, sizes, axis = SWEEPS[sweep]
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
    if {"sp depth", "completep depth"} <= set(sweeps):
        lines += ["", *depth_transfer(results, optims)]
    return lines


def _present(results: dict) -> tuple[list[str], list[str]]:
    """The optimizers and sweeps that results holds, in the order of ("adamw", "muon") and SWEEPS."""
    return ([o for o in ("adamw", "muon") if any(k[0] == o for k in results)],
            [s for s in SWEEPS if any(k[1] == s for k in results)])


def depth_transfer(results: dict, optims: list[str]) -> list[str]:
    """Markdown: per optimizer, completep at its proxy's (DEPTHS[0] layers) best LR against sp at its best LR of the
    grid per depth, and the goal's verdicts (no worse than sp at 4x and 8x the proxy's depth; falls with depth)."""
    lines = ["completep at the proxy's best LR (tuned at 2 layers, never at the depth) against sp at its best LR of "
             "the grid at each depth:", "",
             "| optimizer | n_layers | sp best LR | sp | completep at the proxy's LR | completep - sp |",
             "|---|---|---|---|---|---|"]
    verdicts = []
    for optim in optims:
        lr0 = best_lr(results[optim, "completep depth", DEPTHS[0]])
        if lr0 is None:
            verdicts.append(f"- {optim}: the completep proxy diverged at every LR of the grid")
            continue
        cp = [results[optim, "completep depth", d][lr0] for d in DEPTHS]
        sp = []
        for d, c in zip(DEPTHS, cp):
            s_lr = best_lr(results[optim, "sp depth", d])
            sp.append(results[optim, "sp depth", d][s_lr] if s_lr else math.inf)
            shown = "diverged" if s_lr is None else f"{s_lr:.2g}" + (" (grid edge)" if s_lr in (LRS[0], LRS[-1]) else "")
            lines.append(f"| {optim} | {d} | {shown} | {sp[-1]:.4f} | {c:.4f} (lr {lr0:.2g}) | {c - sp[-1]:+.4f} |")
        ok = all(c <= s for c, s in zip(cp[2:], sp[2:]))
        mono = all(b < a for a, b in zip(cp, cp[1:]))
        verdicts.append(f"- {optim}: completep no worse than tuned sp at 4x and 8x the depth: {'yes' if ok else 'no'}; "
                        f"its loss falls monotonically with depth: {'yes' if mono else 'no'}")
    return lines + [""] + verdicts


def draw(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optims, sweeps = _present(results)
    fig, axes = plt.subplots(len(optims), len(sweeps), figsize=(4 * len(sweeps), 3.2 * len(optims)), squeeze=False)
    for r, optim in enumerate(optims):
        for c, sweep in enumerate(sweeps):
            _, sizes, axis = SWEEPS[sweep]
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


# ---------------------------------------------------------------- --tune: base multipliers on the proxy, then transfer

TUNE_WIDTHS = [32, 64, 128, 256]  # the proxy (base_dim 32) and 2x, 4x, 8x
OUTPUT_MULTS, INPUT_MULTS = [0.5, 1.0, 2.0], [1.0, 4.0, 16.0]
HEADS = ("head_dim fixed", "n_heads fixed")
"""head_dim fixed: head_dim 32, the heads grow with the width (1 at the proxy); n_heads fixed: one head, its head_dim
grows (base_head_dim 32). Both share the proxy: width 32, one head of 32."""


def tune_args(parametrization: str, dim: int, heads: str, input_mult: float = 1.0, output_mult: float = 1.0):
    """model.ModelArgs of a --tune point: 2 layers, ffn 8/3 dim; mup with base_dim 32 and the given base multipliers."""
    from model import ModelArgs

    n_heads = dim // 32 if heads == HEADS[0] else 1
    mup = parametrization == "mup"
    return ModelArgs(dim=dim, n_layers=2, n_heads=n_heads, n_kv_heads=n_heads, vocab_size=VOCAB,
                     ffn_dim=32 * math.ceil(8 * dim / 3 / 32), max_seq_len=SEQ, parametrization=parametrization,
                     base_dim=32 if mup else 0, base_head_dim=32 if mup and heads == HEADS[1] else 0,
                     mup_input_mult=input_mult if mup else 1.0, mup_output_mult=output_mult if mup else 1.0)


def tune_point(job: tuple) -> tuple:
    """(job, median final val loss, every seed's) of one (key, tune_args's arguments, lr, steps, workdir, dataset,
    seeds) point: seeds 0 .. seeds-1. The median, because at 150 steps near the largest stable LR one seed of three
    can spike by 0.3 .. 0.9 where the others do not (benchmarks/results/cpu-2core_2026-12-05_mup_seeds.md)."""
    key, targs, lr, steps, workdir, dataset, seeds = job
    scores = [train(tune_args(*targs), "adamw", lr, steps, workdir, dataset, seed) for seed in range(seeds)]
    return job, statistics.median(scores), scores


def run_round(pool, jobs: list, results: dict, t: float) -> None:
    """Train jobs (largest first) into results[key][lr], skipping points already there."""
    jobs = [j for j in dict.fromkeys(jobs) if j[2] not in results.get(j[0], {})]
    jobs.sort(key=lambda j: -j[1][1])
    for job, score, scores in pool.imap_unordered(tune_point, jobs):
        results.setdefault(job[0], {})[job[2]] = score
        each = f" (seeds: {', '.join(f'{s:.4f}' for s in scores)})" if len(scores) > 1 else ""
        print(f"[{time.perf_counter() - t:.0f} s] {job[0]} lr {job[2]:.2g}: {score:.4f}{each}", flush=True)


def interior(results: dict, keys: list) -> list:
    """For each key whose best LR lies on its grid's edge (or diverged everywhere), the next LR past that edge."""
    more = []
    for key in keys:
        scores = results[key]
        best, lrs = best_lr(scores), sorted(scores)
        if best is None or best == lrs[0]:
            more.append((key, lrs[0] / 2))
        elif best == lrs[-1] and best < 2 ** -3:
            more.append((key, best * 2))
    return more


def tune(pool, steps: int, workdir: str, dataset: str, t: float, seeds: int = 1) -> tuple[dict, dict]:
    """Tune (lr, output mult, input mult) on the proxy; train every width at the proxy's settings (tuned, and LR
    only) and sp on a x2 LR grid per width; every point's score is the median over seeds. Returns (results
    {key: {lr: loss}}, the tuned settings)."""
    res: dict = {}
    job = lambda key, targs, lr: (key, targs, lr, steps, workdir, dataset, seeds)  # noqa: E731
    proxy = ("proxy", 1.0, 1.0)
    sp = {(h, w): ("sp", h, w) for h in HEADS for w in TUNE_WIDTHS[1:]}
    # sp's best LR halves per doubling of the width (benchmarks/results/cpu-2core_2026-12-04_lr_transfer.md)
    first = [job(proxy, ("mup", 32, HEADS[0]), 2.0 ** -k) for k in range(5, 10)]
    first += [job(key, ("sp", w, h), 2.0 ** -(7 + math.log2(w / 32) + d)) for (h, w), key in sp.items()
              for d in (-1, 0, 1)]
    run_round(pool, first, res, t)
    for _ in range(2):
        more = interior(res, [proxy, *sp.values()])
        run_round(pool, [job(k, ("mup", 32, HEADS[0]) if k == proxy else ("sp", k[2], k[1]), lr) for k, lr in more],
                  res, t)
    lr0 = best_lr(res[proxy])
    grid = [(o, i) for o in OUTPUT_MULTS for i in INPUT_MULTS if (o, i) != (1.0, 1.0)]
    second = [job(("proxy", o, i), ("mup", 32, HEADS[0], i, o), lr0 * f) for o, i in grid for f in (0.5, 1, 2)]
    second += [job(("mup lr only", h, w), ("mup", w, h), lr0) for h in HEADS for w in TUNE_WIDTHS[1:]]
    run_round(pool, second, res, t)
    candidates = [(s, lr, o, i) for (name, o, i), scores in res.items() if name == "proxy"
                  for lr, s in scores.items()]
    _, lr1, out1, in1 = min(candidates)
    tuned = {"optim.lr": lr1, "model.mup_output_mult": out1, "model.mup_input_mult": in1, "lr only": lr0}
    run_round(pool, [job(("mup tuned", h, w), ("mup", w, h, in1, out1), lr1) for h in HEADS for w in TUNE_WIDTHS[1:]],
              res, t)
    return res, tuned


def tune_report(res: dict, tuned: dict, steps: int, corpus_name: str, seeds: int = 1) -> list[str]:
    """Markdown: the proxy's grid, then per head layout the loss per width of sp at its best LR and of mup at the
    proxy's settings (LR only, and tuned), with the goal's verdicts."""
    lr0, lr1, o1, i1 = tuned["lr only"], tuned["optim.lr"], tuned["model.mup_output_mult"], tuned["model.mup_input_mult"]
    each = f"; every loss is the median of {seeds} seeds (init and data order)" if seeds > 1 else ""
    lines = [f"### {corpus_name}: {steps} steps x {BATCH} x {SEQ} tokens, 2 layers, AdamW, base_dim 32{each}", "",
             "Proxy (width 32, one head of 32; sp and mup are the same model there), final val loss per LR and "
             "base multipliers (output, input):", "",
             "| output mult | input mult | " + " | ".join(f"lr {lr:.2g}" for lr in sorted({lr for k, v in res.items()
                                                                                         if k[0] == "proxy" for lr in v}))
             + " |"]
    lrs = sorted({lr for k, v in res.items() if k[0] == "proxy" for lr in v})
    lines.append("|---|---|" + "---|" * len(lrs))
    for key in sorted(k for k in res if k[0] == "proxy"):
        lines.append(f"| {key[1]:g} | {key[2]:g} | " + " | ".join(
            f"{res[key][lr]:.3f}" if lr in res[key] else "" for lr in lrs) + " |")
    lines += ["", f"LR only (multipliers 1): lr {lr0:.2g}, {res['proxy', 1.0, 1.0][lr0]:.4f}. Tuned: lr {lr1:.2g}, "
              f"output mult {o1:g}, input mult {i1:g}, {res['proxy', o1, i1][lr1]:.4f}; the flags: "
              f"`--model.parametrization mup --model.base_dim 32 --optim.lr {lr1:.6g} --model.mup_output_mult {o1:g} "
              f"--model.mup_input_mult {i1:g}`.", ""]
    for h in HEADS:
        lines += [f"{h}: final val loss per width (sp: at its best LR of the grid, which is given; mup: at the proxy's "
                  "settings, never tuned at the width)", "",
                  "| width | sp best LR | sp | mup, LR only | mup, tuned | tuned - sp |", "|---|---|---|---|---|---|"]
        only, tun = [], []
        for w in TUNE_WIDTHS:
            if w == 32:
                s_lr, s = lr0, res["proxy", 1.0, 1.0][lr0]
                a, b = s, res["proxy", o1, i1][lr1]
            else:
                s_lr = best_lr(res["sp", h, w])
                s = res["sp", h, w][s_lr] if s_lr else math.inf
                a, b = res["mup lr only", h, w][lr0], res["mup tuned", h, w][lr1]
            only.append(a)
            tun.append(b)
            grid = ", ".join(f"{lr:.2g}" for lr in sorted(res["sp", h, w])) if w != 32 else "proxy"
            lines.append(f"| {w} | {s_lr:.2g} (of {grid}) | {s:.4f} | {a:.4f} | {b:.4f} | {b - s:+.4f} |")
        for name, ys in (("LR only", only), ("tuned", tun)):
            sps = [res["sp", h, w][best_lr(res["sp", h, w])] for w in TUNE_WIDTHS[2:]]
            ok = all(y <= s for y, s in zip(ys[2:], sps))
            mono = all(b < a for a, b in zip(ys, ys[1:]))
            lines.append(f"- mup {name}: no worse than tuned sp at 4x and wider: {'yes' if ok else 'no'}; loss falls "
                         f"monotonically with width: {'yes' if mono else 'no'}")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="markdown to append to; the PNG is written beside it")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "lr_transfer"))
    parser.add_argument("--tune", action="store_true", help="tune lr and the base multipliers on the proxy, then "
                        "compare the transfer with sp tuned per width (AdamW; see tune)")
    parser.add_argument("--dataset", default="", help="data.dataset (default: the stdlib corpus)")
    parser.add_argument("--optimizers", default="adamw,muon", help="without --tune: the optimizers to sweep")
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help="without --tune: the sweeps, of " + ", ".join(SWEEPS))
    parser.add_argument("--seeds", type=int, default=1, help="--tune: score every point by the median of this many "
                        "seeds (3 rules out a single seed's spike)")
    parser.add_argument("--widths", default=",".join(map(str, TUNE_WIDTHS)), help="--tune: the proxy's width (32), "
                        "then the widths it transfers to")
    a = parser.parse_args()
    optims, sweeps = a.optimizers.split(","), a.sweeps.split(",")
    if not set(optims) <= {"adamw", "muon"} or not optims:
        parser.error(f"--optimizers: a comma list of adamw, muon; got {a.optimizers!r}")
    if not set(sweeps) <= set(SWEEPS) or not sweeps:
        parser.error(f"--sweeps: a comma list of {', '.join(SWEEPS)}; got {a.sweeps!r}")
    if a.seeds < 1 or (a.seeds > 1 and not a.tune):
        parser.error(f"--seeds: a count of at least 1, with --tune; got {a.seeds}" + ("" if a.tune else " without --tune"))
    os.makedirs(a.workdir, exist_ok=True)
    from core.errors import UserError

    try:
        corpus(a.workdir, a.dataset)  # tokenize once, before the workers
    except UserError as e:
        sys.exit(f"error: {e}")
    if a.tune:
        TUNE_WIDTHS[:] = [int(w) for w in a.widths.split(",")]
        if TUNE_WIDTHS[0] != 32 or len(TUNE_WIDTHS) < 3:
            parser.error("--widths: 32 (the proxy) first, then at least two wider")
        t = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
            res, tuned = tune(pool, a.steps, a.workdir, a.dataset, t, a.seeds)
        lines = tune_report(res, tuned, a.steps, a.dataset or "stdlib", a.seeds) + [f"{time.perf_counter() - t:.0f} s with "
                                                                          f"{a.workers} workers.", ""]
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    jobs = [(optim, sweep, s, lr, a.steps, a.workdir, a.dataset) for optim in optims
            for sweep in sweeps for s in SWEEPS[sweep][1] for lr in LRS]
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
    slug = re.sub(r"[^A-Za-z0-9]+", "_", a.dataset).strip("_")[-32:]
    png = os.path.splitext(a.out)[0] + (f"_{slug}" if slug else "") + ".png"
    draw(results, png)
    lines = [f"### {a.dataset or 'stdlib'}", ""] + report(results, a.steps) + ["", f"Figure: {os.path.relpath(png, ROOT)}; {time.perf_counter() - t:.0f} s "
                                            f"with {a.workers} workers."]
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
