"""Does mup keep its promise at one seed? The width-transfer protocol of issue 55, on any corpus.

    python benchmarks/mup_protocol.py --dataset GLOB --workdir DIR [--out FILE.md] [--seeds 0,1,2]
        [--widths 64,256] [--variant after|before|...] [--workers 2] [--max_documents N]

The protocol (issue 55, item 1): 4 layers, n_heads fixed at 4 (head_dim grows with the width), GQA with 2 KV
heads, a 4,096-token tokenizer (configs/debug.toml's data), seq 128, batch 16, AdamW, WSD with 15 warmup steps and
the last 20% decaying to 0, weight decay 0.1, clipping at 1, 150 steps, one process on one thread, the base
multipliers at their defaults. The proxy (width 64, base_dim 64) picks its LR from PROXY_LRS (2e-3, 4e-3, 8e-3);
mup trains every wider width at that LR, and sp trains each width on its own x2 grid (SP_LRS: at 256, 5e-4, 1e-3,
2e-3). The goal: at 4x (and 8x, when given) the proxy's width, mup at the proxy's LR is no worse than sp at its
best LR of the grid, at every seed (not only the median). The score is the final validation loss on 64 held-out
windows (benchmarks/lr_transfer.py's train: the same data order and init per seed for every point).

--variant picks what mup trains as (VARIANTS): "after" is the code as it is (the readout's init 0.02 m_N,
nn/parametrization.py); "before" restores the readout's init of before the fix (0.02: the effective readout
a_out W / m_N shrinks as 1/m_N); the others are the ablations of the suspects on top of "before" (the attention
scale 1/head_dim, the embedding's, output's and norms' LR falling as 1/m_N, the proxy's LR halved, the readout's
init keeping the proxy's logits). Every point is cached in DIR/points.json (a rerun trains only what is missing;
runs that share DIR merge their points); --dataset "" is the stdlib corpus, --max_documents 0 reads every document.
--only proxy|mup|sp trains that part. About 15 minutes per corpus and seed on 2 idle cores (a width-256 run takes
1.5 .. 4 minutes on one thread).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEQ, BATCH, VOCAB, STEPS, WARMUP = 128, 16, 4096, 150, 15
N_LAYERS, N_HEADS, N_KV_HEADS, PROXY = 4, 4, 2, 64
PROXY_LRS = [2e-3, 4e-3, 8e-3]
SP_LRS = {64: [2e-3, 4e-3, 8e-3], 128: [1e-3, 2e-3, 4e-3], 256: [5e-4, 1e-3, 2e-3], 512: [2.5e-4, 5e-4, 1e-3]}
VARIANTS = {
    # name: (ModelArgs overrides and ablations (patch) for mup, how the proxy's LR is chosen). "_init:output": -1
    # restores the readout's init before the fix (0.02, not 0.02 m_N: nn/parametrization.py).
    "after": ({}, "best"),
    "before": ({"_init:output": -1}, "best"),
    "base_head_dim": ({"_init:output": -1, "base_head_dim": "proxy"}, "best"),  # scores q.k sqrt(d_0) / head_dim
    "lr/2": ({"_init:output": -1}, "half"),
    "vec_lr/m": ({"_init:output": -1, "_lr:tok_embeddings": -1}, "best"),  # the role group: the output's LR too
    "emb_lr/m": ({"_init:output": -1, "_lrp:tok_embeddings": -1}, "best"),
    "norm_lr/m": ({"_init:output": -1, "_lr:norm.weight": -1}, "best"),
    "output_init_proxy_logits": ({"_init:output": -0.5}, "best"),  # the proxy's logits at init, at every width
    "after, base_head_dim": ({"base_head_dim": "proxy"}, "best"),  # the fix with the scores q.k sqrt(d_0) / head_dim
}
AT_PROXY_NOOP = ("base_head_dim", "_lr:tok_embeddings", "_lrp:tok_embeddings", "_lrp:output", "_lr:norm.weight",
                 "_init:hidden", "_init:output")
"""Overrides that leave the proxy (base_dim = dim) as it is: its cached points serve every variant."""
TARGETS = {"tok_embeddings": "EMBEDDING", "norm.weight": "NORM", "output": "READOUT"}
"""The names the ablations give ("_lr:tok_embeddings") and the role (nn/roles.Role) of the parameters they named."""


def corpus(workdir: str, dataset: str, max_documents: int | None):
    """The corpus tokenized once into workdir/data (a 4,096-token tokenizer, windows of SEQ), as a PackedCorpus."""
    from config import parse_config
    from data import PackedCorpus

    args = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--run_dir", workdir,
            "--model.vocab_size", str(VOCAB), "--data.tokenizer_vocab_size", str(VOCAB), "--data.seq_len", str(SEQ)]
    if dataset:
        args += ["--data.dataset", dataset]
    if max_documents is not None:
        args += ["--data.max_documents", str(max_documents)]
    cfg = parse_config(args)
    folder = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(folder, "meta.json")):
        import prepare

        prepare.prepare(cfg.data, folder)
    return PackedCorpus(folder, cfg.data)


def model_args(parametrization: str, width: int, overrides: dict):
    from model import ModelArgs

    kw = dict(dim=width, n_layers=N_LAYERS, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, vocab_size=VOCAB,
              ffn_dim=3 * width, max_seq_len=SEQ, parametrization=parametrization)
    if parametrization != "sp":
        kw["base_dim"] = PROXY
        for k, v in overrides.items():
            kw[k] = PROXY // N_HEADS if v == "proxy" else v
    return ModelArgs(**kw)


def point(job: tuple) -> tuple:
    """(job, final val loss) of (parametrization, width, lr, seed, overrides as a sorted tuple, workdir, dataset,
    max_documents)."""
    import lr_transfer

    parametrization, width, lr, seed, overrides, workdir, dataset, max_documents = job
    lr_transfer.SEQ, lr_transfer.BATCH, lr_transfer.VOCAB = SEQ, BATCH, VOCAB
    lr_transfer.corpus = lambda w, d="": corpus(w, d, max_documents)  # noqa: E731
    overrides = dict(overrides)
    patches = {k: overrides.pop(k) for k in list(overrides) if k.startswith("_")}
    if patches:
        patch(patches)
    args = model_args(parametrization, width, overrides)
    return job, lr_transfer.train(args, "adamw", lr, STEPS, workdir, dataset, seed)  # warmup STEPS // 10 = WARMUP


def split_groups(build):
    """build_optimizer, with one AdamW group per parameter (its settings from optimizer_settings): the patches
    then reach the embedding and the output apart (build_optimizer groups them by role, the first one's LR)."""
    import torch

    from nn import parametrization
    from nn.roles import roles

    def wrapped(model, cfg, total_steps, **kw):
        opt, sched = build(model, cfg, total_steps, **kw)
        groups, role = [], roles(model)
        for name, p in model.named_parameters():
            st = parametrization.optimizer_settings(model.args, role[name], False,
                                                    cfg.weight_decay if p.ndim >= 2 else 0.0, cfg.eps)
            groups.append({"params": [p], "lr": cfg.lr * st["lr_mult"], "weight_decay": st["weight_decay"],
                           "eps": st["eps"]})
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, sched.lr_lambdas[0])

    return wrapped


def patch(patches: dict) -> None:
    """Ablations that are not model fields, in this worker: "_lr:NAME": e multiplies the AdamW LR of every
    parameter whose name starts or ends with NAME by m_N ** e (e.g. -1: the LR falls as 1/width), as
    build_optimizer groups them (by role: the first parameter of a group sets its LR, so the embedding's is the
    output's too); "_lrp:NAME" the same with one group per parameter; "_init:NAME" (or "_init:hidden": the hidden
    matrices) multiplies the init std by m_N ** e. NAME is read as the role of the parameters it named (TARGETS)."""
    from nn import parametrization
    from nn.roles import Role

    plain = parametrization.optimizer_settings

    def hit(role, t):
        return role is not None and (role.hidden if t == "hidden" else role is Role[TARGETS[t]])

    def settings(args, role, muon, weight_decay, eps):
        out = dict(plain(args, role, muon, weight_decay, eps))
        if args is not None and args.parametrization != "sp":
            m = parametrization.multipliers(args).width
            for k, e in patches.items():
                if k.startswith(("_lr:", "_lrp:")) and hit(role, k.split(":", 1)[1]):
                    out["lr_mult"] *= m ** e
        return out

    parametrization.optimizer_settings = settings
    import model as model_module

    plain_init = model_module.init_std

    def init(args, role):
        std = plain_init(args, role)
        if std is not None and args.parametrization != "sp":
            m = parametrization.multipliers(args).width
            for k, e in patches.items():
                if k.startswith("_init:") and hit(role, k.split(":", 1)[1]):
                    std *= m ** e
        return std

    model_module.init_std = init
    if any(k.startswith("_lrp:") for k in patches):  # one group per parameter
        import optimization.optimizers as o

        o.build_optimizer = split_groups(o.build_optimizer)


def key(p: str, w: int, lr: float, seed: int, overrides: dict) -> str:
    return json.dumps([p, w, lr, seed, sorted(overrides.items())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="")
    parser.add_argument("--max_documents", type=int, default=None, help="data.max_documents (default: debug.toml's)")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--variant", default="before", choices=list(VARIANTS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default="", help="'proxy', 'mup' or 'sp': train that part only")
    a = parser.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    widths = [int(w) for w in a.widths.split(",")]
    overrides, pick = VARIANTS[a.variant]
    os.makedirs(a.workdir, exist_ok=True)
    corpus(a.workdir, a.dataset, a.max_documents)
    cache_path = os.path.join(a.workdir, "points.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    t = time.perf_counter()

    def run(jobs):
        jobs = [j for j in dict.fromkeys(jobs) if key(j[0], j[1], j[2], j[3], dict(j[4])) not in cache]
        jobs.sort(key=lambda j: -j[1])
        if not jobs:
            return
        with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
            for job, score in pool.imap_unordered(point, jobs):
                cache[key(job[0], job[1], job[2], job[3], dict(job[4]))] = score
                if os.path.exists(cache_path):  # another run may share the cache: merge, then replace
                    cache.update({k: v for k, v in json.load(open(cache_path)).items() if k not in cache})
                with open(cache_path + ".tmp", "w") as f:
                    json.dump(cache, f, indent=0)
                os.replace(cache_path + ".tmp", cache_path)
                print(f"[{time.perf_counter() - t:.0f} s] {job[0]} {job[1]} lr {job[2]:g} seed {job[3]} "
                      f"{dict(job[4])}: {score:.4f}", flush=True)

    ov = tuple(sorted(overrides.items()))
    job = lambda p, w, lr, s, o=(): (p, w, lr, s, o, a.workdir, a.dataset, a.max_documents)  # noqa: E731
    get = lambda p, w, lr, s, o=(): cache[key(p, w, lr, s, dict(o))]  # noqa: E731
    # the proxy: mup at base_dim = dim is sp bit for bit (the overrides resolve to the proxy's own head_dim)
    pov = tuple((k, v) for k, v in ov if k not in AT_PROXY_NOOP)  # the same proxy for every variant that is
    run([job("mup", PROXY, lr, s, pov) for lr in PROXY_LRS for s in seeds])
    if a.only == "proxy":
        return
    proxy_lr = {}
    for s in seeds:
        scores = {lr: get("mup", PROXY, lr, s, pov) for lr in PROXY_LRS}
        best = min(scores, key=scores.get)
        proxy_lr[s] = best if pick == "best" else best / 2
    if a.only != "sp":
        run([job("mup", w, proxy_lr[s], s, ov) for w in widths[1:] for s in seeds])
    if a.only != "mup":
        run([job("sp", w, lr, s) for w in widths[1:] for lr in SP_LRS[w] for s in seeds])
    if a.only:
        return
    lines = [f"### {a.dataset or 'stdlib'}, variant {a.variant}: seeds {a.seeds}", "",
             "| seed | proxy LR (its losses at " + ", ".join(f"{lr:g}" for lr in PROXY_LRS) + ") | width | "
             "mup at the proxy's LR | sp best (LR) | mup - sp |", "|---|---|---|---|---|---|"]
    for s in seeds:
        pl = ", ".join(f"{get('mup', PROXY, lr, s, pov):.3f}" for lr in PROXY_LRS)
        for w in widths[1:]:
            m = get("mup", w, proxy_lr[s], s, ov)
            sps = {lr: get("sp", w, lr, s) for lr in SP_LRS[w]}
            b = min(sps, key=sps.get)
            lines.append(f"| {s} | {proxy_lr[s]:g} ({pl}) | {w} | {m:.3f} | {sps[b]:.3f} ({b:g}) | {m - sps[b]:+.3f} |")
    lines.append("")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
