"""Run the project's scripts on ranks as torchrun starts them, with a timeout so a hang fails: on ranks forked from a
server that imported the trainer (`run`, `start`: tests/ranks.py), or under torchrun itself (`torchrun`, `spawn`) where
the launch is what a test checks."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from unittest import mock

import torch

import prepare
from config import parse_config
from parallel import distributed
from ranks import Ranks, alive, descendants, fork_ranks, kill_tree  # noqa: F401 (the tests import them from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "debug.toml")
GRAD_STEPS = 3
"""Steps of the conftest `worker` fixture's runs (tests/grad_worker.py)."""
REFERENCE_BATCH = ["--train.global_batch_size", "8"]
"""The reference run's batch: half the debug config's, which halves each step's time; kill and resume need no more."""
GRAD_ARGS = ["--train.steps", str(GRAD_STEPS), "--checkpoint.interval", "1000", "--train.val_interval", "0",
             *REFERENCE_BATCH, "--data.seq_len", "64"]
"""The `worker` fixture's runs (and the runs compared with them): GRAD_STEPS steps of REFERENCE_BATCH windows of 64
tokens (half the debug config's: the layouts' parity needs no longer ones, and the suite runs a hundred of them), no
saves or validation; a layout's overrides come after, so they can set another batch."""
REFERENCE_ARGS = ["--train.steps", "10", "--train.seed", "0", "--checkpoint.interval", "2", "--train.val_interval", "0",
                  *REFERENCE_BATCH]
"""Overrides of the conftest `reference` run (2 ranks), which kill and resume tests repeat."""


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300, check: bool = True,
             env: dict | None = None, launcher: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """torchrun LAUNCHER --nproc_per_node=nproc ROOT/script args; returns the finished process.

    Raises AssertionError with the output's tail if check and the exit status is not 0,
    and subprocess.TimeoutExpired (after killing the process group) past timeout seconds.
    """
    proc = subprocess.run(torchrun_command(nproc, script, *args, launcher=launcher), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          start_new_session=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


FORKED = {"train_fsdp.py": "train_fsdp", "train_2d.py": "train_2d", "evaluate.py": "evaluate",
          "tests/diverge_worker.py": "diverge_worker"}
"""The scripts `run` starts on forked ranks, and their modules."""


def run(nproc: int, script: str, *args: str, timeout: float = 300, check: bool = True,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """torchrun(nproc, script, *args) on ranks forked from a server that imported the trainer (tests/ranks.py):
    the same ranks, environment, exit status and outputs (each rank's in turn), without torchrun's start-up.

    For runs whose outcome a test compares (losses, checkpoints, printed lines), not their launch; script is a key of
    FORKED. Raises AssertionError with the output's tail if check and the exit status is not 0, and past timeout
    seconds (every rank killed); the message names the rank that failed first and shows its output's tail.
    """
    rc, out, err = fork_ranks(nproc, FORKED[script], *args, timeout=timeout, check=check, env=env)
    return subprocess.CompletedProcess([script, *map(str, args)], rc, out, err)


def start(nproc: int, script: str, *args: str, log_path, env: dict | None = None) -> Ranks:
    """`run` started, not waited for, the ranks' stdout and stderr together in log_path (as `spawn` keeps a torchrun
    launch's); the caller waits for it (poll, wait) or kills it (Ranks.kill: every rank SIGKILLed, as a node
    failure would). For kill-and-resume tests whose subject is the checkpoint, not torchrun's agent."""
    open(log_path, "w").close()
    return Ranks(nproc, FORKED[script], args, env, log_path=log_path)


def torchrun_command(nproc: int, script: str, *args: str, launcher: tuple[str, ...] = ("--standalone",)) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc_per_node={nproc}",
            os.path.join(ROOT, script), *map(str, args)]


def spawn(cmd: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
    """Start cmd in a session of its own, stdout and stderr into log_path; the caller waits (with a timeout)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def wait_until_unlocked(run_dir, timeout: float = 60) -> None:
    """Block until no process holds run_dir's lock (storage.rundir.lock_run_dir): a worker of a killed launch can
    outlive kill_tree's look at the process tree (one its agent was still starting, which dies with its agent only
    once it runs), and the next run, started at once in this process, would be refused as a second run."""
    path = os.path.join(str(run_dir), ".lock")
    deadline = time.time() + timeout
    while os.path.exists(path):
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                pass
        assert time.time() < deadline, f"{run_dir} is still locked {timeout} s after its run was killed"
        time.sleep(0.05)


def workers(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the live worker processes under a torchrun agent (read from /proc)."""
    found = {}
    for pid in descendants(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"TORCHELASTIC_RESTART_COUNT" in env and b"RANK" in env:
            found[int(env[b"RANK"])] = pid
    return found


def wait_for_step(run_dir, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Block until run_dir/metrics.jsonl has a train record of step >= step; AssertionError if proc ends first."""
    deadline = time.time() + timeout
    path = os.path.join(str(run_dir), "metrics.jsonl")
    while time.time() < deadline:
        if os.path.exists(path) and any(r.get("step", 0) >= step and "loss" in r for r in _records(path)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {step}")
        time.sleep(0.01)
    raise AssertionError(f"step {step} was not reached in {timeout} s")


def _records(path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return out


def job_list(argv: list[str]) -> list[list[str]]:
    """A worker's jobs: the argument lists in the JSON file of '--jobs FILE', else argv itself as the one job."""
    if argv[:1] == ["--jobs"]:
        with open(argv[1]) as f:
            return json.load(f)
    return [argv]


def debug_run(nproc: int, run_dir: str, *overrides: str, script: str = "train_fsdp.py", **kw):
    """A debug-config run into run_dir with overrides (e.g. '--train.steps', '4'), on forked ranks (`run`)."""
    return run(nproc, script, "--config", DEBUG, "--run_dir", str(run_dir), *overrides, **kw)


def metrics(run_dir) -> list[dict]:
    """Records of run_dir/metrics.jsonl, in order."""
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir) -> dict[int, float]:
    """The last logged train loss of each step."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def prepared_data_dir(dest) -> None:
    """Copy the debug corpus, tokenized once per test run, into run directory dest/data.

    Saves each test the tokenizer training and tokenization (prepare.prepare reuses it). The xdist workers of one
    run share the copy (the first to ask prepares it under a lock; the others wait for it).
    """
    test_run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    cache = os.path.join(tempfile.gettempdir(), f"llama_pretrain_test_data_{test_run}")
    with locked(cache + ".lock"):
        if not os.path.exists(os.path.join(cache, "meta.json")):
            cfg = parse_config(["--config", DEBUG])
            prepare.prepare(cfg.data, cache)
    shutil.copytree(cache, os.path.join(str(dest), "data"), dirs_exist_ok=True)


@contextmanager
def locked(path):
    """An exclusive lock on file path (created if missing) for the with-block: across the xdist workers."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_root(tmp_path_factory):
    """The temporary directory every xdist worker of this test run shares (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make):
    """Directory `name`, filled by make(path) once per test run for every xdist worker; returns its path.

    The first worker to ask makes it under a lock, the others wait and reuse it: a reference run that tests
    in several files compare against is paid once, not once per worker. If make raises, the next caller retries.
    """
    root = shared_root(tmp_path_factory)
    path = root / f"once_{name}"
    with locked(str(root / f"once_{name}.lock")):
        if not (root / f"once_{name}.made").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            (root / f"once_{name}.made").write_text("")
    return path


@contextmanager
def before_any_collective(monkeypatch, world: int):
    """As a rank of world processes (WORLD_SIZE and LOCAL_WORLD_SIZE) that must not start torch.distributed:
    init_distributed raises AssertionError('a collective started'), where a command that passed every check ends."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    with mock.patch.object(distributed, "init_distributed", side_effect=AssertionError("a collective started")):
        yield


def main_in_process(monkeypatch, capsys, *argv: str, world_size: int = 1) -> tuple[int, str]:
    """train_fsdp.main(argv) in this process, as rank 0 of world_size; returns (exit status, stderr).

    For refusals: they come before any collective, or at world_size 1 inside a gloo group of one, which the run
    leaves on its error path (asserted). Saves a torchrun launch (about 4 CPU-s) per refusal.
    """
    import train_fsdp

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))  # should it get as far as the group
    capsys.readouterr()
    with outside_single_rank_group():  # a module's single_rank_group, left meanwhile
        rc = train_fsdp.main([str(a) for a in argv])
        assert not torch.distributed.is_initialized()
    return rc, capsys.readouterr().err


def debug_run_in_process(monkeypatch, capsys, run_dir, *overrides: str,
                         check: bool = True) -> subprocess.CompletedProcess:
    """debug_run(1, run_dir, *overrides) as train_fsdp.main in this process: train_in_process."""
    return train_in_process(monkeypatch, capsys, "--config", DEBUG, "--run_dir", run_dir, *overrides, check=check)


def join_single_rank_group() -> None:
    """Join a 1-rank gloo process group, for in-process tests of collective code (conftest's single_rank_group)."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0,
                                         world_size=1)


@contextmanager
def outside_single_rank_group():
    """For a command run in this process, which joins a process group of its own and leaves it: a module's
    single_rank_group (a group of one) is left for the with-block and joined again after it, a new group of one that
    the module's later tests use as they did the first."""
    rejoin = torch.distributed.is_initialized()
    if rejoin:
        assert torch.distributed.get_world_size() == 1, "only a group of one is left and joined again"
        torch.distributed.destroy_process_group()
    try:
        yield
    finally:
        if rejoin and not torch.distributed.is_initialized():
            join_single_rank_group()


def train_in_process(monkeypatch, capsys, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """torchrun(1, "train_fsdp.py", *argv) as train_fsdp.main in this process, a lone rank in a gloo group of one.

    For a 1-rank run whose outcome a test compares (losses, checkpoints, its printed lines), not its launch: saves
    torchrun's agent and the worker's start-up (about 4 CPU-s a run). Returns the finished "process" (args,
    returncode, stdout, stderr); raises AssertionError as torchrun does when check and the status is not 0. The
    run's SIGINT and SIGTERM handlers (distributed.StopFlag) are put back as they were, and its group is left
    (asserted); a module's single_rank_group is left meanwhile (outside_single_rank_group). capsys None (a module
    fixture, which has no capsys): stdout and stderr are not kept ("").
    """
    import train_fsdp

    argv = [str(a) for a in argv]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if capsys is not None:
        capsys.readouterr()
    with outside_single_rank_group():
        try:
            rc = train_fsdp.main(argv)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        assert not torch.distributed.is_initialized()
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    if check and rc != 0:
        raise AssertionError(f"train_fsdp.main exited {rc}:\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(["train_fsdp.main", *argv], rc, out, err)


def evaluate_in_process(monkeypatch, capsys, *argv: str) -> tuple[int, dict | None, str]:
    """evaluate.main(argv) in this process, as a lone rank; returns (exit status, the printed result or None, stderr).

    For tests of what evaluate.py computes or refuses at 1 rank, not of its launch: saves a torchrun launch (about
    4 CPU-s) per call. The gloo group of one it joins is left before it returns (asserted); a module's
    single_rank_group is left meanwhile (outside_single_rank_group).
    """
    import evaluate

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    capsys.readouterr()
    with outside_single_rank_group():
        rc = evaluate.main([str(a) for a in argv])
        assert not torch.distributed.is_initialized()
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]) if rc == 0 else None, err


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
