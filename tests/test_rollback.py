"""Automatic rollback (train.rollback) against its reference: a fresh run given the recorded skips as [[train.skip]].

The fault follows the data (tests/diverge_worker.py multiplies the loss of chosen batches), so
a skipped batch never fires it; a run that rolls back by itself must then be, step for step and
weight for weight, the run that skipped the same batches from the start.
"""
from __future__ import annotations

import hashlib
import os
import re
import time

import pytest
import torch

from checkpoint import complete_checkpoints
from launch import (
    DEBUG,
    debug_run,
    kill_tree,
    losses,
    metrics,
    prepared_data_dir,
    spawn,
    torchrun_command,
    wait_for_step,
)
from test_restart import final_weights

pytestmark = pytest.mark.slow

STEPS = 16
PLAIN = ["--train.steps", str(STEPS), "--train.seed", "0", "--checkpoint.interval", "4", "--train.val_interval", "0"]
GUARD = ["--train.rollback", "3", "--train.rollback_after", "2", "--train.spike_skip", "3",
         "--train.spike_window", "4"]
FAULT = {"DIVERGE": "10-11"}  # the loss of batches 10 and 11 times 1e4 on every rank


def _run(nproc, rd, *extra, env=FAULT, **kw):
    prepared_data_dir(rd)
    return debug_run(nproc, rd, *PLAIN, *GUARD, *extra, script="tests/diverge_worker.py", env=env, **kw)


def _rollbacks(rd) -> list[dict]:
    return [r["rollback"] for r in metrics(rd) if "rollback" in r]


def _by_hand(tmp_path, rd_name, skips, nproc=1):
    """The reference: train_fsdp.py without the guard, with the skips as [[train.skip]] tables (and the fault)."""
    config = tmp_path / f"{rd_name}.toml"
    config.write_text(open(DEBUG).read() + "".join(f"\n[[train.skip]]\nstart_step = {a}\nend_step = {b}\n"
                                                   for a, b in skips))
    rd = tmp_path / rd_name
    prepared_data_dir(rd)
    debug_run(nproc, rd, *PLAIN, "--config", str(config), script="tests/diverge_worker.py", env=FAULT)
    return rd


def _assert_same(rd, reference, rtol):
    want, got = losses(reference), losses(rd)
    assert [r["step"] for r in metrics(rd) if "loss" in r][-STEPS:] == list(range(1, STEPS + 1))
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(want) == sorted(got)
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in want)
    assert worst <= rtol, worst
    a, b = final_weights(rd), final_weights(reference)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    rd = tmp_path_factory.mktemp("rollback") / "one"
    _run(1, rd)
    return rd


def test_rollback_equals_a_fresh_run_with_its_skips_by_hand(one_rank, tmp_path):
    """The outliers of batches 10 and 11 roll back to step 8 and skip batches 9-11; 1 rank at 1e-6, 2 ranks at 1e-4."""
    records = _rollbacks(one_rank)
    assert records and records[0]["to_step"] == 8 and records[0]["skip"] == [9, 11], records
    assert "outliers in a row" in records[0]["trigger"]
    assert [r["step"] for r in metrics(one_rank) if "rollback" in r][0] == 11
    reference = _by_hand(tmp_path, "by_hand", [r["skip"] for r in records])
    _assert_same(one_rank, reference, 1e-6)
    two = tmp_path / "two"
    _run(2, two)
    assert _rollbacks(two) == records
    _assert_same(two, reference, 1e-4)


def test_sigkill_after_a_rollback_then_resume_ends_as_the_uninterrupted_run(one_rank, tmp_path):
    rd = tmp_path / "killed"
    prepared_data_dir(rd)
    cmd = torchrun_command(1, "tests/diverge_worker.py", "--config", DEBUG, "--run_dir", rd, *PLAIN, *GUARD)
    proc = spawn(cmd, tmp_path / "log", env=FAULT)
    try:
        wait_for_step(rd, 13, proc)  # past the rollback at step 11 and the checkpoint of step 12 that records it
    finally:
        kill_tree(proc.pid)
        proc.wait()
    _run(1, rd)
    assert _rollbacks(rd) == _rollbacks(one_rank)
    _assert_same(rd, one_rank, 1e-6)


def test_nan_on_one_rank_rolls_back_every_rank_and_a_spent_budget_stops_with_one_line(one_rank, tmp_path):
    """NaN in rank 1's loss of batches 10, 12 and 13, a budget of 1 and an LR factor of 0.5: a rollback to step 8
    skipping batches 9-10 on both ranks, step 9 at half the schedule's LR, then batch 12 diverges again at step
    10: exit status 2, one line naming step 8's checkpoint, the checkpoints untouched."""
    rd = tmp_path / "nan"
    prepared_data_dir(rd)
    cmd = torchrun_command(2, "tests/diverge_worker.py", "--config", DEBUG, "--run_dir", rd, *PLAIN, *GUARD,
                           "--train.rollback", "1", "--train.rollback_lr_factor", "0.5")
    proc = spawn(cmd, tmp_path / "log", env={"DIVERGE": "10-10,12-13:1:nan"})
    root = str(rd / "checkpoints")
    try:
        deadline = time.time() + 240
        while not (os.path.exists(rd / "metrics.jsonl") and _rollbacks(rd)) and time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.01)
        at_rollback = {c: _tree_hash(path) for c, path in complete_checkpoints(root)}
        proc.wait(timeout=240)  # no rank waits forever
    finally:
        kill_tree(proc.pid)
    out = (tmp_path / "log").read_text()
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*2", out), out[-3000:]
    assert [r["skip"] for r in _rollbacks(rd)] == [[9, 10]] and "non-finite" in _rollbacks(rd)[0]["trigger"]
    lr = {r["step"]: r["lr"] for r in metrics(rd) if "loss" in r}
    want = {r["step"]: r["lr"] for r in metrics(one_rank) if "loss" in r}  # the same schedule, no factor
    assert max(lr) == 9 and lr[9] == pytest.approx(0.5 * want[9], rel=1e-12) and lr[8] == want[8]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "step 10: non-finite gradient norm" in errors[0], errors
    assert "rollback budget is spent (train.rollback 1; 1 made, skipping data steps 9-10)" in errors[0]
    assert "add [[train.skip]] start_step = 12, end_step = 12 (the batches of steps 10-10)" in errors[0]
    assert "step_00000008 (step 8)" in errors[0]
    assert list(at_rollback) == [4, 8] and {c: _tree_hash(p) for c, p in complete_checkpoints(root)} == at_rollback


def _tree_hash(path) -> str:
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_a_divergence_before_the_first_checkpoint_stops_with_the_table_that_skips_it(tmp_path):
    rd = tmp_path / "early"
    proc = _run(1, rd, env={"DIVERGE": "2-3::nan"}, check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: step 2: non-finite gradient norm"), errors
    assert "no checkpoint in" in errors[0] and "add [[train.skip]] start_step = 2, end_step = 2" in errors[0]
    config = tmp_path / "fixed.toml"
    config.write_text(open(DEBUG).read() + "\n[[train.skip]]\nstart_step = 2\nend_step = 3\n")
    _run(1, rd, "--config", str(config), env={"DIVERGE": "2-3::nan"})  # the fix it names, then the same command
    assert max(losses(rd)) == STEPS and not any("non-finite" in r["trigger"] for r in _rollbacks(rd))
