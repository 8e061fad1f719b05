"""A real multi-node launch on one machine: scripts/slurm_train.sh's own command, started twice as
SLURM's srun would start it on two nodes (two torchrun agents meeting in a c10d rendezvous, each
with two workers: RANK differs from LOCAL_RANK), trains the same run as one process and as one
agent with four workers."""
import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

from launch import DEBUG, GRAD_ARGS, ROOT, kill_tree, losses, prepared_data_dir, spawn, wait_for_step
from parallel import distributed


def slurm_command(script: str, run_dir, *args: str, nodes: int = 2, nproc_per_node: int = 2) -> list[str]:
    """The command scripts/slurm_train.sh --dry-run builds for each node, with a free rendezvous port here."""
    env = {**os.environ, "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": "4242", "HEAD_NODE": "127.0.0.1",
           "RDZV_PORT": str(distributed.free_port()), "NPROC_PER_NODE": str(nproc_per_node)}
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_train.sh"), "--dry-run", script, DEBUG,
                          str(run_dir), *args], capture_output=True, text=True, env=env, timeout=30, check=True,
                         cwd=ROOT)
    return shlex.split(out.stdout.strip().splitlines()[-1])


def test_the_slurm_script_builds_one_rendezvous_command_for_every_node(tmp_path):
    cmd = slurm_command("train_2d.py", tmp_path / "my run", "--parallel.tp", "2")
    assert cmd[:2] == ["srun", "--kill-on-bad-exit=1"]
    torchrun = cmd[cmd.index("torchrun"):]
    assert torchrun[1:6] == ["--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                             torchrun[4], "--rdzv-id=4242"] and torchrun[4].startswith("--rdzv-endpoint=127.0.0.1:")
    assert not any(a.startswith("--node_rank") for a in torchrun)  # the rendezvous numbers the nodes
    assert torchrun[-7:] == ["train_2d.py", "--config", DEBUG, "--run_dir", str(tmp_path / "my run"),
                             "--parallel.tp", "2"]


@pytest.mark.parametrize("args, message", [
    (["--dry-run"], "error: usage: slurm_train.sh"),
    (["--dryrun", "train_fsdp.py", DEBUG, "RUN"], "error: unknown option '--dryrun'"),
    (["train_fsdp.py", DEBUG, "RUN", "--dry-run"], "error: --dry-run goes first"),
    (["train_fspd.py", DEBUG, "RUN"], "error: SCRIPT 'train_fspd.py' not found"),
    (["train_fsdp.py", "nope.toml", "RUN"], "error: CONFIG 'nope.toml' not found"),
], ids=["too_few", "unknown_option", "dry_run_late", "no_script", "no_config"])
def test_bad_slurm_script_arguments_are_one_line_and_touch_nothing(tmp_path, args, message):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "exit.json").write_text('{"exit_status": 0}')
    env = {**os.environ, "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "HEAD_NODE": "127.0.0.1"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_train.sh"),
                           *[str(rd) if a == "RUN" else a for a in args]],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert (rd / "exit.json").read_text() == '{"exit_status": 0}' and not proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script, overrides, one_agent", [
    # A replica per node (HSDP's all-reduce crosses the nodes) and a TP group inside each node: both kinds of group
    # that a node boundary splits or keeps whole, in one launch (test_2d.py's hsdp2x1xtp2 key is the one agent's run).
    ("train_2d.py", ("--parallel.dp_replicate", "2", "--parallel.tp", "2"), (4, 2, "--parallel.dp_replicate", "2")),
], ids=["hsdp_x_tp_2nodes"])
def test_two_agents_as_two_nodes_train_the_same_run_as_one(tmp_path, worker, script, overrides, one_agent):
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    cmd = slurm_command(script, rd, *GRAD_ARGS, *overrides)
    cmd = cmd[cmd.index("--kill-on-bad-exit=1") + 1:]  # what srun runs on each node
    cmd[cmd.index("torchrun"):cmd.index("torchrun") + 1] = [sys.executable, "-m", "torch.distributed.run"]
    nodes = [spawn(cmd, tmp_path / f"node{i}.log") for i in range(2)]
    try:
        rcs = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert rcs == [0, 0], "\n".join(log[-2000:] for log in logs)
    got = losses(rd)
    for name, ref in [("1 process", worker(1, 1)), ("1 agent of 4 workers", worker(*one_agent))]:
        for step, want in enumerate(ref["losses"], start=1):
            assert abs(got[step] - want) / want <= 1e-5, f"step {step} vs {name}"


@pytest.mark.slow
def test_the_slurm_script_exits_0_after_sigterm_although_torchrun_exits_1(tmp_path):
    # srun is SLURM's: on this machine a stand-in runs its command as srun runs it on one node.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nshift  # --kill-on-bad-exit=1\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    (rd / "exit.json").write_text('{"exit_status": 0}')  # an earlier run's record must not speak for this one
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "HEAD_NODE": "127.0.0.1",
           "RDZV_PORT": str(distributed.free_port()), "NPROC_PER_NODE": "2", "MAX_RESTARTS": "0"}
    script = ["bash", os.path.join(ROOT, "scripts", "slurm_train.sh"), "train_fsdp.py", DEBUG, str(rd),
              "--train.steps", "200", "--checkpoint.interval", "1000", "--train.val_interval", "0"]
    p = spawn(script, tmp_path / "job.log", env=env)
    try:
        wait_for_step(rd, 2, p)
        os.killpg(p.pid, signal.SIGTERM)  # as scancel signals the batch script and its job step
        rc = p.wait(timeout=180)
    finally:
        kill_tree(p.pid)
    log = (tmp_path / "job.log").read_text()
    assert "SIGTERM: saved step" in log, log[-3000:]
    assert "SignalException" in log  # torchrun's agent did exit with its own status 1 ...
    assert rc == 0, log[-3000:]  # ... and the script exits with the trainer's
    record = json.loads((rd / "exit.json").read_text())
    assert record["status"] == "stopped" and record["signal"] == "SIGTERM" and 2 <= record["step"] < 200
