"""data.py: packing keeps every token, one separator per document, world-size independent global
batches with disjoint rank slices, reshuffled epochs, exact resume of the loader position."""
import io
import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch

import data
import prepare
from data import DataConfig, DataError, PackedCorpus
from data_pipeline import filesplit, sources, tokenizer
from data_pipeline.loader import DataState, GlobalBatchLoader
from evaluation import validation


def test_pack_documents_keeps_every_token_and_one_separator_per_document():
    docs = [[5, 6, 7], [8], [9, 10, 11, 12]]
    stream = prepare.pack_documents(docs, eot_id=2)
    assert stream.tolist() == [5, 6, 7, 2, 8, 2, 9, 10, 11, 12, 2]
    assert (stream == 2).sum() == len(docs)


def test_windows_cover_the_stream_without_padding():
    stream = np.arange(23, dtype=np.uint32)
    seq_len = 5
    n = data.num_windows(stream.size, seq_len)
    assert n == 4  # (23 - 1) // 5: only the last 2 tokens (< seq_len) are left out
    inputs = np.concatenate([data.window(stream, i, seq_len)[:-1] for i in range(n)])
    labels = np.concatenate([data.window(stream, i, seq_len)[1:] for i in range(n)])
    assert inputs.tolist() == list(range(n * seq_len))  # every token, once, in order
    assert labels.tolist() == list(range(1, n * seq_len + 1))
    assert all(data.window(stream, i, seq_len).size == seq_len + 1 for i in range(n))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = [f"document {i}: " + " ".join(f"word{j % 37}" for j in range(40 + 7 * i)) for i in range(60)]
    texts[3] = ""  # an empty document: skipped, and no separator for it
    for i, t in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_text(t)
    out = tmp_path_factory.mktemp("prepared")
    cfg = DataConfig(dataset=str(root / "*.txt"), tokenizer_vocab_size=300, seq_len=16, val_fraction=0.1)
    meta = prepare.prepare(cfg, str(out))
    return cfg, str(out), meta, texts


def source_file(out, name="default") -> str:
    """Path of a prepared source's token file."""
    return os.path.join(str(out), data.read_meta(str(out))["sources"][name]["file"])


def source_tokens(out, name="default") -> np.ndarray:
    """A prepared source's token stream, in the dtype meta.json records."""
    return np.fromfile(source_file(out, name), dtype=data.read_meta(str(out))["sources"][name]["dtype"])


def test_prepared_corpus_counts_one_eot_per_nonempty_document_and_round_trips(corpus_dir):
    cfg, out, meta, texts = corpus_dir
    tok = tokenizer.load_tokenizer(os.path.join(out, "tokenizer.json"))
    tokens = source_tokens(out)
    assert tokens.dtype == np.uint16  # 300 ids fit
    eot = tok.token_to_id("[EOT]")
    nonempty = [t for t in sorted(texts, key=lambda t: t) if t]
    assert meta["n_documents"] == len(nonempty) == (tokens == eot).sum()
    # Splitting at EOT gives back the documents' text exactly, in file order.
    pieces, cur = [], []
    for t in tokens.tolist():
        if t == eot:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    files = sorted(os.listdir(os.path.dirname(cfg.dataset.replace("*.txt", "x"))))
    expected = [texts[int(f[3:6])] for f in files if texts[int(f[3:6])]]
    assert pieces == expected
    assert meta["n_tokens"] == tokens.size


def _loader(corpus, dp_rank, dp_size, gbs=12, micro=None, state=None):
    return GlobalBatchLoader(corpus, gbs, micro or gbs // dp_size, dp_rank, dp_size, seed=0, state=state)


def test_global_batch_is_the_same_at_world_size_1_2_4_and_rank_slices_are_disjoint(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    steps = 5
    single = _loader(corpus, 0, 1)
    ref = [torch.cat([x for x, _ in single.next_step()]) for _ in range(steps)]
    for world in (2, 4):
        loaders = [_loader(corpus, r, world, micro=1) for r in range(world)]
        for s in range(steps):
            indices = [i for ld in loaders for i in ld.rank_indices()]
            assert len(set(indices)) == len(indices) == 12  # disjoint slices that cover the batch
            per_rank = [torch.cat([x for x, _ in ld.next_step()]) for ld in loaders]
            assert torch.equal(torch.cat(per_rank), ref[s])


def test_labels_are_inputs_shifted_by_one(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    (x, y), = _loader(corpus, 0, 1).next_step()
    assert x.shape == y.shape == (12, cfg.seq_len) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_epochs_are_permutations_and_reshuffle(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    ld = _loader(corpus, 0, 1)
    n = corpus.n_train
    first = [ld._index(0, g) for g in range(n)]
    second = [ld._index(0, g) for g in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second


def test_loader_resumes_from_its_state_exactly(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    ld = _loader(corpus, 1, 2)
    for _ in range(3):
        ld.next_step()
    resumed = _loader(corpus, 1, 2, state=DataState(consumed_samples=ld.state.consumed_samples))
    for _ in range(4):  # crosses an epoch boundary with 12-sample batches
        a, b = ld.next_step(), resumed.next_step()
        assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def test_validation_windows_are_held_out_from_training(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    assert corpus.n_val >= 1
    train_starts = {i * cfg.seq_len for i in range(corpus.n_train)}
    val_starts = {(corpus.n_train + i) * cfg.seq_len for i in range(corpus.n_val)}
    assert not train_starts & val_starts
    (first,), (second,) = [validation.val_batches(corpus, 100, 1, r, 2) for r in range(2)]
    assert first.n_forward == second.n_forward  # equal forward passes on every rank


def test_indivisible_batch_and_too_small_corpus_are_rejected(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    with pytest.raises(DataError, match="global_batch_size"):
        GlobalBatchLoader(corpus, 10, 3, 0, 2, seed=0)
    with pytest.raises(DataError, match="but one global batch of .* draws up to"):
        GlobalBatchLoader(corpus, 4096, 4096, 0, 1, seed=0)


def test_missing_and_empty_sources_fail_with_the_field(tmp_path):
    with pytest.raises(DataError, match="data.dataset: no file matches"):
        list(sources.iter_documents(DataConfig(dataset=str(tmp_path / "nope" / "*.txt")).source_list()[0]))
    (tmp_path / "empty.txt").write_text("   \n")
    tokenizer.train_tokenizer(["hello world"], 300, 1000).save(str(tmp_path / "tok.json"))
    cfg = DataConfig(dataset=str(tmp_path / "empty.txt"), tokenizer=str(tmp_path / "tok.json"))
    with pytest.raises(DataError, match="no non-empty document"):
        prepare.prepare(cfg, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["empty.txt", "tok.json"]  # neither out nor out.tmp is left


def test_jsonl_source_reads_the_text_column_and_reports_a_missing_one(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"text {i}"}) for i in range(3)))
    docs = list(sources.iter_documents(DataConfig(dataset=str(path), text_column="body").source_list()[0]))
    assert docs == ["text 0", "text 1", "text 2"]
    with pytest.raises(DataError, match="data.text_column"):
        list(sources.iter_documents(DataConfig(dataset=str(path)).source_list()[0]))


def test_stdlib_default_corpus_exists_offline():
    files = sources.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)


def test_prepare_and_tokenizer_commands(tmp_path, capsys):
    from launch import DEBUG

    assert prepare.main(["prepare", "--config", DEBUG, "--run_dir", str(tmp_path), "--data.max_documents", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    meta = json.loads(lines[-1])
    assert meta["n_documents"] == 20 and os.path.getsize(source_file(tmp_path / "data")) == 2 * meta["n_tokens"]
    # Progress on the way: the tokenizer, then rank 0's units, documents, tokens and tokens/s.
    assert any(line.startswith("[data] training a byte-level BPE tokenizer of 4096 tokens") for line in lines)
    assert any(line.startswith(f"[data] rank 0: 1/1 units, 20 documents, {meta['n_tokens']:,} tokens, ")
               for line in lines), lines
    out = tmp_path / "tok.json"
    assert prepare.main(["tokenizer", "--config", DEBUG, f"--out={out}", "--data.max_documents", "5",
                         "--data.tokenizer_vocab_size", "400"]) == 0
    assert tokenizer.load_tokenizer(str(out)).get_vocab_size() == 400
    before = out.read_bytes()
    capsys.readouterr()
    assert prepare.main(["tokenizer", "--config", DEBUG, "--out", str(out)]) == 2  # never overwritten
    assert out.read_bytes() == before and "exists" in capsys.readouterr().err
    assert prepare.main(["tokenizer", "--config", DEBUG]) == 2
    assert prepare.main(["--run_dir", str(tmp_path / "other")]) == 2 and not (tmp_path / "other").exists()
    assert "--config FILE.toml is required" in capsys.readouterr().err


def _threads_gather(world):
    """all_gather functions for `world` threads that stand in for ranks (same contract as gloo's)."""
    barrier, slots = threading.Barrier(world, timeout=60), [None] * world

    def make(rank):
        def all_gather(obj):
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()  # nobody overwrites a slot before everyone has read it
            return out
        return all_gather
    return [make(r) for r in range(world)]


def _prepare_on_ranks(cfg, out, world):
    """data.prepare on `world` threads as ranks; returns each rank's meta or DataError."""
    gathers, results = _threads_gather(world), [None] * world

    def rank_main(rank):
        try:
            results[rank] = prepare.prepare(cfg, out, rank, world, gathers[rank])
        except DataError as e:
            results[rank] = e
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("source", ["txt", "jsonl", "max_documents"])
def test_tokenizing_on_3_ranks_writes_the_stream_of_1_rank_byte_for_byte(tmp_path, monkeypatch, source):
    monkeypatch.setattr(sources, "FILES_PER_UNIT", 4)  # several units per rank, some ranks with more than others
    monkeypatch.setattr(prepare, "DOCS_PER_UNIT", 5)
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"doc {i} " + "lorem ipsum dolor " * (i % 7) for i in range(37)]
    if source == "jsonl":
        for f in range(7):
            (src / f"part{f}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[f::7]))
    else:
        for i, t in enumerate(texts):
            (src / f"d{i:02d}.txt").write_text(t)
    tokenizer.train_tokenizer(texts, 300, 10**6).save(str(tmp_path / "tok.json"))
    cfg = DataConfig(dataset=str(src), tokenizer=str(tmp_path / "tok.json"),
                     max_documents=23 if source == "max_documents" else 0)
    ref = prepare.prepare(cfg, str(tmp_path / "one"))
    metas = _prepare_on_ranks(cfg, str(tmp_path / "three"), 3)
    assert all(m == {**ref, "tokenizer": str(tmp_path / "three" / "tokenizer.json")} for m in metas)
    assert ref["sources"]["default"]["work_units"] > 3 and ref["n_documents"] == (23 if source == "max_documents" else 37)
    one, three = [open(source_file(tmp_path / d), "rb").read() for d in ("one", "three")]
    assert one == three
    assert sorted(os.listdir(tmp_path / "three")) == ["meta.json", "sources", "tokenizer.json"]


def test_bad_input_found_by_one_rank_fails_every_rank_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "FILES_PER_UNIT", 2)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"d{i}.txt").write_text(f"document {i}")
    (src / "d5.txt").write_bytes(b"caf\xe9")  # in unit 2, which rank 2 of 3 reads
    tokenizer.train_tokenizer(["document"], 300, 10**6).save(str(tmp_path / "tok.json"))
    cfg = DataConfig(dataset=str(src), tokenizer=str(tmp_path / "tok.json"))
    results = _prepare_on_ranks(cfg, str(tmp_path / "out"), 3)
    assert all(isinstance(r, DataError) and "d5.txt' is not valid UTF-8" in str(r) for r in results)
    assert sorted(os.listdir(tmp_path)) == ["src", "tok.json"]


@pytest.mark.slow
def test_prepare_under_torchrun_equals_one_process(tmp_path):
    from launch import DEBUG, torchrun

    args = ["prepare", "--config", DEBUG, "--data.max_documents", "40"]
    assert prepare.main(args + ["--run_dir", str(tmp_path / "one")]) == 0
    torchrun(2, "prepare.py", *args, "--run_dir", str(tmp_path / "two"))
    for name in (os.path.relpath(source_file(tmp_path / "one" / "data"), tmp_path / "one" / "data"), "tokenizer.json"):
        assert (tmp_path / "one" / "data" / name).read_bytes() == (tmp_path / "two" / "data" / name).read_bytes()


def test_a_damaged_data_directory_is_named_with_the_fix(corpus_dir, tmp_path):
    cfg, prepared, _, _ = corpus_dir
    tokens = os.path.relpath(source_file(prepared), prepared)
    for i, (name, damage) in enumerate([("meta.json", b"\xff\xfe"), ("meta.json", b"{}"),
                                        (tokens, b"\x00" * 1001), (tokens, b"")]):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(prepared, bad)
        (bad / name).write_bytes(damage)
        with pytest.raises(DataError, match="the data directory is damaged: move .* away and run again"):
            PackedCorpus(str(bad), cfg)


def _datasets_documents(kind: str, path: str, **kwargs) -> list[str]:
    """The reference: the documents datasets' own builder reads from one file (the one-unit reading)."""
    import datasets

    rows = datasets.load_dataset(kind, data_files=[path], split="train", streaming=True, **kwargs)
    return [r["text"] for r in rows if r["text"]]


def _mixed_rows(n=300):
    words = ["alpha", "béta", "γάμμα", "日本", "x" * 60, "a\\nb", "tab\there", "[EOT]"]
    rows = [{"text": " ".join(words[(i * j) % len(words)] for j in range(i % 50)), "id": i} for i in range(n)]
    rows[7] = {"id": 7}  # no text column: no document
    rows[9]["text"] = None
    return rows


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" + ("\n" if i % 40 == 0 else ""))
    return str(path)


def _write_parquet(path, rows, row_group_size=25):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": r.get("text"), "id": r["id"]} for r in rows]), str(path),
                   row_group_size=row_group_size)
    return str(path)


def _lines_text(n=500):
    """Lines, empty lines and whitespace-only ones, '\\n' and '\\r\\n' endings."""
    out = []
    for i in range(n):
        line = "" if i % 9 == 0 else ("  \t" if i % 13 == 0 else f"line {i} " + "wörd " * (i % 11))
        out.append(line + ("\r\n" if i % 7 == 0 else "\n"))
    return "".join(out)


def test_the_units_of_one_file_read_exactly_its_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(filesplit, "UNIT_BYTES", 700)
    monkeypatch.setattr(filesplit, "CHUNK_BYTES", 300)
    rows = _mixed_rows()
    cases = {"jsonl": (_write_jsonl(tmp_path / "a.jsonl", rows), {}, ("json", {})),
             "parquet": (_write_parquet(tmp_path / "b.parquet", rows), {}, ("parquet", {}))}
    (tmp_path / "c.txt").write_bytes(_lines_text().encode())
    no_blank_spaces = "".join(line for line in _lines_text().splitlines(keepends=True) if line.strip() or line in "\r\n")
    (tmp_path / "d.txt").write_bytes(no_blank_spaces.encode())
    cases["txt line"] = (str(tmp_path / "c.txt"), {"txt_documents": "line"}, ("text", {"sample_by": "line"}))
    # Without whitespace-only lines, the paragraphs are datasets' own (split at "\n\n").
    cases["txt blank_line"] = (str(tmp_path / "d.txt"), {"txt_documents": "blank_line"},
                               ("text", {"sample_by": "paragraph"}))
    for name, (path, fields, (kind, kwargs)) in cases.items():
        units = sources.source_units(DataConfig(dataset=path, **fields).source_list()[0])
        docs = [d for unit in units for d in unit()]
        assert len(units) > 3, name
        assert docs == _datasets_documents(kind, path, **kwargs), name
    # Whitespace-only lines are blank lines too: paragraphs as if they were empty.
    src = DataConfig(dataset=str(tmp_path / "c.txt"), txt_documents="blank_line").source_list()[0]
    docs = [d for unit in sources.source_units(src) for d in unit()]
    norm = "\n".join(line if line.strip() else "" for line in _lines_text().replace("\r\n", "\n").split("\n"))
    assert docs == [p for p in norm.split("\n\n") if p]


def test_whitespace_only_lines_separate_paragraphs_and_a_big_txt_document_is_noticed(tmp_path, capsys):
    # WikiText-103's layout: the lines between paragraphs hold one space.
    wiki = " \n = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles . \n \n" \
           " = = Gameplay = = \n \n As with previous games . \n"
    (tmp_path / "wiki.txt").write_text(wiki)
    src = DataConfig(dataset=str(tmp_path / "wiki.txt"), txt_documents="blank_line").source_list()[0]
    assert list(sources.iter_documents(src)) == [
        "\n = Valkyria Chronicles III = ", " Senjō no Valkyria 3 : Unrecorded Chronicles . ", " = = Gameplay = = ",
        " As with previous games . \n"]
    big = tmp_path / "big" / "train.txt"
    big.parent.mkdir()
    big.write_text((wiki * 12000)[:2 ** 20 + 10])
    tokenizer.train_tokenizer([wiki], 300, 10 ** 6).save(str(tmp_path / "tok.json"))
    prepare.prepare(DataConfig(dataset=str(big), tokenizer=str(tmp_path / "tok.json")), str(tmp_path / "out"))
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[data] notice:")]
    assert notices == [f"[data] notice: source 'default' reads '{big}' (1.0 MiB) as one document "
                       f"(data.txt_documents = \"file\"); set data.txt_documents = \"blank_line\" (paragraphs) or "
                       f"\"line\" to split it into documents"]
    prepare.prepare(DataConfig(dataset=str(big), tokenizer=str(tmp_path / "tok.json"), txt_documents="line"),
                    str(tmp_path / "out2"))
    assert "notice" not in capsys.readouterr().out


def test_a_small_txt_file_read_whole_is_noticed_with_the_field_that_splits_it(tmp_path, capsys):
    # A few hundred bytes, far under the 1 MiB that once earned the notice: one document all the same.
    text = "First paragraph, line one.\nLine two.\n\nSecond paragraph.\n"
    (tmp_path / "small.txt").write_text(text)
    tokenizer.train_tokenizer([text], 300, 10 ** 6).save(str(tmp_path / "tok.json"))
    prepare.prepare(DataConfig(dataset=str(tmp_path / "small.txt"), tokenizer=str(tmp_path / "tok.json")),
                    str(tmp_path / "out"))
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[data] notice:")]
    assert notices == [f"[data] notice: source 'default' reads '{tmp_path / 'small.txt'}' ({len(text)} bytes) as one "
                       f"document (data.txt_documents = \"file\"); set data.txt_documents = \"blank_line\" "
                       f"(paragraphs) or \"line\" to split it into documents"]
    # A folder of text files: one line for the source, naming how many.
    (tmp_path / "many").mkdir()
    for i in range(3):
        (tmp_path / "many" / f"{i}.txt").write_text(text)
    prepare.prepare(DataConfig(dataset=str(tmp_path / "many"), tokenizer=str(tmp_path / "tok.json")),
                    str(tmp_path / "out2"))
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[data] notice:")]
    assert notices == ["[data] notice: source 'default' reads each of its 3 text files as one document "
                       "(data.txt_documents = \"file\"); set data.txt_documents = \"blank_line\" (paragraphs) or "
                       "\"line\" to split them into documents"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_one_file_is_tokenized_by_every_rank_into_the_stream_of_its_one_unit_reading(tmp_path, monkeypatch, kind):
    rows = _mixed_rows()
    path = {"jsonl": lambda: _write_jsonl(tmp_path / "a.jsonl", rows),
            "parquet": lambda: _write_parquet(tmp_path / "a.parquet", rows),
            "txt": lambda: (tmp_path / "a.txt").write_bytes(_lines_text().encode()) and str(tmp_path / "a.txt")}[kind]()
    texts = [r["text"] for r in rows if r.get("text")]
    tokenizer.train_tokenizer(texts, 300, 10 ** 6).save(str(tmp_path / "tok.json"))
    tok = tokenizer.load_tokenizer(str(tmp_path / "tok.json"))
    cfg = DataConfig(dataset=path, tokenizer=str(tmp_path / "tok.json"), txt_documents="line")
    reference = io.BytesIO()  # what one unit read by datasets (the code before units per file) packs
    ref_docs = _datasets_documents({"jsonl": "json", "parquet": "parquet", "txt": "text"}[kind], path)
    prepare.tokenize_documents(ref_docs, tok, reference, "uint16")
    monkeypatch.setattr(filesplit, "UNIT_BYTES", 1000)
    metas = _prepare_on_ranks(cfg, str(tmp_path / "three"), 3)
    assert not any(isinstance(m, Exception) for m in metas), metas
    assert metas[0]["sources"]["default"]["work_units"] > 3
    assert open(source_file(tmp_path / "three"), "rb").read() == reference.getvalue()


@pytest.mark.slow
def test_one_big_file_on_2_ranks_equals_one_process_and_its_one_unit_reading(tmp_path, monkeypatch):
    from launch import DEBUG
    from ranks import run_ranks

    rows = _mixed_rows(2000)
    texts = [r["text"] for r in rows if r.get("text")]
    tokenizer.train_tokenizer(texts, 300, 10 ** 6).save(str(tmp_path / "tok.json"))
    tok = tokenizer.load_tokenizer(str(tmp_path / "tok.json"))
    for kind, path in (("json", _write_jsonl(tmp_path / "a.jsonl", rows)),
                       ("parquet", _write_parquet(tmp_path / "a.parquet", rows, row_group_size=100))):
        reference = io.BytesIO()
        prepare.tokenize_documents(_datasets_documents(kind, path), tok, reference, "uint16")
        streams = []
        for nproc in (1, 2):
            rd = tmp_path / f"{kind}{nproc}"
            args = ["--config", DEBUG, "--run_dir", str(rd), "--data.dataset", path, "--data.tokenizer",
                    str(tmp_path / "tok.json"), "--data.max_documents", "0"]
            if nproc == 1:  # one process: prepare.py's command in this one, as small_units_prepare.py runs it
                with monkeypatch.context() as m:
                    m.setattr(filesplit, "UNIT_BYTES", 20000)
                    assert prepare.main(args) == 0
            else:
                run_ranks(nproc, "small_units_prepare", "--unit_bytes", "20000", *args, timeout=240)
            assert data.read_meta(str(rd / "data"))["sources"]["default"]["work_units"] >= 4
            streams.append(open(source_file(rd / "data"), "rb").read())
        assert streams[0] == streams[1] == reference.getvalue(), kind


PARAGRAPH = "the quick brown fox jumps over the lazy dog while the cat sleeps on a mat by the door\n\n"


def test_a_blank_txt_is_refused_before_a_tokenizer_is_trained(tmp_path, monkeypatch):
    def trained(*args, **kwargs):
        raise AssertionError("a tokenizer was trained on a blank source")

    monkeypatch.setattr(prepare, "train_tokenizer", trained)
    for i, text in enumerate(["", " \n\n\t\n"]):
        src = tmp_path / f"blank{i}.txt"
        src.write_text(text)
        cfg = DataConfig(dataset=str(src), tokenizer_vocab_size=300, seq_len=16)
        with pytest.raises(DataError, match=f"data.dataset: '{src}' holds no non-empty document .* empty or whitespace"):
            prepare.prepare(cfg, str(tmp_path / f"data{i}"))
        assert not (tmp_path / f"data{i}").exists() and not (tmp_path / f"data{i}.tmp").exists()


def test_a_source_that_grew_after_preparation_is_named_and_moved_away_is_tokenized_anew(tmp_path, capsys):
    """'move DIR away and run again', as printed: the same tokens as a fresh preparation of the grown file."""
    txt = tmp_path / "notes.txt"
    txt.write_text(PARAGRAPH * 14)
    cfg = DataConfig(dataset=str(txt), txt_documents="blank_line", tokenizer_vocab_size=300, seq_len=16,
                     val_fraction=0.1, max_documents=400)
    out = str(tmp_path / "data")
    first = prepare.prepare(cfg, out)
    assert "all its 14 documents (fewer than data.max_documents 400)" in capsys.readouterr().out
    assert prepare.prepare(cfg, out)["n_tokens"] == first["n_tokens"]  # unchanged: reused
    txt.write_text(PARAGRAPH * 40)
    with pytest.raises(DataError, match=f"changed since it was tokenized into '{out}' \\(1 file, .* move '{out}' "
                                        "away and run again"):
        prepare.prepare(cfg, out)
    shutil.move(out, str(tmp_path / "stale"))
    again, fresh = prepare.prepare(cfg, out), prepare.prepare(cfg, str(tmp_path / "fresh"))
    assert again["n_documents"] == fresh["n_documents"] == 40 and again["n_tokens"] == fresh["n_tokens"]
    assert np.array_equal(np.fromfile(prepare_file(out), dtype=np.uint16),
                          np.fromfile(prepare_file(str(tmp_path / "fresh")), dtype=np.uint16))


def prepare_file(out: str) -> str:
    """The one source's token file of a prepared directory."""
    meta = data.read_meta(out)
    return os.path.join(out, next(iter(meta["sources"].values()))["file"])
