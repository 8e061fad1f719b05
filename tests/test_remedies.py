"""Every message that tells the user what to do has a test that does exactly that and gets the promised result.

A message of the commands (an `error:` line, a stop, a console line) that prescribes an action
("run the same command", "pass --x", "set --x", "use --x", "add [[...]]", "run again") is a
promise; the test named beside it in REMEDIES follows the message as printed and checks the
result. test_every_remedy_message_has_a_test scans the commands' source for such messages, so a
new one without a row here fails: write its test, then add the row.

| where | the message, by a part of it | the test that follows it |
|---|---|---|
| training/rollback.py | `and run the same command`: a divergence the rollback budget cannot take | test_rollback.py::test_a_spent_budget_names_the_checkpoint_the_next_run_resumes_from |
| training/rollback.py | `and run the same command`: a divergence before a usable checkpoint | test_rollback.py::test_a_divergence_before_the_first_usable_checkpoint_stops_and_the_next_run_starts_over |
| training/loop.py | `pass --train.nonfinite skip` | test_bad_input.py::test_nonfinite_gradient_stops_without_touching_the_last_checkpoint |
| training/loop.py | `saved step {} in {}; {} at step {} of {}; run the same command to resume` | test_checkpoint.py::test_ctrl_c_finishes_the_step_on_every_rank_saves_and_resumes_the_same_run |
| training/command.py | `see the other ranks' output for the cause, then run the same command`: a hung or lost peer | test_restart.py::test_a_hung_rank_stops_its_peers_within_the_timeout_and_its_checkpoint_resumes |
| training/command.py | `interrupted (Ctrl-C); what was saved before stays; run the same command`: before the loop | test_bad_input.py::test_ctrl_c_before_the_loop_keeps_what_was_saved_and_the_same_command_resumes |
| training/resume.py | `or pass --checkpoint.load_from {}`: checkpoint.dir moved away from the run's checkpoints | test_bad_input.py::test_an_empty_new_checkpoint_dir_on_a_run_with_checkpoints_is_refused |
| training/resume.py | `pass --train.steps above {} to continue this run` | test_bad_input.py::test_fewer_steps_than_done_is_refused_and_the_printed_fix_continues_the_run |
| training/loop.py | `pass --train.steps above {} to continue this run`: the same, for a load_from folder not named step_N | test_bad_input.py::test_fewer_steps_than_done_is_refused_and_the_printed_fix_continues_the_run |
| checkpoint.py | `fix the store or disk, then run the same command` | test_objectstore.py::test_killed_during_an_upload_then_a_store_outage_resumes_from_the_bucket_like_the_local_run |
| nn/parametrization.py | `set --model.parametrization mup (or completep), or drop them` | test_remedies.py::test_parametrization_remedies_are_accepted_as_printed |
| nn/parametrization.py | `set --model.parametrization completep, or drop it` | test_remedies.py::test_parametrization_remedies_are_accepted_as_printed |
| nn/parametrization.py | `set --model.parametrization mup (or completep) with --model.base_dim, the proxy's width, or drop {}` | test_remedies.py::test_parametrization_remedies_are_accepted_as_printed |
| config.py | `set --model.eot_id {}` | test_long_context.py::test_a_tokenizer_whose_eot_is_elsewhere_is_refused_with_the_fix |
| data_pipeline/filesplit.py | `or pass --data.decode_errors replace` | test_bad_input.py::test_undecodable_bytes_can_be_replaced_on_request |
| data_pipeline/sources.py | `or pass --data.decode_errors replace` | test_bad_input.py::test_undecodable_bytes_can_be_replaced_on_request |
| data.py | `away and run again to prepare it anew`: a damaged data directory | test_remedies.py::test_a_damaged_data_directory_moved_away_is_prepared_anew |
| data_pipeline/sources.py | `away and run again to tokenize it anew`: a source that changed after it was prepared | test_data.py::test_a_source_that_grew_after_preparation_is_named_and_moved_away_is_tokenized_anew |
| parallel/distributed.py | `use --train.device cpu` | test_remedies.py::test_device_remedies_are_accepted_as_printed |
| generate.py | `no CUDA device is visible; use --device cpu` | test_remedies.py::test_device_remedies_are_accepted_as_printed |
| generate.py | `MPS is not available here; use --device cpu` | test_remedies.py::test_device_remedies_are_accepted_as_printed |
| parallel/float8.py | `use --train.float8 off`: a GPU without float8 matmuls | test_float8.py::test_float8_on_a_gpu_below_compute_capability_8_9_is_refused |
| evaluate.py | `use --split all or raise --data.val_fraction` | test_hf.py::test_an_empty_split_is_refused_and_split_all_evaluates |
| ladder.py | `set --model.parametrization mup (or completep) with --model.base_dim` | test_remedies.py::test_parametrization_remedies_are_accepted_as_printed |
| ladder.py | `set --optim.schedule wsd` | test_ladder.py::test_the_schedule_remedy_is_accepted_as_printed |
| ladder.py | `interrupted; run the same command again to resume` | test_ladder.py::test_ctrl_c_waits_for_the_run_to_save_prints_one_line_and_the_same_command_resumes |
| nn/moe_args.py | `only to a mixture of experts; set --model.n_experts (and --model.experts_per_token), or drop them` | test_moe.py::test_moe_option_remedies_are_accepted_as_printed |
| parallel/compose.py | `pass --model.moe_renormalize false`: top-1 routing whose router would never learn | test_moe.py::test_top_1_routing_with_renormalised_weights_is_refused_and_the_printed_fix_trains_the_router |
| training/loop.py | `pass --model.moe_bias_update_rate 0`: the start's notice that hf.py export will refuse a softmax MoE whose bias moves | test_moe.py::test_the_export_notice_names_the_refusal_and_its_printed_fix_keeps_the_model_exportable |
| parallel/compose.py | `set --model.n_experts (a multiple of {}) or use parallel.ep 1` | test_moe.py::test_moe_option_remedies_are_accepted_as_printed |
| training/resume.py | `to resume it, or start a new --run_dir`: an MoE checkpoint resumed as dense | test_moe.py::test_moe_checkpoint_resumed_as_dense_and_the_reverse_are_refused |
| plan.py | `a run fills whole nodes; use --world_size {}` | test_plan.py::test_the_printed_remedies_plan_as_printed |
| plan.py | `use --train.float8 off`: float8 planned on a GPU without it | test_plan.py::test_the_printed_remedies_plan_as_printed |
"""
from __future__ import annotations

import ast
import os
import re
import shutil

import pytest

from launch import DEBUG, ROOT

REMEDY = re.compile(r"run the same command|run (it )?again|pass --|use --|set --|add \[\[")
"""The phrases that make a message a remedy a user follows."""

SOURCES = ("", "core", "nn", "storage", "parallel", "observability", "data_pipeline", "optimization", "evaluation",
           "training", "planning")
"""The folders of the commands' code (the root: its .py files); tests and benchmarks are not the product's messages."""


def _table() -> list[tuple[str, str, str]]:
    """The rows of the module docstring's table: (file, the message's part between backticks, 'file.py::test')."""
    rows = []
    for line in __doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "::" in cells[2]:
            rows.append((cells[0], cells[1].split("`")[1], cells[2]))
    return rows


def _strings(path: str):
    """(line, text) of every string literal in path that is not a docstring; an f-string's fields read '{}'."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in docstrings or id(node) in inner:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _remedy_messages() -> list[tuple[str, int, str]]:
    """(file relative to the root, line, text) of every remedy message of the commands."""
    found = []
    for folder in SOURCES:
        where = os.path.join(ROOT, folder)
        for name in sorted(os.listdir(where)):
            if name.endswith(".py"):
                rel = os.path.join(folder, name) if folder else name
                found += [(rel, line, text) for line, text in _strings(os.path.join(ROOT, rel)) if REMEDY.search(text)]
    return found


def test_every_remedy_message_has_a_test():
    """Each remedy message matches a row of the table, each row a message, and each row names a test that exists."""
    rows, messages = _table(), _remedy_messages()
    missing = [f"{rel}:{line}: {text!r}" for rel, line, text in messages
               if not any(rel == f and part in text for f, part, _ in rows)]
    assert not missing, "remedy messages without a row (and a test) in tests/test_remedies.py:\n" + "\n".join(missing)
    stale = [(f, part) for f, part, _ in rows if not any(rel == f and part in text for rel, _, text in messages)]
    assert not stale, f"rows that match no message (reworded or gone?): {stale}"
    for _, _, test in rows:
        file, name = test.split("::")
        assert f"def {name}(" in open(os.path.join(ROOT, "tests", file), encoding="utf-8").read(), test


def test_the_scan_finds_remedies_and_skips_docstrings(tmp_path):
    """The scanner itself: an f-string remedy is found, a docstring that says the same is not."""
    src = tmp_path / "m.py"
    src.write_text('"""run the same command (a docstring)."""\n'
                   'def f(x):\n    """pass --x here (a docstring)."""\n'
                   '    raise ValueError(f"bad {x}; pass --data.x {x} "\n                     "and run again")\n')
    got = list(_strings(str(src)))
    assert [t for _, t in got if REMEDY.search(t)] == ["bad {}; pass --data.x {} and run again"]


def test_parametrization_remedies_are_accepted_as_printed():
    from config import parse_config
    from core.errors import ConfigError

    for argv, fix in ((["--model.base_dim", "32"], ["--model.parametrization", "mup"]),
                      (["--model.parametrization", "mup", "--model.base_dim", "32", "--model.base_n_layers", "1"],
                       ["--model.parametrization", "completep"])):
        with pytest.raises(ConfigError, match=f"set {fix[0]} {fix[1]}"):
            parse_config(["--config", DEBUG, *argv])
        assert parse_config(["--config", DEBUG, *argv, *fix]).model.parametrization == fix[1]
    # A base multiplier under sp: the printed fix, with a base_dim (the debug model is 128 wide).
    with pytest.raises(ConfigError, match="set --model.parametrization mup \\(or completep\\) with --model.base_dim"):
        parse_config(["--config", DEBUG, "--model.mup_input_mult", "4"])
    fixed = parse_config(["--config", DEBUG, "--model.mup_input_mult", "4", "--model.parametrization", "mup",
                          "--model.base_dim", "64"]).model
    assert (fixed.parametrization, fixed.mup_input_mult) == ("mup", 4.0)


def test_device_remedies_are_accepted_as_printed(monkeypatch):
    import argparse

    import torch

    import generate
    from core.errors import SetupError
    from parallel import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SetupError, match="use --train.device cpu"):
        distributed.resolve_device("cuda")
    assert distributed.resolve_device("cpu") == torch.device("cpu")
    for bad in ("cuda", "mps"):
        if bad == "mps":
            monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
        with pytest.raises(argparse.ArgumentTypeError, match="use --device cpu"):
            generate.device_arg(bad)
    assert generate.device_arg("cpu") == torch.device("cpu")


def test_a_damaged_data_directory_moved_away_is_prepared_anew(tmp_path):
    """'move DIR away and run again': the directory prepared again reads as the undamaged one did."""
    import numpy as np

    from data import PackedCorpus
    from data_pipeline.datacache import DataError
    from data_pipeline.tokenizer import train_tokenizer
    from prepare import prepare

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(400)))
    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer([(src / f"d{i}.txt").read_text() for i in range(6)], 300, 10 ** 6).save(tok)
    from data import DataConfig

    cfg = DataConfig(dataset=str(src / "*.txt"), tokenizer=tok, seq_len=16, val_fraction=0.1)
    out = str(tmp_path / "data")
    prepare(cfg, out)
    want = PackedCorpus(out, cfg)
    want = [want.sample(i).copy() for i in range(want.n_train + want.n_val)]
    with open(os.path.join(out, "meta.json"), "wb") as f:
        f.write(b"{}")
    with pytest.raises(DataError, match=f"move '{re.escape(out)}' away and run again") as e:
        PackedCorpus(out, cfg)
    shutil.move(out, str(tmp_path / "moved"))  # as the message says
    prepare(cfg, out)
    got = PackedCorpus(out, cfg)
    assert "damaged" in str(e.value) and got.n_train + got.n_val == len(want)
    assert all(np.array_equal(got.sample(i), w) for i, w in enumerate(want))
