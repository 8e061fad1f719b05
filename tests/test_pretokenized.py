"""Corpora tokenized elsewhere (data.format megatron, numpy, datatrove): the reader gives back what the writer was
given, document by document; the same tokens give the same windows as a prepared raw-text source; bad input is one
line naming the file and the fix; any Hugging Face tokenizer's own EOS (and a BOS) separates documents.

Fixture writers: tests/pretok_writers.py (which says whose source each follows)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data
import prepare
from config import Config, check_pretokenized, check_tokenizer
from core.errors import UserError
from data import DataConfig, DataError, SourceConfig
from data_pipeline import megatron_index, pretokenized, tokenizer
from launch import (
    DEBUG,
    REFERENCE_BATCH,
    losses,
    main_in_process,
    metrics,
    prepared_data_dir,
    run,
    start,
    train_in_process,
    wait_for_step,
    wait_until_unlocked,
)
from model import ModelArgs
from pretok_writers import write_datatrove, write_megatron, write_numpy
from test_data import _prepare_on_ranks

EOS = 2


def _docs(n=40, seed=0, vocab=300):
    """n documents of 1..60 random ids in [3, vocab), each ended by EOS."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.integers(3, vocab, rng.integers(1, 60)), [EOS]]).astype(np.int64) for _ in range(n)]


def _split(tokens: np.ndarray, ends) -> list[list[int]]:
    starts = [0, *ends[:-1]]
    return [tokens[a:b].tolist() for a, b in zip(starts, ends)]


def _src(fmt, dataset, **kw):
    return SourceConfig(name="default", dataset=str(dataset), format=fmt, token_dtype=kw.pop("token_dtype", ""), **kw)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reader_gives_back_each_document(tmp_path, dtype):
    docs = [_docs(30, 1), _docs(20, 2)]
    for i, d in enumerate(docs):
        write_megatron(str(tmp_path / f"shard_{i}_text_document"), d, dtype)
    for spec in (tmp_path, tmp_path / "shard_*_text_document", tmp_path / "shard_*_text_document.idx"):
        shards = pretokenized.open_shards(_src("megatron", spec), 300)
        assert [s.dtype for s in shards] == [np.dtype(dtype)] * 2
        for s, want in zip(shards, docs):
            got = _split(np.fromfile(s.path, dtype=s.dtype), s.doc_ends)
            assert got == [d.tolist() for d in want]
    one = pretokenized.open_shards(_src("megatron", tmp_path / "shard_0_text_document"), 300)
    assert len(one) == 1 and one[0].n_tokens == sum(len(d) for d in docs[0])


def test_our_megatron_writer_is_megatron_cores(tmp_path):
    """The fixture writer against Megatron-Core's own IndexedDatasetBuilder (when megatron-core is importable)."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    docs = _docs(25, 3)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "real.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(tmp_path / "real.idx"))
    write_megatron(str(tmp_path / "ours"), docs, np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"real{ext}").read_bytes() == (tmp_path / f"ours{ext}").read_bytes()
    # prepare.py's own index (data.prepared_format megatron) is the builder's too, and Megatron-Core reads it
    megatron_index.write_megatron_index(str(tmp_path / "prepared.idx"), [len(d) for d in docs], "uint16")
    assert (tmp_path / "prepared.idx").read_bytes() == (tmp_path / "real.idx").read_bytes()
    shutil.copyfile(tmp_path / "real.bin", tmp_path / "prepared.bin")
    read = indexed.IndexedDataset(str(tmp_path / "prepared"))
    assert [read[i].tolist() for i in range(len(read))] == [d.tolist() for d in docs]


def test_numpy_and_datatrove_readers_give_back_each_document(tmp_path):
    docs = _docs(50, 4)
    (tmp_path / "np").mkdir()
    write_numpy(str(tmp_path / "np" / "part-0-00000.npy"), docs[:20])
    write_numpy(str(tmp_path / "np" / "part-1-00000.npy"), docs[20:])
    shards = pretokenized.open_shards(_src("numpy", tmp_path / "np" / "part-*.npy", token_dtype="uint16"), 300)
    stream = np.concatenate([np.fromfile(s.path, np.uint16) for s in shards])
    assert _split(stream, (np.flatnonzero(stream == EOS) + 1).tolist()) == [d.tolist() for d in docs]
    (tmp_path / "dt").mkdir()
    write_datatrove(str(tmp_path / "dt" / "00000_unshuffled.ds"), docs[:30])
    write_datatrove(str(tmp_path / "dt" / "00001_unshuffled.ds"), docs[30:])
    shards = pretokenized.open_shards(_src("datatrove", tmp_path / "dt"), 300)
    got = [d for s in shards for d in _split(np.fromfile(s.path, np.uint16), s.doc_ends)]
    assert got == [d.tolist() for d in docs]


def test_a_stream_of_shards_reads_windows_across_shard_boundaries(tmp_path):
    parts = [np.arange(k * 100, k * 100 + n, dtype=np.uint16) for k, n in enumerate((7, 1, 30, 5))]
    for k, p in enumerate(parts):
        p.tofile(tmp_path / f"{k}.npy")
    stream = data.TokenStream([[str(tmp_path / f"{k}.npy"), "uint16", len(p)] for k, p in enumerate(parts)])
    flat = np.concatenate(parts)
    for a in range(len(flat)):
        for b in (a, a + 1, a + 9, len(flat)):
            assert stream[a:b].tolist() == flat[a:b].tolist()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process' file descriptors (Linux)")
def test_a_slice_over_many_shards_keeps_at_most_open_maps_files_open(tmp_path, monkeypatch):
    """Each map holds a file descriptor: a scan block over 10,000 small shards must not hold one per shard (past a
    usual limit of 1,024 descriptors), only the OPEN_MAPS the stream keeps."""
    from data_pipeline import streams
    monkeypatch.setattr(streams, "OPEN_MAPS", 4)
    parts = [np.full(3, k, np.uint16) for k in range(60)]
    for k, p in enumerate(parts):
        p.tofile(tmp_path / f"{k}.npy")
    stream = streams.TokenStream([[str(tmp_path / f"{k}.npy"), "uint16", 3] for k in range(60)])
    before, peak, real = len(os.listdir("/proc/self/fd")), [], streams.TokenStream._map

    def counting(self, i):
        peak.append(len(os.listdir("/proc/self/fd")))
        return real(self, i)
    monkeypatch.setattr(streams.TokenStream, "_map", counting)
    assert stream[1:179].tolist() == np.concatenate(parts)[1:179].tolist()
    assert max(peak) - before <= 4 + 1, (before, max(peak))


@pytest.fixture(scope="module")
def raw_corpus(tmp_path_factory):
    """A raw-text source prepared here, and its stream written as Megatron, numpy and datatrove files."""
    root = tmp_path_factory.mktemp("text")
    for i in range(60):
        (root / f"doc{i:03d}.txt").write_text(f"document {i}: " + " ".join(f"w{j % 41}" for j in range(30 + 9 * i)))
    out = str(tmp_path_factory.mktemp("prepared"))
    cfg = DataConfig(dataset=str(root / "*.txt"), tokenizer_vocab_size=300, seq_len=16, val_fraction=0.1)
    prepare.prepare(cfg, out)
    meta = data.read_meta(out)
    flat = np.fromfile(os.path.join(out, meta["sources"]["default"]["file"]), dtype=np.uint16)
    docs = _split(flat, (np.flatnonzero(flat == EOS) + 1).tolist())
    pre = tmp_path_factory.mktemp("pretok")
    write_megatron(str(pre / "corpus_text_document"), docs, np.uint16)
    write_numpy(str(pre / "a.npy"), docs[:25])
    write_numpy(str(pre / "b.npy"), docs[25:])
    write_datatrove(str(pre / "c.ds"), docs)
    return cfg, out, pre


@pytest.mark.parametrize("fmt,spec", [("megatron", "corpus_text_document"), ("numpy", "*.npy"),
                                      ("datatrove", "c.ds")])
def test_the_same_tokens_give_the_same_windows_as_raw_text(raw_corpus, tmp_path, fmt, spec):
    cfg, out, pre = raw_corpus
    tok = os.path.join(out, "tokenizer.json")
    pcfg = DataConfig(dataset=str(pre / spec), format=fmt, tokenizer=tok, seq_len=16, val_fraction=0.1,
                      token_dtype="uint16" if fmt == "numpy" else "")
    check_pretokenized(pcfg, ModelArgs(vocab_size=300, dim=16, n_layers=1, n_heads=2, n_kv_heads=2), str(tmp_path))
    prepare.prepare(pcfg, str(tmp_path / "data"))
    assert not os.listdir(tmp_path / "data" / "sources") if os.path.isdir(tmp_path / "data" / "sources") else True
    raw, ours = data.PackedCorpus(out, cfg), data.PackedCorpus(str(tmp_path / "data"), pcfg, 300)
    assert (raw.n_train, raw.n_val) == (ours.n_train, ours.n_val)
    for i in range(raw.n_train + raw.n_val):
        assert raw.sample(i).tolist() == ours.sample(i).tolist()


def test_a_mixture_of_raw_and_pretokenized_sources_with_stages(raw_corpus, tmp_path):
    """Raw and Megatron sources in one mixture: the pre-tokenized one is prepared as a record only, and the
    loader's global batches are the same at 1, 2 and 4 data-parallel ranks."""
    from data_pipeline.loader import DataState, GlobalBatchLoader
    cfg, out, pre = raw_corpus
    mixed = DataConfig(tokenizer=os.path.join(out, "tokenizer.json"), seq_len=16, val_fraction=0.1, sources=[
        SourceConfig(name="text", dataset=cfg.dataset, weight=0.5),
        SourceConfig(name="meg", dataset=str(pre / "corpus_text_document"), format="megatron", weight=0.5)],
        stages=[data.StageConfig(start_step=2, weights={"meg": 0.9, "text": 0.1})])
    prepare.prepare(mixed, str(tmp_path / "data"))
    meta = data.read_meta(str(tmp_path / "data"))
    assert meta["sources"]["meg"]["format"] == "megatron" and "file" not in meta["sources"]["meg"]
    corpus = data.PackedCorpus(str(tmp_path / "data"), mixed, 300)

    def batches(dp):
        loaders = [GlobalBatchLoader(corpus, 8, 8 // dp, r, dp, 0, DataState()) for r in range(dp)]
        out = []
        for _ in range(5):
            out.append([t.tolist() for ld in loaders for inp, _ in ld.next_step() for t in inp])
        return out
    one = batches(1)
    assert one == batches(2) == batches(4)


def _model(vocab=300):
    return ModelArgs(vocab_size=vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=2)


def _check(src_cfg: DataConfig, tmp_path, vocab=300):
    with pytest.raises(UserError) as e:  # DataError or SetupError: a crash is not an answer
        check_pretokenized(src_cfg, _model(vocab), str(tmp_path / "run"))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_pretokenized_input_is_one_line_naming_the_file(raw_corpus, tmp_path):
    _, out, _ = raw_corpus
    tok = os.path.join(out, "tokenizer.json")
    docs = _docs(10, 5)

    def meg(name, **kw):
        write_megatron(str(tmp_path / name), docs, **kw)
        return DataConfig(dataset=str(tmp_path / name), format="megatron", tokenizer=tok)

    c = meg("short")
    with open(tmp_path / "short.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "short.bin") // 2)
    assert "truncated" in _check(c, tmp_path) and "short.bin" in _check(c, tmp_path)
    assert "version 2" in _check(meg("v2", version=2), tmp_path)
    assert "not a Megatron MMIDIDX index" in _check(meg("magic", magic=b"NOTMAGIC\x00"), tmp_path)
    c = meg("int32", dtype=np.int32)
    c.token_dtype = "uint16"
    assert "holds int32 tokens but data.token_dtype is uint16" in _check(c, tmp_path)
    big = [d.copy() for d in docs]
    big[4][0] = 5000
    write_megatron(str(tmp_path / "big"), big)
    assert "token id 5000, outside the model's 300 ids" in _check(
        DataConfig(dataset=str(tmp_path / "big"), format="megatron", tokenizer=tok), tmp_path)
    neg = [d.astype(np.int32) for d in docs]
    neg[6][0] = -1  # Megatron's int32 files can hold a negative id (a padding value), which no embedding row has
    write_megatron(str(tmp_path / "neg"), neg, np.int32)
    assert "token id -1, outside the model's 300 ids" in _check(
        DataConfig(dataset=str(tmp_path / "neg"), format="megatron", tokenizer=tok), tmp_path)
    noeos = [d[:-1] for d in docs]
    write_megatron(str(tmp_path / "noeos"), noeos)
    assert "not the EOS id 2" in _check(DataConfig(dataset=str(tmp_path / "noeos"), format="megatron", tokenizer=tok),
                                        tmp_path)
    write_megatron(str(tmp_path / "empty"), [])
    assert "holds no token" in _check(DataConfig(dataset=str(tmp_path / "empty"), format="megatron", tokenizer=tok),
                                      tmp_path)
    assert "matches no megatron file" in _check(
        DataConfig(dataset=str(tmp_path / "nothing_*"), format="megatron", tokenizer=tok), tmp_path)
    assert "a tokens source is copied by preparation from local files" in _check(  # megatron etc.: test_pretok_s3
        DataConfig(dataset="s3://bucket/tokens/*.parquet", format="tokens", tokenizer=tok), tmp_path)
    os.remove(tmp_path / "big.idx")
    assert "has no" in _check(DataConfig(dataset=str(tmp_path / "big"), format="megatron", tokenizer=tok), tmp_path)
    write_datatrove(str(tmp_path / "x.ds"), docs)
    os.remove(tmp_path / "x.ds.index")
    assert "x.ds.index" in _check(DataConfig(dataset=str(tmp_path / "x.ds"), format="datatrove", tokenizer=tok),
                                  tmp_path)
    assert "give --data.tokenizer" in _check(DataConfig(dataset=str(tmp_path / "x.ds"), format="datatrove"), tmp_path)
    c = meg("docidx")
    raw = bytearray((tmp_path / "docidx.idx").read_bytes())
    raw[-(len(docs) + 1) * 8:] = np.arange(len(docs) + 1, dtype=np.int64)[::-1].tobytes()  # from n down to 0
    (tmp_path / "docidx.idx").write_bytes(bytes(raw))
    assert "document indices do not run from 0 up to its 10 sequences" in _check(c, tmp_path)
    write_numpy(str(tmp_path / "n.npy"), docs)
    assert "data.token_dtype: a numpy source's files do not record their dtype" in _check(
        DataConfig(dataset=str(tmp_path / "n.npy"), format="numpy", tokenizer=tok), tmp_path)


def test_a_datatrove_folder_reads_only_its_token_files(tmp_path):
    """DocumentTokenizer leaves .ds.index, .ds.loss and .ds.metadata beside each .ds: a glob of the folder gives the
    writer's documents, not those files as shards."""
    docs = _docs(12, 11)
    write_datatrove(str(tmp_path / "00000_unshuffled.ds"), docs)
    (tmp_path / "00000_unshuffled.ds.metadata").write_text("gpt2\n{}\n".format(sum(len(d) for d in docs)))
    (tmp_path / "00000_unshuffled.ds.loss").write_bytes(b"\x01" * sum(len(d) for d in docs))
    for spec in (tmp_path, tmp_path / "*"):
        shards = pretokenized.open_shards(_src("datatrove", spec), 300)
        assert [os.path.basename(s.path) for s in shards] == ["00000_unshuffled.ds"]
        assert _split(np.fromfile(shards[0].path, np.uint16), shards[0].doc_ends) == [d.tolist() for d in docs]


def test_a_tokenizer_without_a_separator_is_refused_at_start_naming_the_users_file(tmp_path):
    """Raw text too: a tokenizer with no [EOT] and no tokenizer_config.json, or a data.eos_token / data.bos_token it
    lacks, is refused by the start-up check (every rank, no collective), naming the given file."""
    path = llama3_like_tokenizer(str(tmp_path / "tok"))
    model = _model(400)
    check_tokenizer(path, model, bos_token="<|begin_of_text|>")
    with pytest.raises(DataError, match="data.bos_token: .* has no token '<s>'"):
        check_tokenizer(path, model, bos_token="<s>")
    os.remove(tmp_path / "tok" / "tokenizer_config.json")
    with pytest.raises(DataError, match=f"'{path}' has no \\[EOT\\].*--data.eos_token"):
        check_tokenizer(path, model)
    check_tokenizer(path, model, eos_token="<|end_of_text|>")


def test_a_corpus_changed_under_a_run_is_refused(raw_corpus, tmp_path):
    _, out, _ = raw_corpus
    docs = _docs(10, 6)
    write_megatron(str(tmp_path / "c"), docs)
    cfg = DataConfig(dataset=str(tmp_path / "c"), format="megatron", tokenizer=os.path.join(out, "tokenizer.json"))
    prepare.prepare(cfg, str(tmp_path / "data"))
    prepare.prepare(cfg, str(tmp_path / "data"))  # unchanged: reused
    write_megatron(str(tmp_path / "c"), docs[:-1])
    with pytest.raises(DataError, match="changed since the run recorded it"):
        prepare.prepare(cfg, str(tmp_path / "data"))


def llama3_like_tokenizer(folder) -> str:
    """A tokenizer.json shaped like Llama 3's (byte-level BPE, <|begin_of_text|> and <|end_of_text|>, no [EOT]) and
    its tokenizer_config.json naming eos_token, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f"def f{i}(x): return x * {i}\n" for i in range(300)], trainer=trainer)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return path


def test_a_llama3_shaped_tokenizer_separates_documents_with_its_own_eos_and_bos(tmp_path):
    path = llama3_like_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.separator_ids(path) == (1, None)
    assert tokenizer.separator_ids(path, bos_token="<|begin_of_text|>") == (1, 0)
    (tmp_path / "t").mkdir()
    for i in range(20):
        (tmp_path / "t" / f"{i}.txt").write_text(f"def g{i}(y): return y + {i}\n" * (i + 1))
    cfg = DataConfig(dataset=str(tmp_path / "t" / "*.txt"), tokenizer=path, bos_token="<|begin_of_text|>", seq_len=16)
    prepare.prepare(cfg, str(tmp_path / "data"))
    assert os.path.isfile(tmp_path / "data" / "tokenizer_config.json")  # the run's copy keeps its EOS
    stream = np.fromfile(data.PackedCorpus(str(tmp_path / "data"), cfg).sources[0].tokens.filename, np.uint16)
    assert (stream == 1).sum() == (stream == 0).sum() == 20 and stream[0] == 0 and stream[-1] == 1
    assert (np.flatnonzero(stream == 0)[1:] == np.flatnonzero(stream == 1)[:-1] + 1).all()  # EOS then BOS
    shutil.rmtree(tmp_path / "data")
    os.remove(tmp_path / "tok" / "tokenizer_config.json")
    with pytest.raises(DataError, match="--data.eos_token"):
        tokenizer.separator_ids(path)
    assert tokenizer.separator_ids(path, "<|end_of_text|>") == (1, None)


def test_text_sources_keep_their_settings_and_key():
    """A raw-text source's reading settings (its key in a prepared directory) do not change with formats."""
    assert SourceConfig(name="a", dataset="stdlib").reading() == {
        "dataset": "stdlib", **{k: None for k in data.READING_FIELDS}}
    assert "eos_token" not in Config().data.prepared_settings()["tokenizer"]


def test_a_tokens_dataset_is_materialised_once_with_an_eos_after_each_row(raw_corpus, tmp_path):
    """data.format tokens: parquet and arrow files with an input_ids column; rows already ending with the EOS keep
    theirs, the others get one; the stream is the rows' ids in file order."""
    _, out, _ = raw_corpus
    docs = _docs(30, 7)
    rows = [d.tolist() if i % 2 else d[:-1].tolist() for i, d in enumerate(docs)]  # half without their EOS
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"input_ids": rows[:10], "text": ["x"] * 10}), tmp_path / "ds" / "a.parquet")
    table = pa.table({"input_ids": rows[10:]})
    with pa.ipc.new_stream(str(tmp_path / "ds" / "b.arrow"), table.schema) as w:
        w.write_table(table)
    cfg = DataConfig(dataset=str(tmp_path / "ds"), format="tokens", tokenizer=os.path.join(out, "tokenizer.json"),
                     seq_len=16)
    check_pretokenized(cfg, _model(), str(tmp_path / "run"))
    prepare.prepare(cfg, str(tmp_path / "data"))
    meta = data.read_meta(str(tmp_path / "data"))["sources"]["default"]
    stream = np.fromfile(os.path.join(tmp_path, "data", meta["file"]), dtype=meta["dtype"])
    assert stream.tolist() == np.concatenate(docs).tolist() and meta["n_documents"] == 30
    bad = DataConfig(dataset=str(tmp_path / "ds"), format="tokens", token_column="ids", tokenizer=cfg.tokenizer)
    assert "has no column 'ids'" in _check(bad, tmp_path)
    wrong = DataConfig(dataset=str(tmp_path / "ds" / "a.parquet"), format="tokens", token_column="text",
                       tokenizer=cfg.tokenizer)
    assert "column 'text' of" in _check(wrong, tmp_path) and "not lists of integer token ids" in _check(wrong, tmp_path)


def test_the_command_refuses_bad_token_files_in_one_line_and_writes_nothing(raw_corpus, tmp_path, monkeypatch,
                                                                            capsys):
    _, out, _ = raw_corpus
    tok = os.path.join(out, "tokenizer.json")
    docs = _docs(20, 8)
    write_megatron(str(tmp_path / "short"), docs)
    with open(tmp_path / "short.bin", "r+b") as f:
        f.truncate(10)
    big = [d.copy() for d in docs]
    big[3][1] = 5000
    write_megatron(str(tmp_path / "big"), big)
    for prefix, msg in (("short", "truncated"), ("big", "token id 5000, outside the model's 4096 ids")):
        rd = tmp_path / f"run_{prefix}"
        rc, err = main_in_process(monkeypatch, capsys, "--config", DEBUG, "--run_dir", str(rd), "--data.format",
                                  "megatron", "--data.dataset", str(tmp_path / prefix), "--data.tokenizer", tok)
        assert rc == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err
        assert not rd.exists()


def _run_args(rd, *extra):
    return ["--config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                     "debug.toml"), "--run_dir", str(rd), "--train.steps", "3", "--train.val_interval",
            "0", "--checkpoint.interval", "1000", *map(str, extra)]


@pytest.mark.slow
def test_raw_text_and_the_same_tokens_as_megatron_and_datatrove_train_alike(tmp_path):
    """2 ranks, 3 steps: the raw-text run's losses, bitwise, from its stream written as Megatron and datatrove files."""
    raw = tmp_path / "raw"
    prepared_data_dir(raw)
    run(2, "train_fsdp.py", *_run_args(raw))
    meta = data.read_meta(str(raw / "data"))["sources"]["default"]
    flat = np.fromfile(raw / "data" / meta["file"], dtype=meta["dtype"])
    docs = _split(flat, (np.flatnonzero(flat == EOS) + 1).tolist())
    write_megatron(str(tmp_path / "corpus_text_document"), docs, np.uint16)
    write_datatrove(str(tmp_path / "c.ds"), docs)
    for fmt, spec in (("megatron", "corpus_text_document"), ("datatrove", "c.ds")):
        rd = tmp_path / fmt
        run(2, "train_fsdp.py", *_run_args(rd, "--data.format", fmt, "--data.dataset", tmp_path / spec,
                                           "--data.tokenizer", raw / "data" / "tokenizer.json"))
        assert losses(rd) == losses(raw)
        assert not os.path.isdir(rd / "data" / "sources") or not os.listdir(rd / "data" / "sources")  # no copy


@pytest.mark.slow
def test_a_llama3_shaped_tokenizer_trains_generates_and_exports(tmp_path, capsys, monkeypatch):
    """<|begin_of_text|> before and <|end_of_text|> after each document, document_mask on its EOS id; generation
    starts from its BOS; the export names them and transformers' tokenizer gives the same ids."""
    transformers = pytest.importorskip("transformers")
    import generate
    import hf
    path = llama3_like_tokenizer(str(tmp_path / "tok"))
    rd = tmp_path / "run"
    train_in_process(monkeypatch, capsys, *_run_args(rd, "--data.tokenizer", path, "--data.bos_token",
                                                     "<|begin_of_text|>", "--model.document_mask", "true",
                                                     "--model.eot_id", "1", "--data.max_documents", "60"))
    assert len([r for r in metrics(rd) if "loss" in r]) == 3
    assert generate.main(["--run_dir", str(rd), "--prompt", "def f(", "--max_new_tokens", "4"]) == 0
    assert hf.main(["export", "--run_dir", str(rd), "--out", str(tmp_path / "hf")]) == 0
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    ours = tokenizer.load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs.eos_token == "<|end_of_text|>" and theirs.bos_token == "<|begin_of_text|>"
    text = "def f3(x): return x * 3\n"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False).ids
    # Continued pretraining from that Hugging Face folder: its tokenizer (no [EOT]) is the run's, its EOS the separator
    cont = tmp_path / "continued"
    train_in_process(monkeypatch, capsys, *_run_args(cont, "--init_from_hf", tmp_path / "hf", "--model.document_mask",
                                                     "true", "--model.eot_id", "1", "--data.max_documents", "60",
                                                     "--train.steps", "1"))
    assert len([r for r in metrics(cont) if "loss" in r]) == 1


def test_prepared_format_megatron_writes_an_index_megatron_reads(raw_corpus, tmp_path):
    """--data.prepared_format megatron: the prepared stream with a Megatron .idx beside it, read back as a megatron
    source with the prepared source's documents and windows."""
    cfg, out, _ = raw_corpus
    mcfg = DataConfig(dataset=cfg.dataset, tokenizer=os.path.join(out, "tokenizer.json"), seq_len=16, val_fraction=0.1,
                      prepared_format="megatron")
    prepare.prepare(mcfg, str(tmp_path / "data"))
    meta = data.read_meta(str(tmp_path / "data"))["sources"]["default"]
    prefix = str(tmp_path / "data" / meta["file"])[:-4]
    shards = pretokenized.open_shards(_src("megatron", prefix), 300)
    assert shards[0].n_tokens == meta["n_tokens"] and len(shards[0].doc_ends) == meta["n_documents"]
    reread = DataConfig(dataset=prefix, format="megatron", tokenizer=mcfg.tokenizer, seq_len=16, val_fraction=0.1)
    prepare.prepare(reread, str(tmp_path / "again"))
    a, b = data.PackedCorpus(str(tmp_path / "data"), mcfg), data.PackedCorpus(str(tmp_path / "again"), reread, 300)
    assert [a.sample(i).tolist() for i in range(a.n_train)] == [b.sample(i).tolist() for i in range(b.n_train)]


def test_a_changed_corpus_is_refused_before_any_collective(raw_corpus, tmp_path):
    """The start-up checks compare the run's record with the files (as preparation does, later, on rank 0)."""
    _, out, _ = raw_corpus
    docs = _docs(10, 9)
    write_megatron(str(tmp_path / "c"), docs)
    cfg = DataConfig(dataset=str(tmp_path / "c"), format="megatron", tokenizer=os.path.join(out, "tokenizer.json"))
    prepare.prepare(cfg, str(tmp_path / "run" / "data"))
    check_pretokenized(cfg, _model(), str(tmp_path / "run"))  # unchanged
    write_megatron(str(tmp_path / "c"), docs[::-1])  # the same sizes, another order: the index differs
    assert "changed since the run recorded it" in _check(cfg, tmp_path)


@pytest.mark.slow
def test_a_mixture_with_a_megatron_source_sigkilled_resumes_at_another_world_size(tmp_path, monkeypatch, capsys):
    """Raw text and Megatron sources with a stage from step 3: a run on 2 ranks SIGKILLed (every process, as a node
    failure) once step 3 is logged, resumed from its checkpoint of step 2 on 1 rank across the stage change to step
    4, gives the uninterrupted 2-rank run's losses (up to the reduction order), one record per step."""
    cache = tmp_path / "cache"
    prepared_data_dir(cache)
    meta = data.read_meta(str(cache / "data"))["sources"]["default"]
    flat = np.fromfile(cache / "data" / meta["file"], dtype=meta["dtype"])
    write_megatron(str(tmp_path / "corpus_text_document"), _split(flat, (np.flatnonzero(flat == EOS) + 1).tolist()))
    config = tmp_path / "mixed.toml"
    config.write_text(open(DEBUG).read() + f"""
[[data.sources]]
name = "text"
dataset = "stdlib"
weight = 0.5

[[data.sources]]
name = "meg"
dataset = "{tmp_path / 'corpus_text_document'}"
format = "megatron"
weight = 0.5

[[data.stages]]
start_step = 2
weights = {{ meg = 0.8, text = 0.2 }}
""")
    common = ["--config", config, "--data.tokenizer", cache / "data" / "tokenizer.json", "--train.val_interval", "0",
              "--checkpoint.interval", "2", "--train.steps", "4", *REFERENCE_BATCH]
    run(2, "train_fsdp.py", *common, "--run_dir", tmp_path / "whole")
    killed = tmp_path / "killed"
    p = start(2, "train_fsdp.py", *common, "--run_dir", killed, log_path=tmp_path / "killed.log")
    wait_for_step(killed, 3, p)
    p.kill()
    assert p.wait(timeout=60) != 0, "the run finished before it was killed"
    wait_until_unlocked(killed)
    resumed = train_in_process(monkeypatch, capsys, *common, "--run_dir", killed).stdout
    assert "resumed from" in resumed and "at step 2" in resumed, resumed[-2000:]
    whole, got = losses(tmp_path / "whole"), losses(killed)
    assert [r["step"] for r in metrics(killed) if "loss" in r] == list(range(1, 5))
    assert all(abs(got[s] - whole[s]) <= 1e-4 * abs(whole[s]) for s in whole), (whole, got)


@pytest.mark.parametrize("world", [2, 4])
def test_a_tokens_dataset_copied_by_several_ranks_is_the_one_rank_stream_byte_for_byte(raw_corpus, tmp_path, world):
    _, out, _ = raw_corpus
    docs = _docs(40, 10)
    (tmp_path / "ds").mkdir()
    for k in range(5):  # 5 files over `world` ranks: some ranks copy two
        pq.write_table(pa.table({"input_ids": [d.tolist() for d in docs[k::5]]}), tmp_path / "ds" / f"{k}.parquet")
    cfg = DataConfig(dataset=str(tmp_path / "ds"), format="tokens", tokenizer=os.path.join(out, "tokenizer.json"))
    prepare.prepare(cfg, str(tmp_path / "one"))
    metas = _prepare_on_ranks(cfg, str(tmp_path / "many"), world)
    assert not any(isinstance(m, Exception) for m in metas), metas
    one, many = (data.read_meta(str(tmp_path / d))["sources"]["default"] for d in ("one", "many"))
    assert one["work_units"] == 5 and one == many
    assert (tmp_path / "one" / one["file"]).read_bytes() == (tmp_path / "many" / many["file"]).read_bytes()


def test_an_id_the_sampled_scan_misses_is_refused_when_its_window_is_built(raw_corpus, tmp_path, monkeypatch):
    """A large source is scanned in spread blocks at start; an id between them stops the run when a batch holds it."""
    _, out, _ = raw_corpus
    flat = np.concatenate(_docs(60, 12))
    pos = len(flat) // 2 + int(flat[len(flat) // 2] == EOS)  # not a document end: the EOS check reads those
    flat[pos] = 5000
    flat.astype(np.uint16).tofile(tmp_path / "big.npy")
    monkeypatch.setattr(pretokenized, "FULL_SCAN_TOKENS", 64)
    monkeypatch.setattr(pretokenized, "SCAN_SAMPLES", 2)
    monkeypatch.setattr(pretokenized, "SCAN_BLOCK", 16)  # the scan reads the first and the last 16 tokens only
    cfg = DataConfig(dataset=str(tmp_path / "big.npy"), format="numpy", token_dtype="uint16", seq_len=16,
                     val_fraction=0.0, tokenizer=os.path.join(out, "tokenizer.json"))
    check_pretokenized(cfg, _model(), str(tmp_path / "run"))
    prepare.prepare(cfg, str(tmp_path / "run" / "data"))
    corpus = data.PackedCorpus(str(tmp_path / "run" / "data"), cfg, 300)
    good = [i for i in range(corpus.n_train) if not i * 16 <= pos <= i * 16 + 16]
    assert all(corpus.sample(i).max() < 300 for i in good)
    with pytest.raises(DataError, match=f"window {pos // 16} holds token id 5000, outside the model's 300 ids"):
        corpus.sample(pos // 16)


def test_datatroves_own_document_tokenizer_output_is_read_back(tmp_path):
    """datatrove's DocumentTokenizer (when importable: `pip install --no-deps datatrove loguru humanize`) writes a
    folder (.ds, .ds.index, .ds.metadata) that the reader gives back document by document: the tokenizer's ids of
    each text, then its EOS."""
    pytest.importorskip("datatrove.pipeline.tokens.tokenizer")
    from datatrove.data import Document
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer
    path = llama3_like_tokenizer(str(tmp_path / "tok"))
    texts = [f"def f{i}(x): return x * {i}\n" * (1 + i % 5) for i in range(40)]
    step = DocumentTokenizer(output_folder=str(tmp_path / "out"), tokenizer_name_or_path=path,
                             eos_token="<|end_of_text|>", shuffle_documents=False)
    for _ in step.run(iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=0, world_size=1) or ():
        pass
    tok = tokenizer.load_tokenizer(path)
    want = [tok.encode(t, add_special_tokens=False).ids + [1] for t in texts]
    for spec in (tmp_path / "out", tmp_path / "out" / "*"):
        shards = pretokenized.open_shards(_src("datatrove", spec), tok.get_vocab_size())
        assert len(shards) == 1
        assert _split(np.fromfile(shards[0].path, shards[0].dtype), shards[0].doc_ends) == want
