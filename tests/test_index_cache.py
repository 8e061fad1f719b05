"""The index cache (data_pipeline/index_cache.py): a resume reads no index, yet gives the first start's batches; what
the cache holds equals what reading the indexes gives; a shard rewritten in place (even with its size and mtime
kept) is read again and refused as a changed corpus; a damaged cache file is ignored, never trusted.

The reference is the indexes themselves (the parse functions run on the files) and the first start's batches."""
from __future__ import annotations

import os

import numpy as np
import pytest

import data
import prepare
from config import check_pretokenized
from core.errors import UserError
from data import DataConfig
from data_pipeline import index_cache, pretokenized
from data_pipeline.loader import DataState, GlobalBatchLoader
from model import ModelArgs
from pretok_writers import write_datatrove, write_megatron, write_numpy

EOS, VOCAB = 2, 300
PARSERS = {"megatron": "_megatron_entry", "datatrove": "_datatrove_entry", "numpy": "_numpy_entry"}


def _docs(n, seed, longest=40):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(3, VOCAB, rng.integers(1, longest)), EOS).astype(np.uint16) for _ in range(n)]


def _tokenizer(folder) -> str:
    """A word-level tokenizer.json of VOCAB ids with [EOT] = EOS (the ids are read, never encoded)."""
    from tokenizers import Tokenizer, models
    vocab = {"[PAD]": 0, "[BOT]": 1, "[EOT]": EOS, **{f"t{i}": i for i in range(3, VOCAB)}}
    path = os.path.join(folder, "tokenizer.json")
    Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")).save(path)
    return path


@pytest.fixture
def corpora(tmp_path):
    """fmt -> (DataConfig, index paths): 5 shards each; the first Megatron one holds more than ENDS_KEPT documents."""
    tok, out = _tokenizer(str(tmp_path)), {}
    for fmt in PARSERS:
        folder = tmp_path / fmt
        folder.mkdir()
        for i in range(5):
            docs = _docs(pretokenized.ENDS_KEPT + 200 if fmt == "megatron" and i == 0 else 30, seed=i,
                         longest=3 if i == 0 else 40)
            {"megatron": lambda p, d: write_megatron(p + "_text_document", d, np.uint16),
             "datatrove": lambda p, d: write_datatrove(p + ".ds", d),
             "numpy": lambda p, d: write_numpy(p + ".npy", d)}[fmt](str(folder / f"s{i}"), docs)
        spec = str(folder / "*.npy") if fmt == "numpy" else str(folder / "*.ds") if fmt == "datatrove" else str(folder)
        cfg = DataConfig(dataset=spec, format=fmt, tokenizer=tok, seq_len=16, val_fraction=0.1,
                         token_dtype="uint16" if fmt != "megatron" else "")
        suffix = {"megatron": "_text_document.idx", "datatrove": ".ds.index", "numpy": ".npy"}[fmt]
        out[fmt] = cfg, [str(folder / f"s{i}{suffix}") for i in range(5)]
    index_cache.clear()  # a fresh process
    yield out
    index_cache.clear()


def _start(cfg: DataConfig, run) -> list:
    """A start as train.py makes it on one rank: the checks, preparation's record, then 3 steps of global batches."""
    check_pretokenized(cfg, ModelArgs(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, n_kv_heads=2), str(run))
    prepare.prepare(cfg, str(run / "data"))
    loader = GlobalBatchLoader(data.PackedCorpus(str(run / "data"), cfg, VOCAB), 4, 4, 0, 1, 0, DataState())
    return [[t.tolist() for inp, _ in loader.next_step() for t in inp] for _ in range(3)]


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_a_resume_reads_no_index_and_gives_the_same_batches(corpora, tmp_path, monkeypatch, fmt):
    cfg, indexes = corpora[fmt]
    first = _start(cfg, tmp_path / "run")
    assert index_cache.stats["read"] == len(indexes)  # the checks read each once; the record reads none again
    assert os.path.isfile(tmp_path / "run" / "data" / index_cache.FILE)
    index_cache.clear()  # the resume is another process: only the cache file carries over

    def refuse(path, data):
        raise AssertionError(f"a resume read the index '{path}'")
    monkeypatch.setattr(pretokenized, PARSERS[fmt], refuse)
    assert _start(cfg, tmp_path / "run") == first
    assert index_cache.stats["read"] == 0


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_the_cache_holds_what_reading_the_indexes_gives(corpora, tmp_path, fmt):
    cfg, indexes = corpora[fmt]
    _start(cfg, tmp_path / "run")
    index_cache.clear()
    index_cache.load(str(tmp_path / "run" / "data"))
    parse = getattr(pretokenized, PARSERS[fmt])
    for path in indexes:
        cached, read = index_cache._ENTRIES[index_cache.key(path)], parse(path, None)
        assert (cached.dtype, cached.n_tokens, cached.n_docs, cached.sha256) == \
            (read.dtype, read.n_tokens, read.n_docs, read.sha256)
        assert (cached.ends is None and read.ends is None) or np.array_equal(cached.ends, read.ends)
    if fmt == "megatron":  # the big shard keeps ENDS_KEPT spread ends, the last among them
        big = index_cache._ENTRIES[index_cache.key(indexes[0])]
        assert big.n_docs == pretokenized.ENDS_KEPT + 200 and len(big.ends) == pretokenized.ENDS_KEPT
        assert big.ends[-1] == big.n_tokens


def test_a_shard_rewritten_in_place_is_read_again_and_refused(corpora, tmp_path):
    """Other tokens under the same name, the index the same size and its mtime set back: its ctime still differs."""
    cfg, indexes = corpora["megatron"]
    _start(cfg, tmp_path / "run")
    st = os.stat(indexes[2])
    write_megatron(indexes[2][:-4], _docs(30, seed=2)[::-1], np.uint16)  # the same lengths' sum, in another order
    os.utime(indexes[2], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(indexes[2]) == st.st_size
    for fresh in (False, True):  # the same process (its memo), then a resume (the cache file)
        if fresh:
            index_cache.clear()
        with pytest.raises(UserError, match="changed since the run recorded it"):
            _start(cfg, tmp_path / "run")
        with pytest.raises(UserError, match="changed since the run recorded it"):
            prepare.prepare(cfg, str(tmp_path / "run" / "data"))


def test_a_damaged_cache_file_is_ignored_and_written_again(corpora, tmp_path):
    cfg, indexes = corpora["datatrove"]
    first = _start(cfg, tmp_path / "run")
    path = tmp_path / "run" / "data" / index_cache.FILE
    path.write_bytes(path.read_bytes()[:100])  # what a copy cut short leaves (our own writes are renamed whole)
    index_cache.clear()
    assert _start(cfg, tmp_path / "run") == first
    assert index_cache.stats["read"] == len(indexes)
    index_cache.clear()
    index_cache.load(str(path.parent))
    assert all(index_cache.key(p) in index_cache._ENTRIES for p in indexes)
