"""Data mixtures: largest-remainder counts, the same global batches at any world size across a
stage change, per-source epochs, exact resume from the state alone, per-source preparation that
re-uses what is prepared, plain-text encoding of special-token strings, compressed inputs, bad input."""
import argparse
import copy
import dataclasses
import gzip
import importlib.util
import json
import os
import re
import shutil
import time

import numpy as np
import pytest
import torch

import data
import evaluate
import prepare
from checkpoint import AppState
from config import parse_config
from core.cli import to_toml
from core.errors import ConfigError, MissingPackageError
from data import DataConfig, DataError, PackedCorpus, SourceConfig, StageConfig
from data_pipeline import mixture, sources, tokenizer
from data_pipeline.loader import DataState, GlobalBatchLoader
from evaluation import validation
from launch import (
    DEBUG,
    evaluate_in_process,
    losses,
    metrics,
    prepared_data_dir,
    refused,
    run,
    start,
)
from training import command
from training.session import build
from training.step import train_step

WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def _texts(tag: str, n: int) -> list[str]:
    return [f"{tag} document {i}: " + " ".join(f"{tag}{j % 11}" for j in range(30 + 5 * (i % 9))) for i in range(n)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    tokenizer.train_tokenizer(_texts("a", 20) + _texts("b", 20) + _texts("c", 20), 300, 10**6).save(str(root / "t.json"))
    return str(root / "t.json")


def _jsonl(path, texts, column="text"):
    path.write_text("".join(json.dumps({column: t}) + "\n" for t in texts))
    return str(path)


def _mixture_cfg(tmp, tok, stages=(), seq_len=8, **weights) -> DataConfig:
    sizes = {"a": 60, "b": 25, "c": 8}  # c is small: it runs through several epochs
    srcs = [SourceConfig(name=n, dataset=_jsonl(tmp / f"{n}.jsonl", _texts(n, sizes[n])), weight=w)
            for n, w in (weights or WEIGHTS).items()]
    return DataConfig(tokenizer=tok, seq_len=seq_len, val_fraction=0.1, sources=srcs,
                      stages=[StageConfig(s, w) for s, w in stages])


@pytest.fixture(scope="module")
def three(tmp_path_factory, tok_path):
    """A prepared 3-source mixture whose weights change after 7 steps."""
    tmp = tmp_path_factory.mktemp("three")
    cfg = _mixture_cfg(tmp, tok_path, stages=[(7, {"a": 0.1, "c": 0.9})])
    prepare.prepare(cfg, str(tmp / "data"))
    return cfg, PackedCorpus(str(tmp / "data"), cfg)


def test_batch_counts_against_hand_counts():
    # Offsets u = k * 0.618... mod 1: 0, 0.618, 0.236, 0.854 for k = 0..3.
    assert all(mixture.batch_counts(16, [0.75, 0.25], k) == [12, 4] for k in range(5))  # whole quotas
    # Quotas 3.33 each: the extra unit goes to the remainder interval ([0,1/3), [1/3,2/3), [2/3,1)) holding u.
    assert [mixture.batch_counts(10, [1, 1, 1], k) for k in range(4)] == [[4, 3, 3], [3, 4, 3], [4, 3, 3], [3, 3, 4]]
    # Quotas 3.5, 2.1, 1.4: remainders [0, .5), [.5, .6), [.6, 1).
    assert [mixture.batch_counts(7, [0.5, 0.3, 0.2], k) for k in range(2)] == [[4, 2, 1], [3, 2, 2]]
    assert mixture.batch_counts(5, [0, 2, 0], 3) == [0, 5, 0]
    # Quotas 0.3 each, 3 units left: points 0, 1, 2 fall in the remainders of sources 0, 3 and 6.
    assert mixture.batch_counts(3, [0.1] * 10, 0) == [1, 0, 0, 1, 0, 0, 1, 0, 0, 0]
    assert mixture.most_per_batch(16, [0.3, 0.7]) == [5, 12]


def test_shares_over_many_batches_converge_to_the_weights():
    """Per batch within one sample of B * w; in total within 2 (largest remainder alone: 5 of 16 every batch)."""
    totals = np.zeros(2)
    for k in range(400):
        counts = mixture.batch_counts(16, [0.3, 0.7], k)
        assert sum(counts) == 16 and abs(counts[0] - 4.8) < 1
        totals += counts
    assert np.all(np.abs(totals - [0.3 * 16 * 400, 0.7 * 16 * 400]) <= 2), totals


def test_realised_counts_of_50_batches_follow_the_weights(three):
    cfg, corpus = three
    ld = GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=3)
    for step in range(50):
        weights = WEIGHTS if step < 7 else {"a": 0.1, "b": 0.0, "c": 0.9}
        counts = np.bincount([s for s, _ in ld.rank_indices()], minlength=3)
        want = np.array([12 * weights[n] / sum(weights.values()) for n in corpus.names])
        assert counts.sum() == 12 and np.all(np.abs(counts - want) < 1), (step, counts, want)
        ld.next_step()
    seen = {n: ld.state.source_samples[n] for n in corpus.names}
    ideal = {"a": 7 * 6 + 43 * 1.2, "b": 7 * 3.6, "c": 7 * 2.4 + 43 * 10.8}
    assert all(abs(seen[n] - ideal[n]) <= 2 for n in ideal), (seen, ideal)
    assert ld.source_tokens() == {f"tokens/{n}": k * cfg.seq_len for n, k in seen.items()}


def _step_windows(ld) -> torch.Tensor:
    return torch.cat([x for x, _ in ld.next_step()])


def test_the_same_global_batches_at_1_2_and_3_ranks_across_a_stage_change(three):
    _, corpus = three
    ref_ld = GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=0)
    ref = [_step_windows(ref_ld) for _ in range(20)]
    for world, micro in ((2, 3), (3, 2)):
        loaders = [GlobalBatchLoader(corpus, 12, micro, r, world, seed=0) for r in range(world)]
        for step in range(20):
            pairs = [p for ld in loaders for p in ld.rank_indices()]
            assert len(pairs) == 12
            assert torch.equal(torch.cat([_step_windows(ld) for ld in loaders]), ref[step]), (world, step)
    # The sources are mixed inside the batch, not laid out source by source.
    order = [s for s, _ in GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=0).rank_indices()]
    assert order != sorted(order)


def test_resume_from_the_state_alone_at_another_world_size_and_batch_size(three):
    _, corpus = three
    ref_ld = GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=0)
    ref = [_step_windows(ref_ld) for _ in range(14)]
    for stop in (6, 7, 8):  # just before, at and just after the stage change (after 7 steps)
        ld = GlobalBatchLoader(corpus, 12, 6, 1, 2, seed=0)
        for _ in range(stop):
            ld.next_step()
        saved = copy.deepcopy(ld.state)
        resumed = [GlobalBatchLoader(corpus, 12, 4, r, 3, seed=0, state=copy.deepcopy(saved)) for r in range(3)]
        for step in range(stop, 14):
            assert torch.equal(torch.cat([_step_windows(x) for x in resumed]), ref[step]), (stop, step)
    # Another global batch size on resume: every source continues from its own position.
    ld = GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=0)
    for _ in range(3):
        ld.next_step()
    bigger = GlobalBatchLoader(corpus, 24, 24, 0, 1, seed=0, state=copy.deepcopy(ld.state))
    firsts = {n: bigger.state.source_samples[n] for n in corpus.names}
    pairs = bigger.rank_indices()
    counts = bigger.counts()
    for s, n in enumerate(corpus.names):
        want = [bigger._index(s, g) for g in range(firsts[n], firsts[n] + counts[s])]
        assert sorted(i for t, i in pairs if t == s) == sorted(want)


def test_skipped_batches_leave_the_stream_of_the_others_at_1_2_and_4_ranks(three):
    """[[train.skip]] across a batch stage (after 4 steps) and the data stage (after 7): the batches drawn are the
    uninterrupted run's with the skipped ones taken out, at every world size, and a resume from the state alone
    (with a rollback's skip in it) continues the same stream."""
    _, corpus = three
    stages = [(4, 24)]
    ref_ld = GlobalBatchLoader(corpus, 12, 0, 0, 1, seed=0, batch_stages=stages)
    ref = [_step_windows(ref_ld) for _ in range(16)]  # ref[k - 1]: the batch of data step k
    skips = [(3, 5), (9, 9)]
    kept = [ref[k - 1] for k in range(1, 17) if not any(a <= k <= b for a, b in skips)]
    for world in (1, 2, 4):
        loaders = [GlobalBatchLoader(corpus, 12, 0, r, world, seed=0, batch_stages=stages, skips=skips)
                   for r in range(world)]
        got = [torch.cat([_step_windows(ld) for ld in loaders]) for _ in range(len(kept))]
        assert all(torch.equal(a, b) for a, b in zip(got, kept)), world
    ld = GlobalBatchLoader(corpus, 12, 0, 0, 1, seed=0, batch_stages=stages, skips=[(3, 5)])
    for _ in range(4):  # data steps 1, 2, 6, 7
        ld.next_step()
    saved = copy.deepcopy(ld.state)
    saved.skips = [[9, 9]]  # as a rollback records it
    resumed = [GlobalBatchLoader(corpus, 12, 0, r, 2, seed=0, batch_stages=stages, skips=[(3, 5)],
                                 state=copy.deepcopy(saved)) for r in range(2)]
    assert resumed[0].next_data_step() == 8
    assert all(torch.equal(torch.cat([_step_windows(x) for x in resumed]), kept[k]) for k in range(4, len(kept)))


def test_each_source_runs_its_own_reshuffled_epochs(three):
    _, corpus = three
    c = corpus.names.index("c")
    n = corpus.sources[c].n_train
    ld = GlobalBatchLoader(corpus, 12, 12, 0, 1, seed=0)
    first = [ld._index(c, g) for g in range(n)]
    second = [ld._index(c, g) for g in range(n, 2 * n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second
    # Its order does not depend on the other sources: the same when it is the only one.
    alone = DataConfig(tokenizer="x", seq_len=8, sources=[SourceConfig(name="c", dataset="stdlib")])
    assert mixture.epoch_permutation(n, 0, "c", 1).tolist() == second
    assert alone.source_list()[0].name == "c"


def test_one_source_draws_the_batches_of_the_loader_before_mixtures(tmp_path, tok_path):
    """Reference: the former rule, samples [k*B, (k+1)*B) of randperm(n_train) seeded with seed + epoch."""
    cfg = DataConfig(dataset=_jsonl(tmp_path / "a.jsonl", _texts("a", 60)), tokenizer=tok_path, seq_len=8)
    prepare.prepare(cfg, str(tmp_path / "data"))
    corpus = PackedCorpus(str(tmp_path / "data"), cfg)
    n = corpus.n_train
    perms = [torch.randperm(n, generator=torch.Generator().manual_seed(5 + e)).tolist() for e in range(3)]
    stream = [i for p in perms for i in p]
    ld = GlobalBatchLoader(corpus, 16, 16, 0, 1, seed=5)
    for k in range(2 * n // 16):
        assert [i for _, i in ld.rank_indices()] == stream[k * 16:(k + 1) * 16]
        ld.next_step()
    # A checkpoint of that code held consumed_samples alone: the loader continues from it.
    old = GlobalBatchLoader(corpus, 16, 8, 1, 2, seed=5, state=DataState(consumed_samples=48))
    assert [i for _, i in old.rank_indices()] == stream[48 + 8:48 + 16]


def test_one_source_jumps_past_skipped_batches_to_the_batches_drawn_one_by_one(tmp_path, tok_path):
    """The one-source loader moves past a skip in one jump per batch stage: the stream is the uninterrupted one's with
    the skipped batches taken out, across a batch stage inside the skip."""
    cfg = DataConfig(dataset=_jsonl(tmp_path / "a.jsonl", _texts("a", 60)), tokenizer=tok_path, seq_len=8)
    prepare.prepare(cfg, str(tmp_path / "data"))
    corpus = PackedCorpus(str(tmp_path / "data"), cfg)
    stages = [(3, 8), (6, 16)]
    ref_ld = GlobalBatchLoader(corpus, 4, 0, 0, 1, seed=0, batch_stages=stages)
    ref = [_step_windows(ref_ld) for _ in range(12)]
    skips = [(2, 7), (10, 10)]
    kept = [ref[k - 1] for k in range(1, 13) if not any(a <= k <= b for a, b in skips)]
    ld = GlobalBatchLoader(corpus, 4, 0, 0, 1, seed=0, batch_stages=stages, skips=skips)
    assert all(torch.equal(_step_windows(ld), want) for want in kept)
    assert ld.state.consumed_samples == ref_ld.state.consumed_samples and ld.state.steps == 12


def test_per_source_preparation_reuses_what_is_prepared(tmp_path, tok_path, capsys):
    cfg = _mixture_cfg(tmp_path, tok_path)
    out = str(tmp_path / "data")
    meta = prepare.prepare(cfg, out)
    files = {n: os.path.join(out, r["file"]) for n, r in meta["sources"].items()}
    stamps = {n: os.stat(f).st_mtime_ns for n, f in files.items()}
    assert {r["dtype"] for r in meta["sources"].values()} == {"uint16"}
    assert all(os.path.getsize(f) == 2 * meta["sources"][n]["n_tokens"] for n, f in files.items())
    # Other weights, a stage, and one more source: only the new source is tokenized.
    more = SourceConfig(name="d", dataset=_jsonl(tmp_path / "d.jsonl", _texts("d", 30)), weight=2)
    again = DataConfig(tokenizer=tok_path, seq_len=8, val_fraction=0.1,
                       sources=[dataclasses.replace(s, weight=1.0) for s in cfg.sources] + [more],
                       stages=[StageConfig(3, {"d": 1.0})])
    capsys.readouterr()
    meta2 = prepare.prepare(again, out)
    said = capsys.readouterr().out
    assert "tokenizing 1 work unit(s) of 'd'" in said and "of 'a'" not in said
    assert {n: os.stat(f).st_mtime_ns for n, f in files.items()} == stamps
    assert set(meta2["sources"]) == {"a", "b", "c", "d"}
    # The same settings under a new name re-use the file; a source's other settings under its name are refused.
    renamed = DataConfig(tokenizer=tok_path, seq_len=8, sources=[dataclasses.replace(cfg.sources[0], name="a2")])
    assert prepare.prepare(renamed, out)["sources"]["a2"]["file"] == meta["sources"]["a"]["file"]
    changed = DataConfig(tokenizer=tok_path, seq_len=8, sources=[dataclasses.replace(cfg.sources[0], max_documents=3)])
    with pytest.raises(DataError, match=r"prepared with other data settings \(data.sources\[a\].max_documents: "
                                        r"0 -> 3\); use a new --run_dir, another source name, or the settings"):
        prepare.prepare(changed, out)


@pytest.mark.parametrize("wx, wy, chars, want_x, want_y", [
    (3, 1, 3000, 2300, 800),
    # 1e308 + 1e307 is finite, but a budget of chars * 1e308 / total overflows before the division.
    (1e308, 1e307, 1100, 1000, 100),
], ids=["3_to_1", "huge_finite"])
def test_a_tokenizer_trained_here_sees_the_sources_by_weight(tmp_path, wx, wy, chars, want_x, want_y):
    cfg = DataConfig(tokenizer_train_chars=chars, sources=[
        SourceConfig(name="x", dataset=_jsonl(tmp_path / "x.jsonl", ["x" * 100] * 100), weight=wx),
        SourceConfig(name="y", dataset=_jsonl(tmp_path / "y.jsonl", ["y" * 100] * 100), weight=wy)])
    texts = list(prepare.tokenizer_texts(cfg))
    assert sum(len(t) for t in texts if t[0] == "x") == want_x and sum(len(t) for t in texts if t[0] == "y") == want_y


def test_special_token_strings_in_text_are_plain_text(tmp_path):
    docs = ["the first document", "a doc that mentions [EOT] and [PAD] in its text"]
    tok = tokenizer.train_tokenizer(docs * 5, 300, 10**6)
    tok.save(str(tmp_path / "tok.json"))
    cfg = DataConfig(dataset=_jsonl(tmp_path / "d.jsonl", docs), tokenizer=str(tmp_path / "tok.json"))
    meta = prepare.prepare(cfg, str(tmp_path / "data"))
    record = meta["sources"]["default"]
    stream = np.fromfile(os.path.join(tmp_path, "data", record["file"]), dtype=record["dtype"])
    special = {name: tok.token_to_id(name) for name in tokenizer.SPECIAL_TOKENS}
    assert (stream == special["[EOT]"]).sum() == 2 and stream[-1] == special["[EOT]"]
    assert (stream == special["[PAD]"]).sum() == 0 and (stream == special["[BOT]"]).sum() == 0
    first_end = int(np.flatnonzero(stream == special["[EOT]"])[0])
    assert tok.decode(stream[first_end + 1:-1].tolist(), skip_special_tokens=False) == docs[1]
    # The same encoder for generation prompts and evaluation on another source.
    assert special["[EOT]"] not in tokenizer.encode_plain(tokenizer.load_tokenizer(str(tmp_path / "tok.json")),
                                                         ["[EOT] [BOT]"])[0]


def test_compressed_inputs_and_txt_document_splitting(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"zipped {i}"}) + "\n" for i in range(3)))
    one = DataConfig(dataset=str(tmp_path / "a.jsonl.gz")).source_list()[0]
    assert list(sources.iter_documents(one)) == ["zipped 0", "zipped 1", "zipped 2"]
    (tmp_path / "txt").mkdir()
    with gzip.open(tmp_path / "txt" / "b.txt.gz", "wt") as f:
        f.write("para one\nstill one\n\npara two\n\n\npara three\n")
    docs = {how: list(sources.iter_documents(
        DataConfig(dataset=str(tmp_path / "txt" / "b.txt.gz"), txt_documents=how).source_list()[0]))
        for how in ("file", "blank_line", "line")}
    assert docs["file"] == ["para one\nstill one\n\npara two\n\n\npara three\n"]
    assert [d.strip() for d in docs["blank_line"] if d.strip()] == ["para one\nstill one", "para two", "para three"]
    assert docs["line"] == ["para one", "still one", "para two", "para three"]
    (tmp_path / "c.txt").write_text("l1\nl2\n")  # uncompressed, split by line
    assert list(sources.iter_documents(DataConfig(dataset=str(tmp_path / "c.txt"), txt_documents="line")
                                       .source_list()[0])) == ["l1", "l2"]
    (tmp_path / "d.jsonl.zst").write_bytes(b"")
    zst = DataConfig(dataset=str(tmp_path / "d.jsonl.zst"))
    if importlib.util.find_spec("zstandard") is None:
        with pytest.raises(MissingPackageError, match=r"data.dataset: '.*d\.jsonl\.zst' \(zstandard-compressed\) needs "
                           r"the Python package 'zstandard', which is not installed: pip install zstandard; or "
                           r"decompress the file$"):
            sources.check_source(zst)
    else:
        sources.check_source(zst)


def test_sources_and_stages_round_trip_through_the_resolved_config(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text(open(DEBUG).read().replace('dataset = "stdlib"\n', "") + (
        '\n[[data.sources]]\nname = "code"\ndataset = "stdlib"\nweight = 0.75\n'
        '\n[[data.sources]]\nname = "docs"\ndataset = "d.jsonl"\ntext_column = "body"\nweight = 0.25\n'
        '\n[[data.stages]]\nstart_step = 5\nweights = { code = 0.25, docs = 0.75 }\n'))
    cfg = parse_config(["--config", str(toml)])
    code, docs = cfg.data.source_list()
    assert (code.max_documents, docs.max_documents, docs.text_column, code.text_column) == (400, 400, "body", "text")
    assert cfg.data.weight_schedule() == [(0, [0.75, 0.25]), (5, [0.25, 0.75])]
    (tmp_path / "resolved.toml").write_text(to_toml(cfg))
    assert parse_config(["--config", str(tmp_path / "resolved.toml")]) == cfg


@pytest.mark.parametrize("tables, msg", [
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\nweight = -1\n', "data.sources[a].weight must be a finite number >= 0"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\nweight = 0\n', "data.sources: every weight is 0"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.sources]]\nname = "a"\ndataset = "x.txt"\n',
     "data.sources: two sources are named 'a'; give each its own name"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.stages]]\nstart_step = 3\nweights = { b = 1 }\n',
     "data.stages[0].weights names 'b', which is not a source (sources: a)"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.stages]]\nstart_step = 3\nweights = { a = 1 }\n'
     '[[data.stages]]\nstart_step = 3\nweights = { a = 2 }\n', "data.stages[1].start_step (3) must be after the previous stage's (3)"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.stages]]\nstart_step = -1\nweights = { a = 1 }\n',
     "data.stages[0].start_step must be >= 0 (optimizer steps before the stage), got -1"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.stages]]\nstart_step = 2\nweights = { a = 0 }\n',
     "data.stages[0].weights: every weight is 0"),
    ('[[data.sources]]\nname = "a b"\ndataset = "stdlib"\n', "data.sources: name 'a b' is not a name"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\nweigth = 1\n', "unknown config key 'data.sources[0].weigth'; did you mean 'data.sources[0].weight'?"),
])
def test_bad_mixtures_are_one_line_errors_naming_the_field(tmp_path, capsys, tables, msg):

    toml = tmp_path / "bad.toml"
    toml.write_text(open(DEBUG).read().replace('dataset = "stdlib"\n', "") + "\n" + tables)
    line = refused(command.main, ["--config", str(toml), "--run_dir", str(tmp_path / "run")], capsys)
    assert msg in line, line
    assert not (tmp_path / "run").exists()


def test_val_loss_of_a_mixture_weighs_each_source_by_its_windows():
    sets = [validation.ValSet("a", [], 30), validation.ValSet("b", [], 10)]
    record = validation.val_record({"a": 2.0, "b": 4.0}, sets)
    assert record["val_loss"] == pytest.approx((2.0 * 30 + 4.0 * 10) / 40) and record["val_loss/b"] == 4.0
    assert validation.val_record({"a": 2.5}, sets[:1]) == {"val_loss": 2.5, "val_ppl": pytest.approx(np.exp(2.5))}


def test_sources_are_tables_of_the_config_file_not_flags():
    with pytest.raises(ConfigError, match=r"data.sources: expected \[\[data.sources\]\] tables in the --config file"):
        parse_config(["--config", DEBUG, "--data.sources", "x"])


def test_a_source_without_documents_and_a_dataset_beside_sources_are_refused(tmp_path, tok_path, capsys):
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    cfg = DataConfig(tokenizer=tok_path, sources=[SourceConfig(name="a", dataset=_jsonl(tmp_path / "a.jsonl", ["x"])),
                                                  SourceConfig(name="e", dataset=str(tmp_path / "empty.jsonl"))])
    with pytest.raises(DataError, match=r"data.sources\[e\].dataset: '.*empty.jsonl' holds no non-empty document; "
                                        r"point it at real text or remove the source"):
        prepare.prepare(cfg, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    with pytest.raises(ConfigError, match="data.dataset .* and \\[\\[data.sources\\]\\] are both set"):
        DataConfig(dataset="x.txt", sources=[SourceConfig(name="a", dataset="stdlib")])


# ---------------------------------------------------------------- whole runs

MIXTURE_RUN = ["--train.steps", "8", "--train.seed", "0", "--checkpoint.interval", "1", "--checkpoint.keep", "0",
               "--train.val_interval", "4", "--data.tokenizer_train_chars", "400000", "--data.max_documents", "100"]


def _mixture_toml(tmp) -> str:
    """configs/debug.toml with two sources (stdlib code .75, jsonl prose .25) and a stage after step 4."""
    docs = _jsonl(tmp / "docs.jsonl", [t * 3 for t in _texts("prose", 300)], column="body")
    path = tmp / "mixture.toml"
    path.write_text(open(DEBUG).read().replace('dataset = "stdlib"\n', "") + (
        '\n[[data.sources]]\nname = "code"\ndataset = "stdlib"\nweight = 0.75\n'
        f'\n[[data.sources]]\nname = "docs"\ndataset = "{docs}"\ntext_column = "body"\nweight = 0.25\n'
        '\n[[data.stages]]\nstart_step = 4\nweights = { code = 0.25, docs = 0.75 }\n'))
    return str(path)


def _killed_after(cfg, rd, nproc, step):
    """Start a run, SIGKILL it and its workers once the checkpoint of `step` is committed."""
    p = start(nproc, "train_fsdp.py", "--config", cfg, "--run_dir", rd, *MIXTURE_RUN,
              log_path=rd.parent / f"{rd.name}.log")
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if os.path.isfile(rd / "checkpoints" / f"step_{step:08d}" / ".metadata"):
            p.kill()
            break
        time.sleep(0.01)
    rc = p.wait(timeout=60)
    time.sleep(0.5)  # the workers' exit releases the run directory's lock
    return rc


@pytest.mark.slow
def test_sigkill_around_a_stage_change_then_resume_at_another_world_size(tmp_path, monkeypatch, capsys):
    cfg = _mixture_toml(tmp_path)
    ref = tmp_path / "ref"
    console = run(2, "train_fsdp.py", "--config", cfg, "--run_dir", str(ref), *MIXTURE_RUN).stdout
    want = losses(ref)
    assert sorted(want) == list(range(1, 9))
    # One run directory, killed twice: on 2 ranks before the stage change (after step 4), resumed on 1 rank across
    # it and killed after it, resumed on 2 ranks to the end. The losses of every step check each resume.
    rd = tmp_path / "killed"
    shutil.copytree(ref / "data", rd / "data")  # prepared once: the runs read the same files
    assert _killed_after(cfg, rd, 2, 3) != 0, "the run finished before it was killed"
    assert _killed_after(cfg, rd, 1, 5) != 0, "the run finished before it was killed"
    before = int(re.search(r"resumed from \S+ at step (\d+)", (tmp_path / "killed.log").read_text()).group(1))
    proc = run(2, "train_fsdp.py", "--config", cfg, "--run_dir", str(rd), *MIXTURE_RUN)
    after = int(re.search(r"resumed from \S+ at step (\d+)", proc.stdout).group(1))
    assert before <= 4 < after, (before, after)  # the stage's first step is 5
    got = losses(rd)
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, 9))
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    assert worst <= 1e-4, (before, after, got, want)
    print(f"[figures] killed before the stage change on 2 ranks, resumed from step {before} on 1 and killed after it, "
          f"resumed from step {after} on 2: max relative loss difference {worst:.1e}")
    # Per-source validation equals evaluate.py on that source's windows alone (its own loop and windows).
    last = [r for r in metrics(ref) if "val_loss" in r][-1]
    assert last["step"] == 8 and {"val_loss/code", "val_loss/docs"} <= set(last)
    # The console shows each source's loss beside the mixture's, as metrics.jsonl records them.
    assert (f"[val] step 8: val_loss {last['val_loss']:.4f} (per source: code {last['val_loss/code']:.4f}, "
            f"docs {last['val_loss/docs']:.4f})") in console, console[-2000:]
    tokens = [r for r in metrics(ref) if "loss" in r][-1]
    assert tokens["tokens/code"] + tokens["tokens/docs"] == tokens["tokens_seen"]
    # evaluate.main in this process, as a lone `python evaluate.py` runs it: no launch to pay per call.
    for source, key in (("code", "val_loss/code"), ("docs", "val_loss/docs")):
        rc, result, err = evaluate_in_process(monkeypatch, capsys, "--run_dir", ref, "--max_sequences", "64",
                                              "--source", source)
        assert rc == 0, err
        assert abs(result["loss"] - last[key]) <= 1e-5 * last[key], (key, result["loss"], last[key])
    # Another dataset replaces the run's mixture, tokenized with the run's tokenizer.
    rc, result, err = evaluate_in_process(monkeypatch, capsys, "--run_dir", ref, "--split", "all", "--data.dataset",
                                          tmp_path / "docs.jsonl", "--data.text_column", "body")
    assert rc == 0 and result["sequences"] > 0, err


def _legacy_data_dir(rd) -> None:
    """rd/data as the code before mixtures left it: one uint32 tokens.bin and its meta.json."""
    prepared_data_dir(rd)
    out = os.path.join(str(rd), "data")
    meta = data.read_meta(out)
    record = meta["sources"]["default"]
    stream = np.fromfile(os.path.join(out, record["file"]), dtype=record["dtype"])
    stream.astype(np.uint32).tofile(os.path.join(out, "tokens.bin"))
    shutil.rmtree(os.path.join(out, "sources"))
    cfg = parse_config(["--config", DEBUG]).data
    old = {k: getattr(cfg, k) for k in ("dataset", "dataset_config", "split", "text_column", "max_documents",
                                        "decode_errors", "tokenizer", "tokenizer_vocab_size", "tokenizer_train_chars")}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"], "n_tokens": int(stream.size),
                   "n_documents": record["n_documents"], "work_units": record["work_units"], "config": old}, f)


@pytest.mark.slow
def test_a_run_directory_from_before_mixtures_trains_and_resumes(tmp_path, single_rank_group):

    rd = tmp_path / "old"
    _legacy_data_dir(rd)
    before = {f: (rd / "data" / f).read_bytes() for f in ("meta.json", "tokens.bin")}

    def session():
        cfg = parse_config(["--config", DEBUG, "--run_dir", str(rd), "--train.steps", "50", "--checkpoint.keep", "0"])
        return build(cfg, 0, 1, torch.device("cpu"))

    def step(s):
        train_step(s, s.loader.next_step())

    a = session()
    assert a.corpus.sources[0].tokens.dtype == np.uint32
    for _ in range(2):
        step(a)

    @dataclasses.dataclass
    class OldDataState:  # what that code checkpointed
        consumed_samples: int = 0

    a.ckpt.save(2, AppState(a.model, a.optimizer, a.scheduler, a.train_state,
                            OldDataState(a.loader.state.consumed_samples), 0))
    b = session()
    assert b.resumed_from.endswith("step_00000002")
    assert b.loader.rank_indices() == a.loader.rank_indices()
    for _ in range(2):
        step(a)
        step(b)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n
    assert a.loader.state == b.loader.state
    assert {f: (rd / "data" / f).read_bytes() for f in before} == before  # read as it is, never rewritten


@pytest.mark.parametrize("tables, msg", [
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\nweight = 1e308\n'
     '[[data.sources]]\nname = "b"\ndataset = "stdlib"\nweight = 1e308\n',
     "data.sources: the weights sum past the largest float (inf); give smaller weights"),
    ('[[data.sources]]\nname = "a"\ndataset = "stdlib"\n[[data.sources]]\nname = "b"\ndataset = "stdlib"\n'
     '[[data.stages]]\nstart_step = 3\nweights = { a = 1e308, b = 1e308 }\n',
     "data.stages[0].weights: they sum past the largest float (inf); give smaller weights"),
])
def test_weights_whose_sum_overflows_are_refused_with_the_field(tmp_path, tables, msg):
    toml = tmp_path / "m.toml"
    toml.write_text(open(DEBUG).read().replace('dataset = "stdlib"\n', "") + "\n" + tables)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(toml)])
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_huge_finite_weights_give_the_shares_of_their_ratios():
    assert mixture.weight_shares([1e308, 1e307]) == pytest.approx([10 / 11, 1 / 11], rel=1e-15)
    assert mixture.weight_shares([3.0, 0.0, 1.0]) == [0.75, 0.0, 0.25]


def test_evaluate_reuses_the_run_corpus_exactly_when_prepare_would(tmp_path):
    """evaluate's choice of the run's own corpus agrees with prepare's reuse of a data directory, field by field."""

    tokenizer.train_tokenizer(_texts("t", 20), 300, 10 ** 6).save(str(tmp_path / "tok.json"))
    tok = str(tmp_path / "tok.json")
    base = DataConfig(tokenizer=tok, seq_len=8, val_fraction=0.1, sources=[
        SourceConfig(name="a", dataset=_jsonl(tmp_path / "a.jsonl", _texts("a", 20)), weight=1, text_column="text"),
        SourceConfig(name="b", dataset=_jsonl(tmp_path / "b.jsonl", _texts("b", 20)), weight=1, text_column="text")])
    run = tmp_path / "run"
    prepare.prepare(base, str(run / "data"))
    meta = (run / "data" / "meta.json").read_bytes()
    variants = {
        "weights": dataclasses.replace(base, sources=[dataclasses.replace(s, weight=3) for s in base.sources]),
        "stages": dataclasses.replace(base, stages=[StageConfig(2, {"a": 1.0})]),
        "seq_len": dataclasses.replace(base, seq_len=16),
        "val_fraction": dataclasses.replace(base, val_fraction=0.2),
        "a [data] default every source overrides": dataclasses.replace(base, text_column="body"),
        "max_documents": dataclasses.replace(base, max_documents=5),
        "tokenizer_vocab_size": dataclasses.replace(base, tokenizer_vocab_size=512),
        "a source's text_column": dataclasses.replace(
            base, sources=[dataclasses.replace(base.sources[0], text_column="body"), base.sources[1]]),
    }
    for what, cfg in variants.items():
        try:
            prepare.prepare(cfg, str(run / "data"))
            reused = (run / "data" / "meta.json").read_bytes() == meta
        except DataError:  # "prepared with other data settings"
            reused = False
        own = evaluate.prepared_data(argparse.Namespace(data=cfg), argparse.Namespace(data=base), str(run), tok) \
            if reused else None
        assert reused == (own == str(run / "data")), what
        assert reused == (cfg.prepared_settings() == base.prepared_settings()), what
