"""The tests' own workers (tests/grad_worker.py, plan_worker.py, muon_worker.py, hf_import_worker.py,
small_units_prepare.py) on N ranks, each rank a process forked from a server that imported them once.

A torchrun launch of 2 ranks costs about 6 CPU-s before its first step (its agent and each rank import torch: 1.3 and
2.2 CPU-s on this machine), and the suite runs these workers on about 50 ranks in 20 launches. These workers are the
tests' instruments, not the product: the product's scripts still run under torchrun as a user runs them
(launch.torchrun; prepare.py's own launch in test_data.py). So each xdist worker starts one multiprocessing
forkserver that imports the workers' modules, and every rank is a fork of it: the same gloo process group from the
same environment variables torchrun sets (env:// on a free port), with none of the start-up. A rank's stdout and stderr go to a file, whose tail a failure shows.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from multiprocessing import forkserver
from unittest import mock

from parallel import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = ["grad_worker", "plan_worker", "muon_worker", "hf_import_worker", "small_units_prepare"]
"""The modules the server imports before it forks (torch, the trainer and the workers themselves)."""


def run_ranks(nproc: int, module: str, *args: str, timeout: float = 300) -> None:
    """tests/<module>.py's main() with sys.argv [module, *args] on nproc ranks, forked; returns once every rank
    exited 0.

    Raises AssertionError naming the rank and its output's tail when a rank exits otherwise (the others are killed),
    or past timeout seconds (every rank is killed: a hang fails).
    """
    assert module in WORKERS, f"{module} is not among the forked workers ({', '.join(WORKERS)})"
    ctx = multiprocessing.get_context("forkserver")
    _start_server()
    port, logs = distributed.free_port(), tempfile.mkdtemp(prefix=f"{module}-ranks-")
    # not daemonic: a rank may start processes of its own (inductor's compile workers, DCP's async saver); the finally
    # below kills what is left
    procs = [ctx.Process(target=_rank, args=(module, [str(a) for a in args], rank, nproc, port,
                                             os.path.join(logs, f"rank{rank}.log")))
             for rank in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    try:
        while not all(p.exitcode == 0 for p in procs):
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise AssertionError(_failure(module, failed[0], nproc, f"exited {procs[failed[0]].exitcode}", logs))
            if time.time() > deadline:
                raise AssertionError(_failure(module, 0, nproc, f"was still running after {timeout:g} s", logs))
            time.sleep(0.02)
        shutil.rmtree(logs, ignore_errors=True)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()


def _start_server() -> None:
    """Start this process's forkserver with WORKERS imported, once. Python 3.11's forkserver imports its preload
    without the parent's sys.path (it passes it, then ignores it): the server alone is started with tests/ and the
    root on PYTHONPATH, else the imports fail silently and every rank pays them."""
    multiprocessing.set_forkserver_preload(WORKERS)
    path = [HERE, os.path.dirname(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(path)):
        forkserver.ensure_running()


def _failure(module: str, rank: int, nproc: int, what: str, logs: str) -> str:
    try:
        with open(os.path.join(logs, f"rank{rank}.log"), errors="replace") as f:
            tail = f.read()[-3000:]
    except FileNotFoundError:  # it ended before its first line: multiprocessing's own error went to the server's
        tail = "(no output: see the test's captured stderr)"
    return f"{module}'s rank {rank} of {nproc} forked {what} (its output in {logs}):\n{tail}"


def _rank(module: str, argv: list[str], rank: int, world: int, port: int, log: str) -> None:
    """One rank, in the forked process: torchrun's variables, the output to log, then the module's main()."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for key in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[key]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    sys.argv = [f"{module}.py", *argv]
    try:
        importlib.import_module(module).main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
