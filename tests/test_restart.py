"""Runs that survive a dead or a hung rank: torchrun --max-restarts restarts the group and the run
resumes by itself to the uninterrupted run's losses and weights; a hung peer stops the others
within train.collective_timeout_s with one line, its last checkpoint intact."""
import os
import random
import signal
import time

import pytest
import torch

from checkpoint import complete_checkpoints, read_model_weights
from launch import (
    DEBUG,
    REFERENCE_ARGS,
    alive,
    debug_run,
    losses,
    metrics,
    prepared_data_dir,
    spawn,
    torchrun_command,
    wait_for_step,
    wait_until_unlocked,
    workers,
)
from model import PRESETS, ModelArgs, Transformer

STEPS = 10  # REFERENCE_ARGS's; checkpoints every 2 steps


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    sd = Transformer(ModelArgs(**PRESETS["debug"])).state_dict()
    read_model_weights(complete_checkpoints(os.path.join(str(run_dir), "checkpoints"))[-1][1], sd)
    return sd


def assert_same_run(rd, reference):
    """rd logged each step once, with the reference's losses, and ends with the reference's weights."""
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, STEPS + 1))
    want, got = losses(reference), losses(rd)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    print(f"max relative loss difference vs the uninterrupted run {worst:.1e}")
    assert worst <= 1e-6, f"max relative loss difference {worst:.2e}"
    ref_weights, weights = final_weights(reference), final_weights(rd)
    assert all(torch.equal(weights[k], v) for k, v in ref_weights.items())


def start_reference_run(tmp_path, script: str, max_restarts: int, env: dict | None = None):
    """(run dir, torchrun process): the conftest reference run's arguments on 2 ranks under --max-restarts."""
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    proc = spawn(torchrun_command(2, script, "--config", DEBUG, "--run_dir", rd, *REFERENCE_ARGS,
                                  launcher=("--standalone", f"--max-restarts={max_restarts}")),
                 tmp_path / "log.txt", env=env)
    return rd, proc


@pytest.mark.slow
def test_a_rank_killed_at_a_random_step_is_restarted_and_the_run_resumes_by_itself(tmp_path, reference):
    # From outside, as the OOM killer or a lost GPU would.
    rd, proc = start_reference_run(tmp_path, "train_fsdp.py", max_restarts=1)
    kill_step = random.Random().randint(3, 8)
    wait_for_step(rd, kill_step, proc)
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    print(f"rank 1 SIGKILLed once step {kill_step} was logged")
    assert_restarted_and_resumed(proc, tmp_path / "log.txt", 1)
    assert_same_run(rd, reference)


@pytest.mark.slow
def test_ranks_killed_inside_checkpoint_saves_are_restarted_and_resume_from_complete_ones(tmp_path, reference):
    # Attempt 0: rank 1 dies as the save of step 4 starts (rank 0 waits inside DCP's save);
    # attempt 1: rank 0 dies with step 8 written but not committed. See tests/fault_worker.py.
    rd, proc = start_reference_run(tmp_path, "tests/fault_worker.py", max_restarts=2,
                                   env={"FAULT": "1:4:write,0:8:commit"})
    resumed = assert_restarted_and_resumed(proc, tmp_path / "log.txt", 2)
    assert [os.path.basename(p) for p in resumed] == ["step_00000002", "step_00000006"]
    assert_same_run(rd, reference)


def assert_restarted_and_resumed(proc, log_path, restarts: int) -> list[str]:
    """The torchrun run ended well after `restarts` restarts, each resuming; returns the checkpoints resumed from."""
    rc = proc.wait(timeout=300)
    log = log_path.read_text()
    assert rc == 0, log[-3000:]
    resumed = [line.split("resumed from ")[1].split(" at step")[0] for line in log.splitlines()
               if line.startswith("[train] mesh") and "resumed from" in line]
    assert len(resumed) == restarts, f"expected {restarts} resumes, got {resumed}:\n{log[-3000:]}"
    print("resumed from", resumed)
    return resumed


@pytest.mark.slow
def test_a_hung_rank_stops_its_peers_within_the_timeout_and_its_checkpoint_resumes(tmp_path, reference):
    rd, timeout_s = tmp_path / "run", 5
    prepared_data_dir(rd)
    proc = spawn(torchrun_command(2, "train_fsdp.py", "--config", DEBUG, "--run_dir", rd, *REFERENCE_ARGS,
                                  "--train.collective_timeout_s", str(timeout_s)), tmp_path / "log.txt")
    wait_for_step(rd, 3, proc)
    ranks = workers(proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)  # alive, holding its connections, answering nothing
    stopped = time.monotonic()
    while alive(ranks[0]) and time.monotonic() - stopped < 120:
        time.sleep(0.05)
    waited = time.monotonic() - stopped
    os.kill(ranks[1], signal.SIGKILL)  # torchrun would wait 30 s for the stopped rank's SIGTERM
    proc.wait(timeout=120)
    print(f"rank 0 exited {waited:.1f} s after rank 1 was stopped (collective_timeout_s {timeout_s})")
    assert waited <= timeout_s + 20, f"rank 0 exited {waited:.1f} s after its peer stopped"
    errors = [line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 0: a peer rank stopped answering for train.collective_timeout_s (5 s)" \
        in errors[0], errors
    assert errors[0].startswith("error: after step "), errors
    # The checkpoint it names is whole: the same command resumes from it to the uninterrupted run.
    named = errors[0].split("newest complete checkpoint is ")[1].split(";")[0]
    assert named == complete_checkpoints(str(rd / "checkpoints"))[-1][1]
    debug_run(2, rd, *REFERENCE_ARGS)
    assert_same_run(rd, reference)


@pytest.mark.slow
def test_workers_whose_agent_is_sigkilled_stop_within_seconds_and_the_checkpoint_stays_whole(tmp_path, reference):
    """A SIGKILL of the torchrun agent alone (a lost agent, a scheduler killing only the launcher): its workers, in
    sessions of their own, must not train on; the newest committed checkpoint resumes to the uninterrupted run."""
    rd, proc = start_reference_run(tmp_path, "train_fsdp.py", max_restarts=0)
    wait_for_step(rd, 3, proc)
    ranks = workers(proc.pid)
    assert len(ranks) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while any(alive(pid) for pid in ranks.values()) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    gone = time.monotonic() - killed
    for pid in ranks.values():  # do not leave them to the next test
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    print(f"workers gone {gone:.2f} s after their agent was SIGKILLed")
    assert gone <= 10, f"the workers outlived their agent by {gone:.1f} s"
    assert complete_checkpoints(str(rd / "checkpoints"))
    # The run dir's lock can outlast the workers by a moment (once, in CI: refused as "in use" 0.05 s after they were
    # gone); within seconds, as the workers themselves.
    wait_until_unlocked(rd, timeout=10)
    debug_run(2, rd, *REFERENCE_ARGS)
    assert_same_run(rd, reference)
