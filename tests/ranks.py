"""The trainer's commands (train_fsdp.py, train_2d.py, evaluate.py) and the tests' own workers (grad_worker.py,
plan_worker.py, muon_worker.py, hf_import_worker.py, small_units_prepare.py, diverge_worker.py) on N ranks, each rank
a process forked from a server that imported them once.

A torchrun launch of 2 ranks spends most of its CPU before its first step: its agent imports torch, and each rank
imports torch and the trainer (1.3 and 2.2 CPU-s on a fast core, twice that on a slow one), and the suite makes about
a hundred launches. So each xdist worker starts one multiprocessing forkserver that imports these modules, and every
rank is a fork of it: the same gloo process group from the same environment variables torchrun sets (env:// on a
free port, the checkout's root as the working directory), the same exit status and SIGTERM-then-SIGKILL of the
peers of a failed rank, with none of the start-up. A rank's stdout and stderr go to files, read back in rank order.

What is about the launch itself stays under torchrun (launch.torchrun and launch.spawn): the agent's restarts,
signals sent to torchrun and forwarded to its workers, torchrun's own output, multi-node runs, prepare.py's launch,
and at least one launch of each entry script as a user starts it.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import forkserver
from unittest import mock

from parallel import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = ["train_fsdp", "train_2d", "evaluate", "grad_worker", "plan_worker", "muon_worker", "hf_import_worker",
           "small_units_prepare", "diverge_worker"]
"""The modules the server imports before it forks (torch, the trainer, its commands and the tests' workers)."""


def run_ranks(nproc: int, module: str, *args: str, timeout: float = 300) -> None:
    """tests/<module>.py's main() with sys.argv [module, *args] on nproc ranks, forked; returns once every rank
    exited 0.

    Raises AssertionError naming the rank and its output's tail when a rank exits otherwise, or past timeout seconds
    (every rank is killed: a hang fails).
    """
    fork_ranks(nproc, module, *args, timeout=timeout, check=True)


def fork_ranks(nproc: int, module: str, *args: str, timeout: float = 300, check: bool = True,
               env: dict | None = None) -> tuple[int, str, str]:
    """<module>.main() with sys.argv [module, *args] on nproc forked ranks (Ranks), the environment plus env, run
    to its end; returns (exit status, the ranks' stdout, their stderr), each in rank order.

    Raises AssertionError naming the rank that failed first and its output's tail when check and a rank failed,
    and past timeout seconds (every rank is killed: a hang fails).
    """
    ranks = Ranks(nproc, module, args, env)
    try:
        try:
            rc = ranks.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(ranks.failure(0, f"was still running after {timeout:g} s")) from None
        if check and rc != 0:
            raise AssertionError(ranks.failure(ranks.failed, f"exited {ranks.procs[ranks.failed].exitcode}"))
        out, err = ("".join(_read(ranks.output(r, kind)) for r in range(nproc)) for kind in "oe")
        shutil.rmtree(ranks.dir, ignore_errors=True)
        return rc, out, err
    finally:
        ranks.kill()


class Ranks:
    """<module>.main() with sys.argv [module, *args] on nproc ranks forked from this process's server, started and
    read like the subprocess.Popen of their torchrun launch: poll(), wait(), returncode, kill().

    Each rank has this process's environment (now, not the server's), env, torchrun's variables and an elastic
    error file of its own (so that a failing rank waits for its peers as under torchrun: core/errors.report). Its
    stdout and stderr go to log_path, appended (shared by the ranks, as `launch.spawn` keeps torchrun's), or else to
    files of its own in self.dir (output). As torchrun's agent does, once a rank has failed (self.failed) its peers
    get SIGTERM (which the trainer answers by finishing its step) and, GRACE_S later, SIGKILL; the status is 0 when
    every rank exited 0, else 1. A rank ends through multiprocessing's os._exit: no atexit handler runs in it.
    """

    def __init__(self, nproc: int, module: str, args, env: dict | None = None, log_path=None):
        assert module in WORKERS, f"{module} is not among the forked modules ({', '.join(WORKERS)})"
        self.module, self.args, self.log_path = module, [str(a) for a in args], log_path
        self.returncode, self.failed, self._failed_at, self.procs = None, None, None, []
        self.dir = tempfile.mkdtemp(prefix=f"{module}-ranks-")
        ctx = multiprocessing.get_context("forkserver")
        _start_server()
        port = distributed.free_port()
        environ = {**os.environ, **(env or {})}  # this process's now: the server's is from when it started
        _LIVE.add(self)
        try:
            for rank in range(nproc):
                outputs = (str(log_path),) * 2 if log_path else (self.output(rank, "o"), self.output(rank, "e"))
                # not daemonic: a rank may start processes of its own (inductor's compile workers, DCP's async
                # saver); kill() stops them too
                self.procs.append(ctx.Process(target=_rank, args=(module, self.args, rank, nproc, port, outputs,
                                                                  self.dir, environ)))
                self.procs[-1].start()
        except BaseException:
            self.kill()
            raise

    def output(self, rank: int, kind: str) -> str:
        """The file of rank's stdout (kind 'o') or stderr ('e') when the ranks have no log_path."""
        return os.path.join(self.dir, f"rank{rank}.{kind}")

    def failure(self, rank: int, what: str) -> str:
        """'<module>'s rank <rank> of N forked <what>', and the tail of that rank's output; of rank 0's where it has
        none (the trainer reports on rank 0, and a peer may fail first, silently)."""
        def tail(r: int) -> str:
            return _read(self.output(r, "o"))[-1000:] + _read(self.output(r, "e"))[-3000:]

        text = tail(rank)
        if not text and rank != 0 and tail(0):
            text = f"(none of its own; rank 0's:)\n{tail(0)}"
        return (f"{self.module}'s rank {rank} of {len(self.procs)} forked {what} (its output in {self.dir}):\n"
                f"{text or '(no output)'}")

    def poll(self) -> int | None:
        """None while a rank runs, then the exit status (0 when every rank exited 0, else 1)."""
        codes = [p.exitcode for p in self.procs]
        if self.failed is None and any(c not in (None, 0) for c in codes):
            self.failed = next(r for r, c in enumerate(codes) if c not in (None, 0))
            self._failed_at = time.time()
            for p in self.procs:
                if p.exitcode is None:
                    p.terminate()  # once: a second signal may mean "stop now" to the trainer
        elif self._failed_at is not None and time.time() > self._failed_at + GRACE_S:
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()
        if None not in codes:
            self.returncode = 0 if all(c == 0 for c in codes) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once every rank has exited; subprocess.TimeoutExpired past timeout seconds."""
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired([self.module, *self.args], timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank still running and what it started, as a node failure would; returns once the ranks
        are gone (reaped)."""
        for p in self.procs:
            if p.exitcode is None and p.pid is not None:
                kill_tree(p.pid)
        for p in self.procs:
            if p.pid is not None:
                p.join()
        _LIVE.discard(self)
        if self.log_path:  # self.dir holds only the error files
            shutil.rmtree(self.dir, ignore_errors=True)
        self.poll()


GRACE_S = 30
"""How long ranks have after SIGTERM before SIGKILL, once a peer failed (torchrun's agent's default)."""

_LIVE: set[Ranks] = set()
"""Ranks not yet killed: killed at this process's exit, whose multiprocessing would otherwise wait for them."""


@atexit.register  # after multiprocessing's own exit handler was registered (at its import): runs before it
def _kill_live() -> None:
    for ranks in list(_LIVE):
        ranks.kill()


def descendants(pid: int) -> list[int]:
    """Every live process under pid (read from /proc; torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, timeout: float = 30) -> None:
    """SIGKILL pid and every process under it, as a node failure would (killpg would miss the workers); return once
    they are gone (or zombies), so that a run started next, in the test's own process too, finds the run directory's
    lock released. The caller still reaps pid (its Popen's wait, its Process's join)."""
    procs = [pid, *descendants(pid)]
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    while any(alive(p) for p in procs) and time.time() < deadline:
        time.sleep(0.01)


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_server() -> None:
    """Start this process's forkserver with WORKERS imported, once. Python 3.11's forkserver imports its preload
    without the parent's sys.path (it passes it, then ignores it): the server alone is started with tests/ and the
    root on PYTHONPATH, else the imports fail silently and every rank pays them."""
    multiprocessing.set_forkserver_preload(WORKERS)
    path = [HERE, os.path.dirname(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(path)):
        forkserver.ensure_running()


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # it ended before its first line: multiprocessing's own error went to the server's
        return ""


def _rank(module: str, argv: list[str], rank: int, world: int, port: int, outputs: tuple[str, str],
          scratch: str, environ: dict) -> None:
    """One rank, in the forked process: the environment environ with torchrun's variables and an elastic error file
    in scratch, stdout and stderr appended to the files of outputs, then the module's main(); its return value is
    the exit status."""
    for fd, path in zip((1, 2), outputs):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if not k.startswith("TORCHELASTIC_")})
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TORCHELASTIC_ERROR_FILE=os.path.join(scratch, f"error{rank}.json"))
    os.chdir(os.path.dirname(HERE))  # the checkout's root, where launch.torchrun starts its runs
    import torch

    torch.set_num_threads(1)
    sys.argv = [f"{module}.py", *argv]
    try:
        sys.exit(importlib.import_module(module).main() or 0)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
