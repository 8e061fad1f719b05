"""Shared test set-up: offline Hugging Face and W&B, the project root importable, CPU only."""
import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# One intra-op thread per test process, as tests/launch.py gives its ranks: the two xdist workers already
# fill the CI's 2 cores, and more threads than free cores make the in-process tests several times slower on a busy
# machine (the coordinate check: 3 s with one thread, 14 s with two, on 2 loaded cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Weights & Biases never goes online from a test, whatever the machine's settings (metrics.wandb).
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"

import fsspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core.host_memory import keep_freed_blocks  # noqa: E402
from launch import (  # noqa: E402
    DEBUG,
    GRAD_ARGS,
    REFERENCE_ARGS,
    debug_run,
    join_single_rank_group,
    made_once,
    prepared_data_dir,
    shared_root,
)
from parallel.float8 import quiet_torchao_logs  # noqa: E402
from ranks import run_ranks  # noqa: E402
from s3server import start_server  # noqa: E402

quiet_torchao_logs()  # tests import transformers, whose LlamaForCausalLM imports torchao

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
keep_freed_blocks()  # the in-process steps keep their blocks, as a CPU rank does (init_distributed)


class GradRuns:
    """grads(nproc, tp, *overrides): tests/grad_worker.py's result over launch.GRAD_ARGS, each run once per test run.

    prefetch(keys) runs every missing (nproc, tp, *overrides) of keys with one launch per world size
    (grad_worker.py --jobs, its ranks forked by tests/ranks.py): a module that compares many layouts pays its
    workers' start-up once per world size instead of once per layout. The xdist workers share the
    results (a file per key in a shared directory): a key is claimed by the first worker that needs it, and
    another worker needing it waits for that file instead of running it again (test_2d.py's 1-process
    references serve test_float8.py and test_multinode.py too).
    """

    def __init__(self, tmp_path_factory):
        self.tmp, self.cache = tmp_path_factory, {}
        self.shared = shared_root(tmp_path_factory) / "grad_runs"
        self.shared.mkdir(exist_ok=True)

    def __call__(self, nproc: int, tp: int, *overrides: str) -> dict:
        key = (nproc, tp, *overrides)
        self.prefetch([key])
        return self.cache[key]

    def _file(self, key, suffix: str = ".pt"):
        return self.shared / (hashlib.sha1(json.dumps(key).encode()).hexdigest() + suffix)

    def prefetch(self, keys) -> None:
        wanted = [k for k in dict.fromkeys(tuple(k) for k in keys) if k not in self.cache]
        mine = []
        for k in wanted:
            try:  # claim it: O_EXCL lets one worker of the run create the claim
                os.close(os.open(self._file(k, ".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                mine.append(k)
            except FileExistsError:
                pass
        try:
            self._run(mine)
        except BaseException:
            for k in mine:
                if not self._file(k).exists():
                    self._file(k, ".failed").write_text("")
            raise
        for k in wanted:  # the others' claims: wait for their results
            deadline = time.time() + 1800
            while not self._file(k).exists():
                if self._file(k, ".failed").exists():
                    raise AssertionError(f"grad_worker run {k} failed in another xdist worker (see its error)")
                assert time.time() < deadline, f"grad_worker run {k} of another xdist worker never finished"
                time.sleep(0.2)
            self.cache[k] = torch.load(self._file(k))

    def _run(self, missing) -> None:
        for nproc in sorted({k[0] for k in missing}):
            batch = [k for k in missing if k[0] == nproc]
            root = self.tmp.mktemp(f"grads_{nproc}")
            jobs = []
            for i, (_, tp, *overrides) in enumerate(batch):
                rd = root / f"job{i}"
                prepared_data_dir(rd)
                jobs.append(["--out", str(rd / "result.pt"), "--tp", str(tp), "--config", DEBUG, "--run_dir", str(rd),
                             *GRAD_ARGS, *overrides])
            with open(root / "jobs.json", "w") as f:
                json.dump(jobs, f)
            run_ranks(nproc, "grad_worker", "--jobs", str(root / "jobs.json"), timeout=180 + 60 * len(batch))
            for key, job in zip(batch, jobs):
                os.replace(job[1], self._file(key))  # whole or absent: the waiters poll for it


@pytest.fixture(scope="session")
def worker(tmp_path_factory) -> GradRuns:
    """The session's GradRuns: worker(nproc, tp, *overrides) and worker.prefetch(keys)."""
    return GradRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """An uninterrupted run with REFERENCE_ARGS on 2 ranks that keeps every checkpoint (steps 2, 4, ... 10); made
    once per test run, shared by the xdist workers. Read it, never write into it."""
    def make(ref):
        prepared_data_dir(ref)
        debug_run(2, ref, *REFERENCE_ARGS, "--checkpoint.keep", "0")
    return made_once(tmp_path_factory, "reference", make)


LONGEST_FIRST = ["test_plan.py", "test_checkpoint.py", "test_float8.py", "test_restart.py", "test_objectstore.py",
                 "test_2d.py", "test_rollback.py", "test_ladder.py", "test_downstream.py", "test_pipeline.py",
                 "test_hf.py", "test_moe.py", "test_recipe.py", "test_pretokenized.py", "test_multinode.py",
                 "test_context_parallel.py", "test_observability.py", "test_bad_input.py", "test_mixture.py",
                 "test_data.py", "test_train.py", "test_pretok_s3.py", "test_muon.py", "test_prepare_ranks.py"]
"""The test files that take longest (a quarter of a minute or more of a worker's time on 2 busy cores, measured per
file with the whole suite on 2026-12-07, the trainer's runs forked by tests/ranks.py), longest first: the workers
take them first and end on the quick files, together. A file missing here goes after them, before the files without
slow tests; when it was test_plan.py, it started 558 s into a 713 s run and ran on alone at the end."""


def pytest_configure(config):
    """Keep the order below: pytest-xdist's --dist loadfile otherwise deals the files out by their number of tests
    (--loadscope-reorder, on by default), which put test_bad_input.py's quick cases first and left one worker
    alone with test_downstream.py at the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Hand the longest files to the workers first (pytest-xdist --dist loadfile deals files out in collection
    order), so that no worker is left alone with a long file at the end. Within a file the order stays."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    slow = {item.path.name for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank) + (item.path.name not in slow)))


QUICK_LIMIT_S = float(os.environ.get("QUICK_TEST_LIMIT_S", "3"))
"""A test outside the slow mark that takes longer than this (setup + call + teardown, seconds) is named at the end
of the quick loop: mark it slow or make it smaller. Reported, never failed: timings vary with the machine's load."""

_quick_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add up each non-slow test's phases (on the xdist controller too, where the workers' reports arrive)."""
    if "slow" not in report.keywords:
        _quick_seconds[report.nodeid] = _quick_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    """In the quick loop (-m "not slow"), name the non-slow tests over QUICK_LIMIT_S, longest first."""
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    over = sorted(((s, n) for n, s in _quick_seconds.items() if s > QUICK_LIMIT_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"quick loop: {len(over)} non-slow test(s) over {QUICK_LIMIT_S:g} s: "
                                        "mark them @pytest.mark.slow or make them smaller", yellow=True)
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")


@pytest.fixture(scope="module")
def single_rank_group():
    """A 1-rank gloo process group for in-process tests of collective code (one per test module; a command run in
    this process, launch.train_in_process, leaves it and joins a new one)."""
    join_single_rank_group()
    yield
    dist.destroy_process_group()


S3_BUCKET = "tests"
"""The bucket the `s3` fixture's server holds."""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The AWS_* variables of a fresh moto_server (tests/s3server.py) with S3_BUCKET, set in this process too while
    the module runs (each test module that asks gets its own server)."""
    proc, env = start_server(S3_BUCKET)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # fsspec keeps an S3FileSystem per set of arguments, and the endpoint is not one of them: a module after another
    # module's server would reach the stopped one (through 10 retries each)
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    yield env
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.kill()
    proc.wait(timeout=30)
