"""Pre-tokenized data: read throughput per format on one core, and start-up time against the number of shards.

    python benchmarks/pretok_bench.py [--tokens 32000000] [--seq_len 2048] [--micro_batch 8] [--seconds 5]
                                      [--shards 10,1000,10000] [--s3_shards 1000] [--s3_batch 64] [--no_s3]
                                      [--json FILE]

Throughput: one synthetic corpus (documents of 1..1,000 ids below 32,000, each ended by the EOS
id 2) written as a prepared raw-text stream (what prepare.py writes), Megatron .bin/.idx, OLMo
numpy and datatrove .ds/.ds.index files, then read as the trainer reads it: data.PackedCorpus
over the run directory that prepare.prepare records, and the loader's global batches of
`--micro_batch` windows of seq_len + 1 tokens in the loader's shuffled order, for `--seconds`
seconds in one process (one core; the files are in the page cache, as after the first epoch of
a local corpus). tokens/s counts the seq_len input tokens of each window.

Start-up: `--shards` counts of small shards (1,000 tokens each) of the Megatron and numpy formats;
the time of the checks every rank runs before any collective (config.check_pretokenized: indexes,
sizes, the id scan, the EOS sample), of preparation's record (prepare.prepare: the run's meta.json)
and of mapping the corpus (data.PackedCorpus); then the same on a resume (prepare.prepare again:
each shard's index checksum against the record). Prints one JSON object.

S3 (unless --no_s3): a real S3 server on 127.0.0.1 (moto_server, as the tests start it, tests/s3server.py)
holding the throughput corpus as Megatron shards of about 2 MB (moto reads a whole object for every ranged GET, S3
does not) and `--s3_shards` small Megatron shards. Throughput: the same
loader over the bucket's files (data_pipeline/ranged.py: each step's windows as one concurrent batch of ranged
reads) through a block cache of 1/16 of the corpus (random windows mostly miss it, as over a large corpus), with
steps of `--micro_batch` windows and of `--s3_batch` windows (a rank's share of a large global batch);
start-up: the same three phases over the bucket's shards, first start and resume.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import prepare  # noqa: E402
from config import check_pretokenized  # noqa: E402
from data import DataConfig, PackedCorpus  # noqa: E402
from data_pipeline import index_cache, ranged  # noqa: E402
from data_pipeline.loader import GlobalBatchLoader  # noqa: E402
from model import ModelArgs  # noqa: E402
from pretok_writers import write_datatrove, write_megatron, write_numpy  # noqa: E402
from s3server import start_server  # noqa: E402

EOS, VOCAB = 2, 32_000


def corpus(n_tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Documents of 1..1,000 ids in [3, VOCAB) ending with EOS, about n_tokens in all (uint16)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 1000, n_tokens // 500 + 1)
    flat = rng.integers(3, VOCAB, int(lengths.sum())).astype(np.uint16)
    ends = np.cumsum(lengths)
    flat[ends - 1] = EOS
    return np.split(flat, ends[:-1])


def tokenizer(root: str) -> str:
    """A tokenizer.json of VOCAB ids with [EOT] = 2 (a word-level one: the ids are read, never encoded)."""
    from tokenizers import Tokenizer, models
    path = os.path.join(root, "tokenizer.json")
    vocab = {"[PAD]": 0, "[BOT]": 1, "[EOT]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")).save(path)
    return path


def read_rate(cfg: DataConfig, data_dir: str, micro: int, seconds: float, batch: int = 0) -> dict:
    """Windows read through the loader for `seconds` (steps of `batch` windows, default micro): tokens/s of inputs on
    this one process."""
    corpus = PackedCorpus(data_dir, cfg, VOCAB)
    loader = GlobalBatchLoader(corpus, batch or micro, micro, 0, 1, 0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for inputs, _ in loader.next_step():
            n += inputs.numel()
    return {"tokens_per_s": n / (time.perf_counter() - t0), "windows": n // cfg.seq_len}


def throughput(root: str, tok: str, n_tokens: int, seq_len: int, micro: int, seconds: float) -> dict:
    docs = corpus(n_tokens)
    files = os.path.join(root, "files")
    os.makedirs(files)
    write_megatron(os.path.join(files, "corpus_text_document"), docs)
    write_numpy(os.path.join(files, "part-0-00000.npy"), docs)
    write_datatrove(os.path.join(files, "00000.ds"), docs)
    out = {}
    for fmt, spec in (("numpy", "part-0-00000.npy"), ("megatron", "corpus_text_document"), ("datatrove", "00000.ds")):
        cfg = DataConfig(dataset=os.path.join(files, spec), format=fmt, tokenizer=tok, seq_len=seq_len,
                         val_fraction=0.0, token_dtype="uint16" if fmt == "numpy" else "")
        data_dir = os.path.join(root, f"run_{fmt}", "data")
        prepare.prepare(cfg, data_dir)
        out[fmt] = read_rate(cfg, data_dir, micro, seconds)
    # The prepared raw-text stream is one flat file in the run directory: the numpy reader's path, with the
    # file inside RUN_DIR/data (prepare.py's record), timed the same way.
    raw_dir = os.path.join(root, "run_text", "data")
    shutil.copytree(os.path.join(root, "run_numpy", "data"), raw_dir)
    with open(os.path.join(raw_dir, "meta.json")) as f:
        meta = json.load(f)
    os.makedirs(os.path.join(raw_dir, "sources"))
    shutil.copyfile(os.path.join(files, "part-0-00000.npy"), os.path.join(raw_dir, "sources", "default-x.bin"))
    rec = meta["sources"]["default"]
    meta["sources"]["default"] = {"file": "sources/default-x.bin", "dtype": "uint16", "n_tokens": rec["n_tokens"],
                                  "n_documents": len(docs), "config": DataConfig(dataset="stdlib").source_list()[0].reading()}
    with open(os.path.join(raw_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    out["text (prepared)"] = read_rate(DataConfig(dataset="stdlib", seq_len=seq_len, val_fraction=0.0), raw_dir,
                                       micro, seconds)
    return {"n_tokens": int(sum(len(d) for d in docs)), "seq_len": seq_len, "micro_batch": micro, **out}


def write_shards(root: str, n: int, numpy_too: bool = True) -> str:
    """n small shards (about 1,000 tokens each) as Megatron pairs (and numpy files) in root/shards_n; the folder."""
    docs = corpus(1000 * n, seed=n)
    per = max(1, len(docs) // n)
    folder = os.path.join(root, f"shards_{n}")
    os.makedirs(folder)
    for i in range(n):
        part = docs[i * per:(i + 1) * per] or docs[:1]
        write_megatron(os.path.join(folder, f"s{i:05d}_text_document"), part)
        if numpy_too:
            write_numpy(os.path.join(folder, f"s{i:05d}.npy"), part)
    return folder


def time_start(cfg: DataConfig, data_dir: str) -> dict:
    """Seconds of a first start's checks, record and mapping, and of a resume's three together; each as a new process
    starts it (index_cache's memo and the block cache emptied, so only RUN_DIR/data/index_cache.npz carries over), with
    the number of indexes parsed from their files."""
    model = ModelArgs(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, n_kv_heads=2)
    index_cache.clear()
    ranged.CACHE.clear()
    t0 = time.perf_counter()
    check_pretokenized(cfg, model, os.path.dirname(data_dir))
    t1 = time.perf_counter()
    prepare.prepare(cfg, data_dir)
    t2 = time.perf_counter()
    PackedCorpus(data_dir, cfg, VOCAB)
    t3 = time.perf_counter()
    first_reads = index_cache.stats["read"]
    index_cache.clear()
    ranged.CACHE.clear()
    tr = time.perf_counter()
    check_pretokenized(cfg, model, os.path.dirname(data_dir))
    prepare.prepare(cfg, data_dir)
    PackedCorpus(data_dir, cfg, VOCAB)
    t4 = time.perf_counter()
    return {"checks_s": t1 - t0, "record_s": t2 - t1, "map_s": t3 - t2, "start_s": t3 - t0,
            "resume_start_s": t4 - tr, "indexes_read": first_reads, "resume_indexes_read": index_cache.stats["read"]}


def startup(root: str, tok: str, counts: list[int]) -> dict:
    out = {}
    for n in counts:
        folder = write_shards(root, n)
        for fmt, spec in (("megatron", folder), ("numpy", os.path.join(folder, "*.npy"))):
            cfg = DataConfig(dataset=spec, format=fmt, tokenizer=tok, seq_len=64, val_fraction=0.0,
                             token_dtype="uint16" if fmt == "numpy" else "")
            out[f"{fmt} {n}"] = time_start(cfg, os.path.join(root, f"run_{fmt}_{n}", "data"))
    return out


def s3_rows(root: str, tok: str, a) -> dict:
    """Throughput and start-up of Megatron files in a bucket of a moto_server on 127.0.0.1 (module docstring)."""
    import s3fs  # the s3 extra's

    proc, env = start_server("bench")
    os.environ.update(env)
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        # moto reads a whole object for each ranged GET (15 GETs/s from a 64 MB object, 200/s from 2 MB ones, here),
        # which S3 does not: the corpus goes up as shards of about 2 MB, the size at which moto's own request rate
        # is what bounds the reads
        docs, parts = corpus(a.tokens), os.path.join(root, "s3_parts")
        os.makedirs(parts)
        n_parts = max(1, a.tokens // (1 << 20))
        for i in range(n_parts):
            write_megatron(os.path.join(parts, f"part{i:04d}_text_document"), docs[i::n_parts])
        t0 = time.perf_counter()
        fs.put(parts + "/", "bench/corpus", recursive=True)
        out = {"upload_s": time.perf_counter() - t0, "shards": n_parts}
        cfg = DataConfig(dataset="s3://bench/corpus", format="megatron", tokenizer=tok, seq_len=a.seq_len,
                         val_fraction=0.0)
        data_dir = os.path.join(root, "run_s3", "data")
        prepare.prepare(cfg, data_dir)
        # a cache of 1/16 of the corpus: windows are random, so most reads miss, as over a corpus of TBs
        ranged.CACHE = ranged.BlockCache(max_bytes=2 * a.tokens // 16)
        for batch in (a.micro_batch, a.s3_batch):
            ranged.CACHE.clear()
            ranged.CACHE.fetched = 0
            rate = read_rate(cfg, data_dir, a.micro_batch, a.seconds, batch)
            rate["fetched_bytes_per_token"] = ranged.CACHE.fetched / (rate["windows"] * a.seq_len)
            out[f"megatron s3, steps of {batch} windows"] = rate
        if a.s3_shards:
            folder = write_shards(os.path.join(root, "s3_src"), a.s3_shards, numpy_too=False)  # beside --shards'
            fs.put(folder + "/", f"bench/shards_{a.s3_shards}", recursive=True)
            cfg = DataConfig(dataset=f"s3://bench/shards_{a.s3_shards}", format="megatron", tokenizer=tok, seq_len=64,
                             val_fraction=0.0)
            out[f"startup megatron s3 {a.s3_shards}"] = time_start(cfg, os.path.join(root, "run_s3_shards", "data"))
        return out
    finally:
        proc.kill()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32_000_000)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--shards", default="10,1000,10000")
    p.add_argument("--s3_shards", type=int, default=1000)
    p.add_argument("--s3_batch", type=int, default=64)
    p.add_argument("--no_s3", action="store_true")
    p.add_argument("--json", default="")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="pretok_bench_")
    try:
        tok = tokenizer(root)
        result = {"throughput": throughput(root, tok, a.tokens, a.seq_len, a.micro_batch, a.seconds),
                  "startup": startup(root, tok, [int(x) for x in a.shards.split(",") if x])}
        if not a.no_s3:
            result["s3"] = s3_rows(root, tok, a)
        print(json.dumps(result))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
