"""prepare.py's command writes the same bytes at 1, 2 and 4 ranks (forked: tests/ranks.py): every file of the data
folder (tokenizer, meta.json, each source's stream and, with --data.prepared_format megatron, its .idx), for a mixture
of a jsonl and a txt source cut into many work units, so that every rank tokenizes some of them.
(tests/test_data.py compares the stream alone, at 3 ranks in threads and at 2 under torchrun.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest

import prepare
from data_pipeline import filesplit
from ranks import run_ranks
from test_data import _lines_text, _mixed_rows, _write_jsonl

UNIT_BYTES = 20000
"""Work units of about 20 kB: the jsonl file is about 13 units and the txt file 3, spread over
the ranks."""


def _corpus(tmp_path) -> str:
    """A config file of two sources (jsonl rows, txt paragraphs) and a tokenizer trained by rank 0."""
    _write_jsonl(tmp_path / "web.jsonl", _mixed_rows(2000))
    (tmp_path / "book.txt").write_text(_lines_text(3000), encoding="utf-8")
    config = tmp_path / "mix.toml"
    config.write_text(f"""
[data]
max_documents = 0
tokenizer_vocab_size = 400
tokenizer_train_chars = 100_000

[[data.sources]]
name = "web"
dataset = "{tmp_path / 'web.jsonl'}"
weight = 0.6

[[data.sources]]
name = "book"
dataset = "{tmp_path / 'book.txt'}"
txt_documents = "blank_line"
weight = 0.4
""")
    return str(config)


def _files(folder) -> dict[str, bytes]:
    """{relative path: bytes} of every file under folder."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


@pytest.mark.slow
def test_prepare_writes_the_same_bytes_at_1_2_and_4_ranks(tmp_path, monkeypatch):
    """Reference: one process (prepare.main in this process). Each run writes into the same --run_dir (meta.json
    names its own folder), whose data/ is then moved aside; every file is compared byte for byte."""
    config = _corpus(tmp_path)
    run = tmp_path / "run"
    outs = {}
    monkeypatch.setattr(filesplit, "UNIT_BYTES", UNIT_BYTES)
    # a megatron preparation is a bin one plus rank 0's .idx files (compared below), so each launch covers one
    # format: 2 ranks bin, 4 ranks megatron
    for world, fmt in ((1, "bin"), (1, "megatron"), (2, "bin"), (4, "megatron")):
        args = ["--config", config, "--run_dir", str(run), "--data.prepared_format", fmt]
        if world == 1:
            assert prepare.main(args) == 0
        else:
            run_ranks(world, "small_units_prepare", "--unit_bytes", str(UNIT_BYTES), *args, timeout=120)
        outs[world, fmt] = tmp_path / f"data_{world}_{fmt}"
        os.rename(run / "data", outs[world, fmt])
        shutil.rmtree(run)
    ref = _files(outs[1, "bin"])
    meta = json.loads(ref["meta.json"])
    units = {n: r["work_units"] for n, r in meta["sources"].items()}
    assert units["web"] >= 8 and units["book"] >= 3, units  # more units than ranks: each rank has several
    assert sorted(ref) == sorted(["meta.json", "tokenizer.json", *(r["file"] for r in meta["sources"].values())])
    megatron = _files(outs[1, "megatron"])
    idx = {r["file"][:-4] + ".idx" for r in meta["sources"].values()}
    assert {k: v for k, v in megatron.items() if k not in idx} == ref and idx <= set(megatron)
    for (world, fmt), folder in outs.items():
        got = _files(folder)
        assert sorted(got) == sorted(megatron if fmt == "megatron" else ref), (world, fmt)
        assert all(got[k] == (megatron if fmt == "megatron" else ref)[k] for k in got), (world, fmt)
