"""A debug run's checkpoint (2 FSDP ranks, 2 steps) and its Hugging Face export, made once per test run.

Shared by test_hf.py, test_generate.py and test_cli_input.py (and their xdist workers); the export goes through the
documented command.
"""
from __future__ import annotations

import os
import subprocess
import sys

from launch import ROOT, debug_run, made_once, prepared_data_dir

_made: dict[str, str] = {}


def debug_run_dir(tmp_path_factory) -> str:
    """Run directory of a 2-rank, 2-step debug run (one checkpoint, step 2)."""
    def make(run):
        prepared_data_dir(run)
        debug_run(2, run, "--train.steps", "2", "--checkpoint.interval", "2", timeout=240)

    if "run" not in _made:
        _made["run"] = str(made_once(tmp_path_factory, "hf_debug_run", make))
    return _made["run"]


def export(run_dir: str, out: str, *args: str) -> subprocess.CompletedProcess:
    """python hf.py export --run_dir run_dir --out out args (a fresh process); returns it finished."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "hf.py"), "export", "--run_dir", run_dir,
                           "--out", out, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def exported_dir(tmp_path_factory) -> str:
    """The debug run's checkpoint exported (fp32, one file) with the documented command."""
    def make(folder):
        proc = export(debug_run_dir(tmp_path_factory), str(folder / "debug-llama"))
        assert proc.returncode == 0, proc.stderr[-2000:]

    if "hf" not in _made:
        _made["hf"] = str(made_once(tmp_path_factory, "hf_export", make) / "debug-llama")
    return _made["hf"]
