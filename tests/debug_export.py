"""A debug run's checkpoint (2 FSDP ranks, 2 steps) and its Hugging Face export, made once per test session.

Shared by test_hf.py and test_generate.py; the export goes through the documented command.
"""
from __future__ import annotations

import os
import subprocess
import sys

from launch import ROOT, debug_run, prepared_data_dir

_made: dict[str, str] = {}


def debug_run_dir(tmp_path_factory) -> str:
    """Run directory of a 2-rank, 2-step debug run (one checkpoint, step 2)."""
    if "run" not in _made:
        run = tmp_path_factory.mktemp("hf_debug_run")
        prepared_data_dir(run)
        debug_run(2, run, "--train.steps", "2", "--checkpoint.interval", "2", timeout=240)
        _made["run"] = str(run)
    return _made["run"]


def export(run_dir: str, out: str, *args: str) -> subprocess.CompletedProcess:
    """python hf.py export --run_dir run_dir --out out args (a fresh process); returns it finished."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "hf.py"), "export", "--run_dir", run_dir,
                           "--out", out, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def exported_dir(tmp_path_factory) -> str:
    """The debug run's checkpoint exported (fp32, one file) with the documented command."""
    if "hf" not in _made:
        out = str(tmp_path_factory.mktemp("hf_export") / "debug-llama")
        proc = export(debug_run_dir(tmp_path_factory), out)
        assert proc.returncode == 0, proc.stderr[-2000:]
        _made["hf"] = out
    return _made["hf"]
