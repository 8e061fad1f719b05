"""Pre-tokenized sources in a bucket (a real moto_server on 127.0.0.1, conftest.py's `s3` fixture), read in place
through fsspec: the tokens the writers were given, document by document, and the batches of the same files read
locally; ranged reads (a few windows fetch a few blocks, not the files); a glob or bucket that matches nothing is one
line naming the field."""
from __future__ import annotations

import os

import numpy as np
import pytest
import s3fs

import data
import prepare
from config import check_pretokenized
from core.errors import UserError
from data import DataConfig, PackedCorpus
from data_pipeline import index_cache, pretokenized, ranged
from data_pipeline.loader import GlobalBatchLoader
from data_pipeline.tokenizer import train_tokenizer
from model import ModelArgs
from pretok_writers import write_datatrove, write_megatron, write_numpy
from test_pretokenized import _docs, _src

URL = "s3://tests/pretok"
SPECS = {"megatron": ("meg", "meg/*_text_document", "meg/s1_text_document"),
         "numpy": ("np", "np/*.npy", "np/s0.npy"),
         "datatrove": ("dt", "dt/*.ds", "dt/s2.ds")}
"""Per format: a folder, a glob and one shard (a prefix for megatron), relative to the local root and to URL."""


@pytest.fixture(scope="module")
def shards(s3, tmp_path_factory):
    """(local root, documents of each of 3 shards), every format written by its writer and uploaded under URL."""
    root = tmp_path_factory.mktemp("pretok_s3")
    parts = [_docs(300, seed) for seed in range(3)]  # about 300 x 31 tokens a shard
    for sub in ("meg", "np", "dt"):
        (root / sub).mkdir()
    for i, docs in enumerate(parts):
        write_megatron(str(root / "meg" / f"s{i}_text_document"), docs)
        write_numpy(str(root / "np" / f"s{i}.npy"), docs)
        write_datatrove(str(root / "dt" / f"s{i}.ds"), docs)
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(root) + "/", URL.split("://")[1], recursive=True)
    return root, parts


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    """A tokenizer.json with [EOT] = 2, the fixture documents' EOS (their ids are read, never encoded)."""
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_tokenizer(["a b c"], 300, 10 ** 6).save(path)
    return path


def _cfg(fmt, dataset, tok, **kw):
    return DataConfig(dataset=str(dataset), format=fmt, tokenizer=tok, token_dtype="uint16" if fmt == "numpy" else "",
                      **kw)


@pytest.mark.parametrize("fmt", SPECS)
def test_a_source_in_a_bucket_reads_the_writers_documents_and_the_local_batches(shards, tok, tmp_path, fmt):
    """Reference: the documents given to the writer (folder, glob and one shard named on the bucket), then the
    loader's batches of the same files read locally, step by step."""
    root, parts = shards
    for k, spec in enumerate(SPECS[fmt]):
        got = pretokenized.open_shards(_src(fmt, f"{URL}/{spec}", token_dtype="uint16" if fmt == "numpy" else ""),
                                       300)
        want = parts if k < 2 else [parts[int(spec.split("/s")[1][0])]]
        assert [s.path for s in got] == [f"{URL}/{spec.split('/')[0]}/{os.path.basename(s.path)}" for s in got]
        stream = pretokenized.TokenStream([s.record() for s in got])
        assert stream[0:stream.size].tolist() == [t for docs in want for d in docs for t in d.tolist()], spec
        if fmt != "numpy":  # the index's document ends
            ends = np.concatenate([s.doc_ends + sum(x.n_tokens for x in got[:j]) for j, s in enumerate(got)])
            assert ends.tolist() == np.cumsum([len(d) for docs in want for d in docs]).tolist()
    model = ModelArgs(vocab_size=300, dim=16, n_layers=1, n_heads=2, n_kv_heads=2)
    batches = []
    for where in (f"{URL}/{SPECS[fmt][0]}", root / SPECS[fmt][0]):
        cfg = _cfg(fmt, where, tok, seq_len=16, val_fraction=0.05)
        run = tmp_path / ("s3" if str(where).startswith("s3") else "local")
        check_pretokenized(cfg, model, str(run))
        prepare.prepare(cfg, str(run / "data"))
        loader = GlobalBatchLoader(PackedCorpus(str(run / "data"), cfg, 300), 8, 8, 0, 1, 0)
        batches.append([[t.tolist() for pair in loader.next_step() for t in pair] for _ in range(6)])
    assert batches[0] == batches[1]


def test_a_resume_from_the_bucket_fetches_no_index_and_an_object_written_again_is_refused(shards, tok, tmp_path,
                                                                                           monkeypatch):
    """A first start fetches each index once (the checks; preparation's record takes them from the process), a
    resume none (RUN_DIR/data/index_cache.npz, by ETag), with the same batches; an index written again under its
    name (other documents, the same sizes) has another ETag, is fetched again and refused as a changed corpus."""
    root, parts = shards
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.put(str(root / "meg") + "/", "tests/resume/meg", recursive=True)
    cfg = _cfg("megatron", "s3://tests/resume/meg", tok, seq_len=16, val_fraction=0.05)
    model = ModelArgs(vocab_size=300, dim=16, n_layers=1, n_heads=2, n_kv_heads=2)
    fetched, fetch = [], ranged.fetch
    monkeypatch.setattr(ranged, "fetch", lambda urls: fetched.extend(urls) or fetch(urls))

    def start():
        check_pretokenized(cfg, model, str(tmp_path / "run"))
        prepare.prepare(cfg, str(tmp_path / "run" / "data"))
        loader = GlobalBatchLoader(PackedCorpus(str(tmp_path / "run" / "data"), cfg, 300), 8, 8, 0, 1, 0)
        return [[t.tolist() for pair in loader.next_step() for t in pair] for _ in range(3)]

    index_cache.clear()  # each start as a new process: only the cache file carries over
    first = start()
    assert sorted(fetched) == [f"s3://tests/resume/meg/s{i}_text_document.idx" for i in range(3)]
    index_cache.clear()
    fetched.clear()
    assert start() == first and fetched == []
    write_megatron(str(tmp_path / "s1_text_document"), parts[1][::-1])
    for ext in (".bin", ".idx"):
        fs.put(str(tmp_path / f"s1_text_document{ext}"), f"tests/resume/meg/s1_text_document{ext}")
    index_cache.clear()
    with pytest.raises(UserError, match="changed since the run recorded it"):
        start()
    assert fetched == ["s3://tests/resume/meg/s1_text_document.idx"]
    index_cache.clear()


def test_windows_are_ranged_reads_through_a_bounded_cache(shards, monkeypatch):
    """A few windows fetch their blocks, not the shards; the cache holds at most its bound."""
    root, parts = shards
    src = _src("megatron", f"{URL}/meg")
    stream = pretokenized.TokenStream([s.record() for s in pretokenized.open_shards(src, 300)])
    total = sum(os.path.getsize(root / "meg" / f"s{i}_text_document.bin") for i in range(3))
    monkeypatch.setattr(ranged, "CACHE", ranged.BlockCache(block_bytes=4096, max_bytes=3 * 4096))
    flat = np.concatenate([d for docs in parts for d in docs])
    for a in (5, 9000, 20000, 5):  # the last is a block the cache dropped: read again
        assert stream[a:a + 17].tolist() == flat[a:a + 17].tolist()
    assert ranged.CACHE.fetched <= 5 * 2 * 4096 < total and ranged.CACHE._bytes <= 3 * 4096
    for a, b in ((5, 22), (9000, 9017), (20000, 20017), (2000, 2100)):  # the last needs the oldest block and one more
        assert stream[a:b].tolist() == flat[a:b].tolist()
    stream.prefetch([(100, 117), (15000, 15017)])  # one concurrent batch, then served from the cache
    before = ranged.CACHE.fetched
    assert stream[15000:15017].tolist() == flat[15000:15017].tolist() and ranged.CACHE.fetched == before
    monkeypatch.setattr(ranged, "_SIZES", {})  # a process that has listed nothing yet: one LIST of the folder
    assert stream.file_sizes() == [os.path.getsize(root / "meg" / f"s{i}_text_document.bin") for i in range(3)]


def test_a_glob_or_prefix_that_matches_nothing_in_the_bucket_is_one_line(shards, tok, tmp_path, monkeypatch,
                                                                         capsys):
    """Through the command, before any collective: the field, the URL and the fix in one line, nothing written."""
    from launch import DEBUG, main_in_process
    for spec, fmt, words in ((f"{URL}/meg/*_nothing", "megatron", "matches no megatron file"),
                             (f"{URL}/np/none-*.npy", "numpy", "matches no numpy file"),
                             ("s3://no-such-bucket/x_text_document", "megatron", "bucket 'no-such-bucket' does not exist")):
        rd = tmp_path / "run"
        rc, err = main_in_process(monkeypatch, capsys, "--config", DEBUG, "--run_dir", str(rd), "--data.format", fmt,
                                  "--data.dataset", spec, "--data.tokenizer", tok, "--data.token_dtype", "uint16")
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert words in err and "data.dataset" in err, err
        assert not rd.exists()


@pytest.mark.slow
def test_a_run_from_the_bucket_gives_the_local_runs_losses(s3, tmp_path):
    """2 ranks, 3 steps on the debug corpus's stream written as 2 Megatron shards: read from the bucket (every rank
    its windows, through fsspec) and from the local files, the same losses, bitwise (the same tokens and batches)."""
    from launch import REFERENCE_BATCH, losses, prepared_data_dir, run
    from test_pretokenized import _run_args, _split
    cache = tmp_path / "cache"
    prepared_data_dir(cache)
    meta = data.read_meta(str(cache / "data"))["sources"]["default"]
    flat = np.fromfile(cache / "data" / meta["file"], dtype=meta["dtype"])
    docs = _split(flat, (np.flatnonzero(flat == 2) + 1).tolist())
    (tmp_path / "meg").mkdir()
    for i in range(2):
        write_megatron(str(tmp_path / "meg" / f"part{i}_text_document"), docs[i::2])
    s3fs.S3FileSystem(skip_instance_cache=True).put(str(tmp_path / "meg") + "/", "tests/run", recursive=True)
    runs = {}
    for name, spec in (("local", tmp_path / "meg" / "*_text_document"), ("s3", "s3://tests/run/*_text_document")):
        runs[name] = tmp_path / name
        run(2, "train_fsdp.py", *_run_args(runs[name], "--data.format", "megatron", "--data.dataset", spec,
                                           "--data.tokenizer", cache / "data" / "tokenizer.json",
                                           *REFERENCE_BATCH), env=s3)
    record = data.read_meta(str(runs["s3"] / "data"))["sources"]["default"]
    assert [p for p, _, _ in record["shards"]] == [f"s3://tests/run/part{i}_text_document.bin" for i in range(2)]
    assert len(losses(runs["s3"])) == 3 and losses(runs["s3"]) == losses(runs["local"])
