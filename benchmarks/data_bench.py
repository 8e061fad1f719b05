"""Data preparation and mixing: tokens/s per rank with uint16 vs uint32 token files, their size
on disk, and the realised mixture of the first global batches against the weights.

    python benchmarks/data_bench.py --config configs/debug.toml [--data.field value ...] [--runs 3] [--batches 50]

One process (one rank): the tokenizer is trained once, outside the timed part, then the
config's sources are prepared `--runs` times with each token dtype into fresh directories;
tokens/s is all sources' tokens over the wall time of prepare(), so it counts reading,
tokenizing, packing and writing. The mixture table draws `--batches` global batches of
train.global_batch_size with the config's weights and stages and compares each source's
count with B * w / sum(w) (the largest deviation in any one batch, and the totals).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import prepare  # noqa: E402
from config import parse_config  # noqa: E402
from data import PackedCorpus  # noqa: E402
from data_pipeline import mixture  # noqa: E402
from data_pipeline.loader import GlobalBatchLoader  # noqa: E402


def time_prepare(cfg, dtype: str, runs: int, root: str) -> dict:
    """Median tokens/s of prepare() writing dtype token files, and the files' bytes."""
    rates, size = [], 0
    original = prepare.token_dtype
    prepare.token_dtype = lambda vocab: dtype  # the dtype of files written from now on
    try:
        for i in range(runs):
            out = os.path.join(root, f"{dtype}_{i}")
            t0 = time.perf_counter()
            meta = prepare.prepare(cfg, out)
            rates.append(meta["n_tokens"] / (time.perf_counter() - t0))
            size = sum(os.path.getsize(os.path.join(out, r["file"])) for r in meta["sources"].values())
            if i < runs - 1:
                shutil.rmtree(out)
    finally:
        prepare.token_dtype = original
    return {"tokens_per_s_median": statistics.median(rates), "tokens_per_s": rates, "bytes": size,
            "n_tokens": meta["n_tokens"], "dir": out}


def realised_mixture(cfg, data_dir: str, batches: int) -> dict:
    """Per-source counts of the first `batches` global batches against B * w / sum(w)."""
    corpus = PackedCorpus(data_dir, cfg.data)
    b = cfg.train.global_batch_size
    loader = GlobalBatchLoader(corpus, b, b, 0, 1, cfg.train.seed)
    totals, wanted, worst = [0] * len(corpus.names), [0.0] * len(corpus.names), 0.0
    for _ in range(batches):
        weights = mixture.stage_at(corpus.schedule, loader.state.steps)
        want = [b * w / sum(weights) for w in weights]
        got = [0] * len(corpus.names)
        for s, _ in loader.rank_indices():
            got[s] += 1
        worst = max(worst, *(abs(g - w) for g, w in zip(got, want)))
        totals = [t + g for t, g in zip(totals, got)]
        wanted = [t + w for t, w in zip(wanted, want)]
        loader.next_step()
    return {"batches": batches, "global_batch_size": b, "schedule": corpus.schedule,
            "realised": dict(zip(corpus.names, totals)), "weights_times_B": dict(zip(corpus.names, wanted)),
            "largest_deviation_in_a_batch": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batches", type=int, default=50)
    a, rest = p.parse_known_args()
    cfg = parse_config(rest, require_file=True)
    root = tempfile.mkdtemp(prefix="data_bench_")
    try:
        tok = os.path.join(root, "tokenizer.json")
        prepare._make_tokenizer(cfg.data).save(tok)
        cfg.data.tokenizer = tok
        result = {dtype: time_prepare(cfg.data, dtype, a.runs, root) for dtype in ("uint16", "uint32")}
        result["mixture"] = realised_mixture(cfg, result["uint16"]["dir"], a.batches)
        for dtype in ("uint16", "uint32"):
            del result[dtype]["dir"]
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
