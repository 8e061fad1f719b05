"""data.py: packing keeps every token, one separator per document, world-size independent global
batches with disjoint rank slices, reshuffled epochs, exact resume of the loader position."""
import json
import os

import numpy as np
import pytest
import torch

import data
from data import DataConfig, DataError, DataState, GlobalBatchLoader, PackedCorpus


def test_pack_documents_keeps_every_token_and_one_separator_per_document():
    docs = [[5, 6, 7], [8], [9, 10, 11, 12]]
    stream = data.pack_documents(docs, eot_id=2)
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
    meta = data.prepare(cfg, str(out))
    return cfg, str(out), meta, texts


def test_prepared_corpus_counts_one_eot_per_nonempty_document_and_round_trips(corpus_dir):
    cfg, out, meta, texts = corpus_dir
    tok = data.load_tokenizer(os.path.join(out, "tokenizer.json"))
    tokens = np.fromfile(os.path.join(out, "tokens.bin"), dtype=np.uint32)
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
    first = [ld._index(g) for g in range(n)]
    second = [ld._index(g) for g in range(n, 2 * n)]
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
    batches = [data.val_batches(corpus, 100, 1, r, 2) for r in range(2)]
    assert len(batches[0]) == len(batches[1])  # equal forward passes on every rank


def test_indivisible_batch_and_too_small_corpus_are_rejected(corpus_dir):
    cfg, out, _, _ = corpus_dir
    corpus = PackedCorpus(out, cfg)
    with pytest.raises(DataError, match="global_batch_size"):
        GlobalBatchLoader(corpus, 10, 3, 0, 2, seed=0)
    with pytest.raises(DataError, match="fewer than"):
        GlobalBatchLoader(corpus, 4096, 4096, 0, 1, seed=0)


def test_missing_and_empty_sources_fail_with_the_field(tmp_path):
    with pytest.raises(DataError, match="data.dataset: no file matches"):
        list(data.iter_documents(DataConfig(dataset=str(tmp_path / "nope" / "*.txt"))))
    (tmp_path / "empty.txt").write_text("   \n")
    cfg = DataConfig(dataset=str(tmp_path / "empty.txt"))
    tok = data.train_tokenizer(["hello world"], 300, 1000)
    with pytest.raises(DataError, match="no non-empty document"):
        data.tokenize_corpus(cfg, tok)


def test_jsonl_source_reads_the_text_column_and_reports_a_missing_one(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"text {i}"}) for i in range(3)))
    docs = list(data.iter_documents(DataConfig(dataset=str(path), text_column="body")))
    assert docs == ["text 0", "text 1", "text 2"]
    with pytest.raises(DataError, match="data.text_column"):
        list(data.iter_documents(DataConfig(dataset=str(path))))


def test_stdlib_default_corpus_exists_offline():
    files = data.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)


def test_prepare_and_tokenizer_commands(tmp_path, capsys):
    from launch import DEBUG

    assert data.main(["prepare", "--config", DEBUG, "--run_dir", str(tmp_path), "--data.max_documents", "20"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["n_documents"] == 20 and (tmp_path / "data" / "tokens.bin").stat().st_size == 4 * meta["n_tokens"]
    out = tmp_path / "tok.json"
    assert data.main(["tokenizer", "--config", DEBUG, "--out", str(out), "--data.max_documents", "5",
                      "--data.tokenizer_vocab_size", "400"]) == 0
    assert data.load_tokenizer(str(out)).get_vocab_size() == 400
    assert data.main(["tokenizer", "--config", DEBUG]) == 2
