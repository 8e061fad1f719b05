"""checkpoint.py: every piece of state round-trips; a crash mid-run resumes to the same losses;
resume at another world size; half-written checkpoints are skipped; async = sync; keep-k; SIGTERM."""
import json
import os
import random
import shutil
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint as ckpt_lib
from config import parse_config
from core.errors import UserError
from launch import (
    DEBUG,
    REFERENCE_ARGS,
    debug_run,
    debug_run_in_process,
    losses,
    main_in_process,
    metrics,
    prepared_data_dir,
    run,
    spawn,
    start,
    torchrun_command,
    wait_for_step,
)
from training.session import build
from training.step import train_step


def _session(run_dir, *overrides):
    prepared_data_dir(run_dir)
    cfg = parse_config(["--config", DEBUG, "--run_dir", str(run_dir), "--train.steps", "50",
                                   "--checkpoint.keep", "0", *overrides])
    return build(cfg, 0, 1, torch.device("cpu"))


def _steps(s, n):
    for _ in range(n):
        train_step(s, s.loader.next_step())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same_state(a, b):
    for (n1, p1), (n2, p2) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n1 == n2 and torch.equal(_full(p1), _full(p2)), n1
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name in sa["state"][k]:
            assert torch.equal(_full(sa["state"][k][name]), _full(sb["state"][k][name])), (k, name)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    assert a.train_state == b.train_state
    assert a.loader.state == b.loader.state


WARMUP = ("--optim.warmup_steps", "4")
"""The round trip's warmup: 4 steps (the debug config's 20), so that a save after it costs 5 steps, not 25."""


@pytest.mark.parametrize("steps", [0, 3, 5])  # before the first step, in warmup, after it
@pytest.mark.slow
def test_every_piece_of_state_round_trips(tmp_path, single_rank_group, steps):
    a = _session(tmp_path / "a", *WARMUP)
    _steps(a, steps)
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    a.ckpt.save(steps, a.app)
    torch.rand(10)  # move the RNG on: the load must bring it back
    b = _session(tmp_path / "a", *WARMUP)  # same run directory: resumes from the checkpoint just written
    assert b.resumed_from.endswith(f"step_{steps:08d}")
    _assert_same_state(a, b)
    assert torch.equal(torch.get_rng_state(), rng_before)
    # And the next step is the same step on both.
    _steps(a, 1)
    _steps(b, 1)
    _assert_same_state(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("parametrization", [
    ("--model.parametrization", "completep", "--model.base_dim", "32", "--model.base_n_layers", "1"),
    ("--model.parametrization", "mup", "--model.base_dim", "32", "--optim.name", "muon"),
], ids=["completep", "mup_muon"])
def test_mup_and_completep_state_round_trips_and_the_run_continues_exactly(tmp_path, single_rank_group,
                                                                           parametrization):
    """A resumed mup/completep run has the saved run's every state and per-group LR, and its next steps are exact."""
    a = _session(tmp_path / "a", *parametrization)
    _steps(a, 3)
    a.ckpt.save(3, a.app)
    b = _session(tmp_path / "a", *parametrization)
    assert len({g["lr"] for g in b.optimizer.param_groups}) == 2  # the width's LR multiplier is in force
    _assert_same_state(a, b)
    _steps(a, 2)
    _steps(b, 2)
    _assert_same_state(a, b)


@pytest.mark.slow
def test_async_save_equals_sync_save_even_when_training_goes_on(tmp_path, single_rank_group):
    sync = _session(tmp_path / "sync")
    _steps(sync, 2)
    sync.ckpt.save(2, sync.app)
    asy = _session(tmp_path / "async", "--checkpoint.async_save", "true")
    _steps(asy, 2)
    asy.ckpt.save(2, asy.app)
    _steps(asy, 2)  # mutates parameters and optimizer state while the save may still be writing
    asy.ckpt.wait()
    out = {}
    for name in ("sync", "async"):
        dcp_to_torch_save(str(tmp_path / name / "checkpoints" / "step_00000002"), str(tmp_path / f"{name}.pt"))
        out[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)["app"]
    for part in ("model", "optim", "scheduler", "train", "data"):
        assert _flatten(out["sync"][part]).keys() == _flatten(out["async"][part]).keys()
        for k, v in _flatten(out["sync"][part]).items():
            w = _flatten(out["async"][part])[k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (part, k)


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update(_flatten(dict(enumerate(v)), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.slow
def test_half_written_checkpoints_are_skipped_and_keep_k_leaves_k(tmp_path, single_rank_group):
    rd = tmp_path / "run"
    s = _session(rd, "--checkpoint.keep", "2")
    for step in (1, 2, 3, 4):
        _steps(s, 1)
        s.ckpt.save(step, s.app)
    root = rd / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000004"]
    # A crash between the ranks' writes and the commit leaves a .tmp directory, possibly with a
    # .metadata already written; a directory without .metadata is incomplete too.
    shutil.copytree(root / "step_00000004", root / "step_00000009.tmp")
    (root / "step_00000008").mkdir()
    (root / "step_00000008" / "__0_0.distcp").write_bytes(b"partial")
    again = _session(rd, "--checkpoint.keep", "2")
    assert again.resumed_from.endswith("step_00000004") and again.train_state.step == 4
    assert not (root / "step_00000009.tmp").exists()  # cleaned on start


def test_checkpoint_of_another_model_names_keys_and_shapes(tmp_path, single_rank_group):
    rd = tmp_path / "run"
    s = _session(rd)
    s.ckpt.save(0, s.app)
    shapes = {k: v.shape for k, v in s.model.state_dict().items()}
    shapes["tok_embeddings.weight"] = torch.Size([8192, 128])
    with pytest.raises(ckpt_lib.CheckpointError, match=r"tok_embeddings.weight: checkpoint \(4096, 128\) vs model \(8192, 128\)"):
        ckpt_lib.check_compatible(str(rd / "checkpoints" / "step_00000000"), shapes)
    with pytest.raises(ckpt_lib.CheckpointError, match="no .metadata"):
        ckpt_lib.read_metadata(str(tmp_path))
    with pytest.raises(ckpt_lib.CheckpointError, match="it does not exist; give a checkpoint folder, e.g. RUN_DIR/"):
        ckpt_lib.read_metadata(str(tmp_path / "nope"))


@pytest.mark.slow
def test_a_checkpoint_of_another_model_stops_the_run_before_anything_is_overwritten(tmp_path, reference):
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    for step in ("step_00000002", "step_00000004"):  # the conftest reference's, of model.n_layers 4
        shutil.copytree(reference / "checkpoints" / step, rd / "checkpoints" / step)
    for f in ("config.toml", "metrics.jsonl"):  # what a run that went on would rewrite first
        shutil.copy(reference / f, rd / f)
    before = {p: os.path.getmtime(p) for p in _files(rd)}
    proc = debug_run(2, rd, "--train.steps", "4", "--model.n_layers", "2", check=False, timeout=120)
    assert proc.returncode != 0
    # The differing model.* field is named (shapes are compared too, for checkpoints without a config.toml).
    assert "saved with other settings (model.n_layers: checkpoint 4, now 2)" in proc.stderr, proc.stderr[-2000:]
    assert {p: os.path.getmtime(p) for p in _files(rd)} == before


def _files(rd):
    """Every file of a run directory but its lock (rewritten by whichever run takes it)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(rd) for f in fs if f != ".lock")


COMMON = REFERENCE_ARGS  # the conftest `reference` run's


def _kill_after(rd, nproc, step, sig, *extra):
    args, log = ["--config", DEBUG, "--run_dir", rd, *COMMON, *extra], rd.parent / f"{rd.name}.log"
    # SIGKILL hits every rank, as a node failure would (forked ranks: the checkpoint is the subject, not the agent);
    # SIGTERM/SIGINT torchrun's group, as a scheduler or a terminal does (torchrun forwards them to its workers).
    if sig == signal.SIGKILL:
        p = start(nproc, "train_fsdp.py", *args, log_path=log)
        wait_for_step(rd, step, p)
        p.kill()
    else:
        p = spawn(torchrun_command(nproc, "train_fsdp.py", *args), log)
        wait_for_step(rd, step, p)
        os.killpg(p.pid, sig)
    return p.wait(timeout=120)


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_gives_the_uninterrupted_losses(tmp_path, reference):
    rd = tmp_path / "killed"
    prepared_data_dir(rd)
    kill_step = random.Random().randint(3, 7)
    rc = _kill_after(rd, 2, kill_step, signal.SIGKILL)
    assert rc != 0, "the run finished before it was killed"
    debug_run(2, rd, *COMMON)
    want, got = losses(reference), losses(rd)
    # The killed run logged steps past its last checkpoint: the resume dropped them, one record per step.
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, 11))
    assert max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-6, f"killed after step {kill_step}"


def _requeue_reads_a_clean_stop(rc: int, rd) -> bool:
    """docs/cluster.md's rule, as a requeue loop applies it: a non-zero status with an exit.json naming a signal."""
    path = rd / "exit.json"
    return rc != 0 and path.exists() and json.loads(path.read_text())["signal"] is not None


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path, reference, monkeypatch, capsys):
    rd = tmp_path / "term"
    prepared_data_dir(rd)
    _kill_after(rd, 2, 3, signal.SIGTERM, "--checkpoint.interval", "1000")
    # torchrun's agent reports the signal with its own exit status; the workers stop cleanly.
    assert "SIGTERM: saved step" in (tmp_path / "term.log").read_text()
    saved = ckpt_lib.complete_checkpoints(str(rd / "checkpoints"))
    assert saved and saved[-1][0] == max(r["step"] for r in metrics(rd))
    assert _requeue_reads_a_clean_stop(1, rd)  # torchrun's status after forwarding the signal
    # A requeued start refused for bad input (a typo in a value, then in a flag) must not read as that clean stop,
    # and leaves the run's checkpoints, metrics and config as they were.
    stop = (rd / "exit.json").read_text()
    kept = {f: open(f, "rb").read() for f in _files(rd) if not f.endswith("exit.json")}
    in_file = tmp_path / "run_dir_in_file.toml"  # the run directory named by the config file alone
    in_file.write_text(open(DEBUG).read().replace('run_dir = "runs/debug"', f"run_dir = {str(rd)!r}"))
    # The first two as rank 0 of 2 in this process (train_fsdp.main; its refusals come before any collective, and
    # only rank 0 touches exit.json); the last as launched, with the command line read from sys.argv and a rank 1.
    for bad, launched in ((("--config", DEBUG, "--run_dir", rd, "--optim.lr", "-1"), False),
                          (("--config", DEBUG, "--run_dir", rd, "--train.stepz", "10"), False),
                          (("--config", in_file, "--train.stepz", "1"), True)):
        (rd / "exit.json").write_text(stop)
        if launched:
            rc = run(2, "train_fsdp.py", *map(str, bad), *COMMON, check=False).returncode
        else:
            try:
                rc, _ = main_in_process(monkeypatch, capsys, *bad, *COMMON, world_size=2)
            except SystemExit as e:  # argparse's own errors
                rc = e.code
        assert rc != 0 and not _requeue_reads_a_clean_stop(rc, rd), bad
        assert {f: open(f, "rb").read() for f in _files(rd)} == kept
    debug_run(2, rd, *COMMON, "--checkpoint.interval", "1000")
    want, got = losses(reference), losses(rd)
    assert sorted(got) == list(range(1, 11))
    assert max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-6


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_on_every_rank_saves_and_resumes_the_same_run(tmp_path, reference):
    rd = tmp_path / "int"
    prepared_data_dir(rd)
    rc = _kill_after(rd, 2, 3, signal.SIGINT, "--checkpoint.interval", "1000")
    log = (tmp_path / "int.log").read_text()
    assert rc != 0
    assert "[train] SIGINT: saved step" in log and "interrupted at step" in log and "run the same command" in log
    assert "KeyboardInterrupt" not in log, log[-3000:]  # the workers stopped cleanly (torchrun's agent may not)
    record = json.loads((rd / "exit.json").read_text())  # what a script reads, as torchrun's status is 1
    assert record["status"] == "interrupted" and record["exit_status"] == 130
    saved = ckpt_lib.complete_checkpoints(str(rd / "checkpoints"))
    assert saved and saved[-1][0] == max(r["step"] for r in metrics(rd))
    debug_run(2, rd, *COMMON, "--checkpoint.interval", "1000")
    want, got = losses(reference), losses(rd)
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, 11))
    assert max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-6


@pytest.mark.slow
def test_resume_2_to_1_and_1_to_2_ranks_continues_the_same_run(tmp_path, reference, monkeypatch, capsys):
    # 2 ranks (reference, step 4) -> 1 rank (steps 5-6) -> 2 ranks (steps 7-10); DCP reshards each time.
    one = tmp_path / "one_rank"
    prepared_data_dir(one)
    shutil.copytree(reference / "checkpoints" / "step_00000004", one / "checkpoints" / "step_00000004")
    # All 10 steps are in the LR warmup (20 steps), so stopping at 6 does not change the schedule.
    debug_run_in_process(monkeypatch, capsys, one, *COMMON, "--train.steps", "6")  # 1 rank, in this process
    two = tmp_path / "two_ranks"
    prepared_data_dir(two)
    shutil.copytree(one / "checkpoints" / "step_00000006", two / "checkpoints" / "step_00000006")
    debug_run(2, two, *COMMON)
    want = losses(reference)
    got_one, got_two = losses(one), losses(two)
    assert sorted(got_one) == [5, 6] and sorted(got_two) == list(range(7, 11))
    for got in (got_one, got_two):
        assert max(abs(got[s] - want[s]) / want[s] for s in got) <= 1e-4


@pytest.mark.slow
def test_load_from_starts_a_new_run_once_then_the_run_resumes_from_its_own(tmp_path, reference, monkeypatch, capsys):
    rd = tmp_path / "branch"
    prepared_data_dir(rd)
    start = str(reference / "checkpoints" / "step_00000004")
    debug_run_in_process(monkeypatch, capsys, rd, *COMMON, "--checkpoint.load_from", start, "--train.steps", "6")
    # The same command again, after more steps were asked for: it must continue from its own step 6,
    # not go back to step 4, and a step directory without .metadata must not block the save at 8.
    (rd / "checkpoints" / "step_00000008").mkdir()
    (rd / "checkpoints" / "step_00000008" / "junk").write_text("left by a deleted checkpoint")
    proc = debug_run_in_process(monkeypatch, capsys, rd, *COMMON, "--checkpoint.load_from", start, "--train.steps", "8")
    assert "has checkpoints of its own: resuming from the newest" in proc.stdout
    assert [r["step"] for r in metrics(rd) if "loss" in r] == [5, 6, 7, 8]
    want, got = losses(reference), losses(rd)
    assert max(abs(got[s] - want[s]) / want[s] for s in got) <= 1e-4  # warmup: LR is independent of steps
    saved = ckpt_lib.complete_checkpoints(str(rd / "checkpoints"))
    assert [s for s, _ in saved][-1] == 8 and not (rd / "checkpoints" / "step_00000008" / "junk").exists()


def test_a_checkpoints_path_that_is_not_a_directory_stops_before_training(tmp_path):
    (tmp_path / "checkpoints").write_text("x")
    with pytest.raises(ckpt_lib.CheckpointError, match="is not a directory; move it away"):
        ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(), str(tmp_path / "checkpoints"), 0).clean_partial()
    (tmp_path / "checkpoints").unlink()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000006.tmp").write_text("x")
    with pytest.raises(ckpt_lib.CheckpointError, match="step_00000006.tmp' is not a checkpoint directory"):
        ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(), str(tmp_path / "checkpoints"), 0).clean_partial()
    assert (tmp_path / "checkpoints" / "step_00000006.tmp").read_text() == "x"


@pytest.mark.slow
def test_optimizer_settings_changed_on_resume_are_the_ones_in_force(tmp_path, single_rank_group):
    """optim.lr, weight_decay, beta2 and muon_momentum changed on resume: the groups hold the new values, the LR of
    every later step is the new lr times the same schedule (the reference: the uninterrupted run's LR x 0.5), and the
    start-up note names each change."""
    rd, muon = tmp_path / "run", ("--optim.name", "muon")
    a = _session(rd, *muon)
    _steps(a, 4)
    a.ckpt.save(4, a.app)
    b = _session(rd, *muon, "--optim.lr", "1.5e-3", "--optim.weight_decay", "0", "--optim.beta2", "0.9",
                 "--optim.muon_momentum", "0.8")
    for change in ("optim.lr 0.003 -> 0.0015", "optim.weight_decay 0.1 -> 0.0", "optim.beta2 0.99 -> 0.9",
                   "optim.muon_momentum 0.95 -> 0.8"):
        assert change in b.resume_note, b.resume_note
    groups = b.optimizer.param_groups
    assert all(g["weight_decay"] == 0 and g["betas"][1] == 0.9 for g in groups)
    assert [g["momentum"] for g in groups if g.get("muon")] == [0.8]
    assert b.optimizer.state_dict()["state"].keys() == a.optimizer.state_dict()["state"].keys()  # moments kept
    for _ in range(3):
        assert b.scheduler.get_last_lr() == pytest.approx([0.5 * lr for lr in a.scheduler.get_last_lr()], rel=1e-12)
        _steps(a, 1)
        _steps(b, 1)


def test_another_optimizer_on_resume_is_named_not_called_damaged(tmp_path, single_rank_group):
    rd = tmp_path / "run"
    a = _session(rd, "--optim.name", "muon")
    a.ckpt.save(0, a.app)
    with pytest.raises(UserError) as e:
        _session(rd, "--optim.name", "adamw")
    msg = str(e.value)
    assert "holds the state of optim.name 'muon', but this run has 'adamw'" in msg and "--optim.name muon" in msg
    assert "damaged" not in msg


@pytest.mark.slow
def test_load_from_another_run_takes_its_tokenizer(tmp_path, reference, monkeypatch, capsys):
    """A new run from another run's checkpoint trains on its data with the checkpoint's tokenizer, not a new one: the
    same losses as the run given that tokenizer by hand (before: a tokenizer of its own, and other token ids)."""
    start = str(reference / "checkpoints" / "step_00000004")
    theirs = str(reference / "data" / "tokenizer.json")
    other_data = ["--data.max_documents", "60", "--data.tokenizer_vocab_size", "3000", "--train.steps", "6",
                  "--checkpoint.interval", "1000", "--train.val_interval", "0", "--checkpoint.load_from", start]
    taken, by_hand = tmp_path / "taken", tmp_path / "by_hand"
    proc = debug_run_in_process(monkeypatch, capsys, taken, *other_data)  # 1-rank runs, in this process
    debug_run_in_process(monkeypatch, capsys, by_hand, *other_data, "--data.tokenizer", theirs)
    assert f"data.tokenizer {theirs}: the tokenizer checkpoint.load_from {start} was trained with" in proc.stdout
    assert parse_config(["--config", str(taken / "config.toml")]).data.tokenizer == theirs
    got, want = losses(taken), losses(by_hand)
    assert sorted(got) == [5, 6] and all(abs(got[s] - want[s]) <= 1e-6 * want[s] for s in want)
