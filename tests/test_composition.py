"""parallel/composition.py's table: every row refuses its pair with its line, and no printed remedy is a pair that
another row (or compose.check_moe, checked after it) then refuses, whatever other row refuses the config too.

Configs are the debug config's with settings applied (each section rebuilt, so its own checks run): a remedy that a
section refuses fails here as well.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

import train_fsdp
from config import BatchStage, Config, parse_config
from core.errors import SetupError
from evaluation.downstream import TaskConfig
from launch import DEBUG, before_any_collective, refused
from parallel.compose import check_moe
from parallel.composition import TABLE, check_composition, refusals, words

MOE = {"model.n_experts": 4, "model.experts_per_token": 2}
EXAMPLES = {
    ("train_fsdp.py", "parallel.tp > 1"): {"parallel.tp": 2},
    ("parallel.ep > 1", "train.activation_checkpointing selective with train.compile true"):
        {**MOE, "parallel.ep": 2, "train.activation_checkpointing": "selective", "train.compile": True},
    ("optim.name muon", "model.n_experts > 0 with parallel.tp > 1"): {**MOE, "optim.name": "muon", "parallel.tp": 2},
    ("parallel.pp > 1", "train.float8 tensorwise or rowwise"): {"parallel.pp": 2, "train.float8": "rowwise"},
    ("parallel.pp > 1", "[[train.batch_stages]]"): {"parallel.pp": 2, "train.batch_stages": [BatchStage(1, 64)]},
    ("parallel.pp_schedule InterleavedZeroBubble or ZBVZeroBubble or DualPipeV",
     "train.activation_checkpointing full or selective"):
        {"parallel.pp": 2, "parallel.pp_schedule": "ZBVZeroBubble", "parallel.pp_stages_per_rank": 2,
         "train.activation_checkpointing": "full"},
    ("parallel.pp_schedule InterleavedZeroBubble or ZBVZeroBubble or DualPipeV", "train.compile true"):
        {"parallel.pp": 2, "parallel.pp_schedule": "InterleavedZeroBubble", "train.compile": True},
    ("parallel.cp > 1", "[[eval.tasks]]"): {"parallel.cp": 2, "eval.tasks": [TaskConfig("hellaswag")]},
    ("train.float8 tensorwise or rowwise", "parallel.tp > 1"): {"train.float8": "rowwise", "parallel.tp": 2},
}
"""A config each row refuses, by (a, b): the debug config with these settings."""


def configured(settings: dict) -> Config:
    """The debug config with settings (dotted name -> value) applied, each section's and the root's checks run."""
    cfg = parse_config(["--config", DEBUG])
    for section in {name.split(".")[0] for name in settings}:
        fields = {n.split(".")[1]: v for n, v in settings.items() if n.startswith(section + ".")}
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **fields))
    return dataclasses.replace(cfg)


def refused_by(cfg: Config, *rows) -> list:
    """The rows that refuse cfg, and 'check_moe' if that refuses it (the checks config.validate runs next, which
    need no world size). Run by train_2d.py, which takes every setting, unless one of rows is another script's."""
    script = next((r.script for r in rows if r.script), "train_2d.py")
    found = [(r.a, r.b) for r in refusals(cfg, script)]
    try:
        check_moe(cfg)
    except SetupError:
        found.append("check_moe")
    return found


def example(row) -> dict:
    return EXAMPLES[(row.a, row.b)]


def test_every_row_has_an_example_that_it_refuses_with_its_line():
    assert sorted(EXAMPLES) == sorted((r.a, r.b) for r in TABLE), "give each row of the table an example here"
    for row in TABLE:
        cfg = configured(example(row))
        assert (row.a, row.b) in refused_by(cfg, row), row
        assert "check_moe" not in refused_by(cfg, row), row  # the example is about the pair alone
        line = row.say(cfg, [row])  # names both settings (a script is not one)
        assert row.name in line and (row.script or row.a.split()[0] in line), line


@pytest.mark.parametrize("row", TABLE, ids=lambda r: f"{r.a} x {r.b}")
def test_every_remedy_of_a_row_passes_every_row(row):
    """Each remedy printed, applied to the row's example, leaves nothing refused; and it is one the docs name."""
    cfg = configured(example(row))
    for fix in row.fixes(cfg):
        assert next(iter(fix)) in row.remedy, (row.remedy, fix)
        assert refused_by(configured({**example(row), **fix}), row) == [], (row.a, row.b, words(fix))


@pytest.mark.parametrize("first, second", itertools.permutations(TABLE, 2),
                         ids=lambda r: f"{r.a} x {r.b}")
def test_no_remedy_is_a_pair_another_row_refuses(first, second):
    """With two rows refusing a config, following the first's remedy refuses nothing that was not refused before:
    the remedies are never the refused pairs of another row, so the order the rows are checked in does not matter."""
    settings = {**example(first), **example(second)}
    if any(settings[n] != v for n, v in example(first).items()):
        pytest.skip("the examples set one setting two ways")
    cfg = configured(settings)
    before = refused_by(cfg, first, second)
    assert (first.a, first.b) in before
    for fix in first.fixes(cfg):
        after = refused_by(configured({**settings, **fix}), first, second)
        assert (first.a, first.b) not in after, words(fix)
        assert set(after) <= set(before), f"{words(fix)} is refused by {set(after) - set(before)}"


def test_rows_with_one_line_are_named_together_and_the_first_is_printed_naming_the_other_pairs():
    cfg = configured({"parallel.pp": 2, "parallel.pp_schedule": "ZBVZeroBubble", "train.compile": True,
                      "train.batch_stages": [BatchStage(1, 64)], "train.float8": "rowwise", "parallel.tp": 2})
    with pytest.raises(SetupError) as e:
        check_composition(cfg, "train_2d.py")
    assert str(e.value) == ("parallel.pp 2 does not run with train.float8, [[train.batch_stages]], train.compile "
                            "(under ZBVZeroBubble) yet (docs/pipeline.md); use train.float8 off and no "
                            "[[train.batch_stages]] tables and train.compile false, or parallel.pp 1 (these settings "
                            "are also refused as train.float8 tensorwise or rowwise with parallel.tp > 1: "
                            "docs/cluster.md)")
    with pytest.raises(SetupError, match="tensor parallelism runs with train_2d.py"):
        check_composition(cfg, "train_fsdp.py")  # the script's row first
    check_composition(configured({"parallel.tp": 2}), "train_2d.py")  # a script's row only under that script


def test_the_table_is_checked_before_the_sizes(tmp_path, monkeypatch, capsys):
    """parallel.ep 2 does not divide 3 experts, and does not run with selective checkpointing and compile together:
    the pair is named first, so that no parallel.ep the size check offers (3 would divide the experts) is then
    refused with the same settings."""
    argv = ["--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--parallel.ep", "2", "--model.n_experts", "3",
            "--model.experts_per_token", "2", "--train.activation_checkpointing", "selective", "--train.compile", "true"]
    with before_any_collective(monkeypatch, 2):
        line = refused(train_fsdp.main, argv, capsys)
    assert line.startswith("error: parallel.ep 2 does not run with train.activation_checkpointing selective"), line
