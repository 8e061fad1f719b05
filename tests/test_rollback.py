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

import diverge_worker
from checkpoint import complete_checkpoints
from data_pipeline.loader import GlobalBatchLoader
from launch import (
    DEBUG,
    debug_run,
    debug_run_in_process,
    kill_tree,
    losses,
    metrics,
    prepared_data_dir,
    spawn,
    start,
    torchrun_command,
    wait_for_step,
    wait_until_unlocked,
)
from parallel import runner as runner_module
from test_restart import final_weights

pytestmark = pytest.mark.slow

STEPS = 16
# A batch of 4 (the debug config's is 16): the fault follows the data, not the batch size, so a quarter of the work
# per step gives the same rollbacks.
PLAIN = ["--train.steps", str(STEPS), "--train.seed", "0", "--checkpoint.interval", "4", "--train.val_interval", "0",
         "--train.global_batch_size", "4"]
GUARD = ["--train.rollback", "3", "--train.rollback_after", "2", "--train.spike_skip", "3",
         "--train.spike_window", "4", "--train.rollback_margin", "2"]
FAULT = {"DIVERGE": "10-13,20-21"}  # the loss of batches 10-13 and 20-21 times 1e4 on every rank
TABLE = re.compile(r"\[\[train\.skip\]\] start_step = (\d+), end_step = (\d+)")


def _run(nproc, rd, *extra, env=FAULT, **kw):
    prepared_data_dir(rd)
    return debug_run(nproc, rd, *PLAIN, *GUARD, *extra, script="tests/diverge_worker.py", env=env, **kw)


def _run_here(capsys, rd, *extra, env=FAULT, check=True):
    """_run(1, rd, ...) in this process: _diverging."""
    prepared_data_dir(rd)
    return _diverging(capsys, env, rd, *PLAIN, *GUARD, *extra, check=check)


def _diverging(capsys, env, rd, *args, check=True):
    """tests/diverge_worker.py's 1-rank run of the debug config with args, in this process: its patches
    (diverge_worker.inject of env["DIVERGE"]) around train_fsdp.main (launch.debug_run_in_process), then undone."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(GlobalBatchLoader, "next_step", GlobalBatchLoader.next_step)  # restored on leaving the block
        m.setattr(runner_module, "token_loss_sums", runner_module.token_loss_sums)
        diverge_worker.inject(env["DIVERGE"])
        return debug_run_in_process(m, capsys, rd, *args, check=check)


def _rollbacks(rd) -> list[dict]:
    return [r["rollback"] for r in metrics(rd) if "rollback" in r]


def _with_tables(path, skips):
    """configs/debug.toml with the skips appended as [[train.skip]] tables, written to path; returns path."""
    path.write_text(open(DEBUG).read() + "".join(f"\n[[train.skip]]\nstart_step = {a}\nend_step = {b}\n"
                                                 for a, b in skips))
    return path


def _by_hand(capsys, tmp_path, rd_name, skips, *extra, env=FAULT):
    """The reference: train_fsdp.py without the guard, with the skips as [[train.skip]] tables (and the fault), on 1
    rank in this process."""
    config = _with_tables(tmp_path / f"{rd_name}.toml", skips)
    rd = tmp_path / rd_name
    prepared_data_dir(rd)
    _diverging(capsys, env, rd, *PLAIN, *extra, "--config", str(config))
    return rd


def _stop_line(proc) -> str:
    """The one 'error: ' line of a run that stopped (exit status 2)."""
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, out[-3000:]
    return errors[0]


def _assert_same(rd, reference, rtol, steps=STEPS):
    want, got = losses(reference), losses(rd)
    assert [r["step"] for r in metrics(rd) if "loss" in r][-steps:] == list(range(1, steps + 1))
    assert sorted(got) == list(range(1, steps + 1)) and sorted(want) == sorted(got)
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in want)
    assert worst <= rtol, worst
    a, b = final_weights(rd), final_weights(reference)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    rd = tmp_path_factory.mktemp("rollback") / "one"
    _run_here(None, rd)
    return rd


def test_rollback_equals_a_fresh_run_with_its_skips_by_hand(one_rank, tmp_path, capsys):
    """Three rollbacks, nested and disjoint: the outliers of batches 10-11 go back to step 8 and skip 9-11; batches 12-13,
    the next two drawn, go back further, to step 4, skipping 5-13 (which holds 9-11); batches 20-21 then go back to
    step 8 again, skipping 18-21. The three records pasted verbatim as [[train.skip]] tables are the same run: 1 rank
    at 1e-6, 2 ranks at 1e-4."""
    records = _rollbacks(one_rank)
    assert [(r["to_step"], r["skip"]) for r in records] == [(8, [9, 11]), (4, [5, 13]), (8, [18, 21])], records
    assert all("outliers in a row" in r["trigger"] for r in records)
    assert [r["step"] for r in metrics(one_rank) if "rollback" in r] == [11, 10, 12]
    reference = _by_hand(capsys, tmp_path, "by_hand", [r["skip"] for r in records])
    _assert_same(one_rank, reference, 1e-6)
    two = tmp_path / "two"
    _run(2, two)
    assert _rollbacks(two) == records
    _assert_same(two, reference, 1e-4)


def test_sigkill_after_a_rollback_then_resume_ends_as_the_uninterrupted_run(one_rank, tmp_path, capsys):
    rd = tmp_path / "killed"
    prepared_data_dir(rd)
    proc = start(1, "tests/diverge_worker.py", "--config", DEBUG, "--run_dir", rd, *PLAIN, *GUARD,
                 log_path=tmp_path / "log", env=FAULT)
    try:
        wait_for_step(rd, 13, proc)  # past the third rollback (at step 12) and the checkpoint of step 12 after it
    finally:
        proc.kill()
    wait_until_unlocked(rd)  # its workers are gone: the resume starts at once, in this process
    _run_here(capsys, rd)
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
    assert ("rollback budget is spent (train.rollback 1; 1 made); data steps skipped: 9-10 by rollbacks, none by "
            "[[train.skip]]") in errors[0]
    # Step 8's checkpoint predates the rollback: the remedy carries its skip too.
    assert ("add [[train.skip]] start_step = 9, end_step = 10 (a rollback's skip) and [[train.skip]] start_step = 12, "
            "end_step = 12 (the batches of steps 10-10) to the --config file and run the same command") in errors[0]
    assert "resumes from the newest good checkpoint, " in errors[0] and "step_00000008 (step 8)" in errors[0]
    assert list(at_rollback) == [4, 8] and {c: _tree_hash(p) for c, p in complete_checkpoints(root)} == at_rollback


def _tree_hash(path) -> str:
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _apply_remedy(capsys, tmp_path, rd, line, argv, env, steps=STEPS):
    """The stop's remedy as printed: its [[train.skip]] tables added to the config, then the same command; returns
    the tables."""
    tables = [(int(a), int(b)) for a, b in TABLE.findall(line.split(" add ", 1)[1])]
    assert tables and "to the --config file and run the same command" in line, line
    config = _with_tables(tmp_path / "remedy.toml", tables)
    _run_here(capsys, rd, *argv, "--config", str(config), "--train.steps", str(steps), env=env)
    return tables


def test_a_spent_budget_names_the_checkpoint_the_next_run_resumes_from(tmp_path, capsys):
    """The issue's run: batches 7-8 roll back to step 3 (budget 1, margin 2), skipping 4-8; then batch 20, at step
    15, is an outlier trained through and saved in step 15's checkpoint, and batch 21 diverges at step 16. The stop
    names step 12 and moves step 15 aside; its remedy applied as printed is a fresh run given its tables."""
    rd, argv = tmp_path / "spent", ["--train.rollback", "1", "--checkpoint.interval", "3", "--checkpoint.keep", "0"]
    env = {"DIVERGE": "7-8,20-21"}
    line = _stop_line(_run_here(capsys, rd, *argv, env=env, check=False))
    root = str(rd / "checkpoints")
    aside = os.path.join(root, "diverged_at_step_16")
    assert line.startswith("error: step 16: 2 outliers in a row"), line
    assert ("data steps skipped: 4-8 by rollbacks, none by [[train.skip]]; the next run resumes from the newest good "
            f"checkpoint, {root}/step_00000012 (step 12): the checkpoints after step 12 (step 15) were moved to {aside}; add "
            "[[train.skip]] start_step = 4, end_step = 8 (a rollback's skip) and [[train.skip]] start_step = 20, "
            "end_step = 21 (the batches of steps 15-16) to the --config file") in line, line
    assert [c for c, _ in complete_checkpoints(root)] == [3, 6, 9, 12]
    assert [c for c, _ in complete_checkpoints(aside)] == [15]  # kept whole, where no resume looks
    tables = _apply_remedy(capsys, tmp_path, rd, line, argv, env)
    assert not [r for r in _rollbacks(rd) if r["to_step"] >= 12]
    _assert_same(rd, _by_hand(capsys, tmp_path, "by_hand", tables, env=env), 1e-6)


def test_a_divergence_before_the_first_usable_checkpoint_stops_and_the_next_run_starts_over(tmp_path, capsys):
    """Batch 5 is an outlier trained through and saved in step 5's checkpoint; batch 6 diverges at step 6, and no
    checkpoint is from step 3 or before. The stop moves step 5 aside; its remedy applied as printed (8 steps) is a
    fresh run given its table."""
    rd, argv, env, steps = tmp_path / "early", ["--checkpoint.interval", "5"], {"DIVERGE": "5-6"}, 8
    line = _stop_line(_run_here(capsys, rd, *argv, "--train.steps", str(steps), env=env, check=False))
    root = str(rd / "checkpoints")
    assert line.startswith("error: step 6: 2 outliers in a row"), line
    assert (f"no checkpoint in {root} is from step 3 or before (the first outlier, step 5, minus "
            f"train.rollback_margin) to roll back to: the next run starts from step 0; the run's checkpoints (step 5) "
            f"were moved to {root}/diverged_at_step_6; add [[train.skip]] start_step = 5, end_step = 6 (the "
            f"batches of steps 5-6) to the --config file and run the same command") in line, line
    assert complete_checkpoints(root) == []
    tables = _apply_remedy(capsys, tmp_path, rd, line, argv, env, steps)
    assert not _rollbacks(rd)
    _assert_same(rd, _by_hand(capsys, tmp_path, "by_hand", tables, "--train.steps", str(steps), env=env), 1e-6, steps)
