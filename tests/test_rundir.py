"""The run directory's paths are named in rundir.py alone, and they are the layout DESIGN.md's checks read."""
import ast
import os

from project import ROOT, modules
from storage.rundir import RunDir

# The run directory's own entries. The files inside a prepared data directory (tokenizer.json,
# meta.json, token files) are that directory's layout, which prepare.py owns.
FILES = {"metrics.jsonl", "config.toml", ".lock", "exit.json", "wandb_run_id"}
"""Spelled nowhere else at all."""
FOLDERS = {"checkpoints", "tensorboard", "profile", "eval_data", "data", "wandb"}
"""Words with other meanings too (a package, a config section): never joined onto a path elsewhere."""


def test_the_layout_is_the_documented_one(tmp_path):
    run = RunDir(str(tmp_path))
    assert run.checkpoints == str(tmp_path / "checkpoints") and run.metrics == str(tmp_path / "metrics.jsonl")
    assert run.config == str(tmp_path / "config.toml") and run.tokenizer == str(tmp_path / "data" / "tokenizer.json")
    assert run.data == str(tmp_path / "data") and run.eval_data("ab") == str(tmp_path / "eval_data" / "ab")
    assert run.exit_record == str(tmp_path / "exit.json") and run.lock == str(tmp_path / ".lock")
    assert run.wandb == str(tmp_path / "wandb") and run.wandb_id == str(tmp_path / "wandb_run_id")


def test_no_module_spells_a_run_directory_path_of_its_own():
    found = []
    for f in modules().values():
        if f == "storage/rundir.py":
            continue
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            joined = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            for arg in node.args if joined else []:
                if isinstance(arg, ast.Constant) and arg.value in FOLDERS | FILES:
                    found.append(f"{f}:{arg.lineno} {arg.value!r}")
            if isinstance(node, ast.Constant) and node.value in FILES:
                found.append(f"{f}:{node.lineno} {node.value!r}")
    assert not found, f"use rundir.RunDir instead: {found}"
