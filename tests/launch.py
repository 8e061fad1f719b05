"""Run the project's scripts under torchrun as a user would, with a timeout so a hang fails."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import prepare
from config import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "debug.toml")


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """torchrun --standalone --nproc_per_node=nproc ROOT/script args; returns the finished process.

    Raises AssertionError with the output's tail if check and the exit status is not 0,
    and subprocess.TimeoutExpired (after killing the process group) past timeout seconds.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env,
                          start_new_session=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def debug_run(nproc: int, run_dir: str, *overrides: str, script: str = "train_fsdp.py", **kw):
    """A debug-config run into run_dir with overrides (e.g. '--train.steps', '4')."""
    return torchrun(nproc, script, "--config", DEBUG, "--run_dir", str(run_dir), *overrides, **kw)


def metrics(run_dir) -> list[dict]:
    """Records of run_dir/metrics.jsonl, in order."""
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir) -> dict[int, float]:
    """The last logged train loss of each step."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def prepared_data_dir(dest) -> None:
    """Copy the debug corpus, tokenized once per test session, into run directory dest/data.

    Saves each test the tokenizer training and tokenization (prepare.prepare reuses it).
    """
    cache = os.path.join(tempfile.gettempdir(), f"llama_pretrain_test_data_{os.getpid()}")
    if not os.path.exists(os.path.join(cache, "meta.json")):
        cfg = parse_config(["--config", DEBUG])
        prepare.prepare(cfg.data, cache)
    shutil.copytree(cache, os.path.join(str(dest), "data"), dirs_exist_ok=True)


def refused(main, argv, capsys) -> str:
    """main(argv) in this process must exit with status 2 and one line 'error: ...'; returns the line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's errors
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]
