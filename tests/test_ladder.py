"""ladder.py: the fit against a known law, the rungs' shapes and steps, skipping finished rungs, and bad input."""
import json
import math
import os
import re
import sys

import pytest

import ladder
from config import parse_config
from launch import (
    DEBUG,
    ROOT,
    kill_tree,
    losses,
    metrics,
    prepared_data_dir,
    refused,
    spawn,
    train_in_process,
    wait_for_step,
)
from model import num_params

TARGET = ["--config", DEBUG, "--model.parametrization", "mup", "--model.base_dim", "32", "--model.n_kv_heads", "4"]


def test_rungs_keep_the_targets_head_dim_ratios_and_tokens_per_parameter(tmp_path):
    cfg = parse_config(TARGET)
    rungs = ladder.plan(cfg, ["32x2", "64x3"], 20, str(tmp_path))
    for r, (dim, layers) in zip(rungs, [(32, 2), (64, 3)]):
        a = r.args
        assert (a.dim, a.n_layers, a.head_dim, a.n_heads, a.n_kv_heads) == (dim, layers, 32, dim // 32, dim // 32)
        assert a.ffn_dim == 32 * math.ceil(cfg.model.ffn_dim / cfg.model.dim * dim / 32)
        assert (a.parametrization, a.base_dim) == ("mup", 32)
        tokens = 20 * num_params(a, exclude_embedding=True)
        assert r.runs[0].steps == math.ceil(tokens / (cfg.train.global_batch_size * cfg.data.seq_len))
        assert (r.runs[0].start, r.runs[0].run_dir) == (0, str(tmp_path / f"rung_{dim}x{layers}"))  # one plain run


@pytest.mark.parametrize("decay_fraction, shape", [(0.2, "linear"), (0.5, "1-sqrt"), (1.0, "linear")])
def test_each_budget_branches_off_the_trunk_where_its_wsd_decay_begins(tmp_path, decay_fraction, shape):
    """Reference: optimizers.lr_factor. Up to a branch's start, its own schedule (WSD over its steps) equals the
    trunk's (optim.min_lr_ratio 1: constant after the warmup); the step after it is the first one decayed."""
    from optimization.optimizers import lr_factor

    cfg = parse_config([*TARGET, "--optim.schedule", "wsd", "--optim.decay_fraction", str(decay_fraction),
                        "--optim.decay_shape", shape])
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    (rung,) = ladder.plan(cfg, ["64x2"], 20, str(tmp_path), (0.5, 1, 2, 4))
    n = num_params(rung.args, exclude_embedding=True)
    assert [r.steps for r in rung.runs] == [math.ceil(b * 20 * n / tokens_per_step) for b in (0.5, 1, 2, 4)]
    assert [r.run_dir for r in rung.runs] == [str(tmp_path / "rung_64x2" / f"budget_{b}") for b in ("0.5", 1, 2, 4)]
    for r in rung.runs:
        mine = [lr_factor(k, rung.warmup, r.steps, cfg.optim.min_lr_ratio, "wsd", decay_fraction, shape)
                for k in range(r.steps)]
        trunk = [lr_factor(k, rung.warmup, r.start, 1.0, "wsd", decay_fraction, shape) for k in range(r.start)]
        assert mine[:r.start] == trunk and (r.start == r.steps or mine[r.start] < 1.0)
    if decay_fraction == 1.0:
        assert {r.start for r in rung.runs} == {0}  # all decay: each budget is a run of its own
    else:
        cost = max(r.start for r in rung.runs) + sum(r.steps - r.start for r in rung.runs)
        assert ladder.runs_cost(rung) == cost and cost <= (1.25 if decay_fraction == 0.2 else 1.6) * rung.runs[-1].steps


RUNGS = ["--rungs", "32x2,64x2,96x2,128x2"]
WSD = ["--optim.schedule", "wsd"]


@pytest.mark.parametrize("argv, msg", [
    (["--config", DEBUG, *RUNGS], "set --model.parametrization mup (or completep)"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2"], "--rungs: L(N) = E + A/N^alpha has 3 parameters and needs more points "
                                             "than that: give 4 or more sizes, got 3"),
    ([*TARGET, "--rungs", "32x2,48x2,64x2,96x2"], "ladder size 48x2: width must be a multiple of the target's head_dim"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2,big"], "ladder size 'big' is not WIDTHxDEPTH"),
    ([*TARGET, "--model.base_dim", "64", *RUNGS], "ladder size 32x2: model.parametrization"),
    ([*TARGET, *RUNGS, "--check", "64x2"], "ladder size 64x2 is given twice"),
    ([*TARGET, *RUNGS, "--tokens_per_param", "inf"], "--tokens_per_param: expected a finite"),
    ([*TARGET, *RUNGS, "--tokens_per_param", "lots"], "--tokens_per_param: expected a finite"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2,064X2"], "ladder size 64x2 is given twice"),
    ([*TARGET, *RUNGS, "--check", "32X2"], "ladder size 32x2 is given twice"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "1,0.5"], "argument --budgets: expected comma-separated numbers > 0 in "
                                                    "increasing order"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "1,1"], "argument --budgets: expected comma-separated numbers > 0"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "0,1"], "argument --budgets: expected comma-separated numbers > 0"),
    ([*TARGET, *WSD, *RUNGS, "--budgets=-1,1"], "argument --budgets: expected comma-separated numbers > 0"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "half,1"], "argument --budgets: expected comma-separated numbers > 0"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "nan,1"], "argument --budgets: expected comma-separated numbers > 0"),
    ([*TARGET, *WSD, "--rungs", "32x2,64x2", "--budgets", "0.5,1,2"],
     "--rungs x --budgets: L(N, D) = E + A/N^alpha + B/D^beta has 5 parameters and needs 3 or more sizes and more "
     "points than that (rungs x budgets >= 6), got 2 x 3"),
    ([*TARGET, *WSD, "--rungs", "32x2,64x2", "--budgets", "1,2,4,8"], "got 2 x 4"),
    ([*TARGET, *RUNGS, "--budgets", "0.5,1"], "branches WSD cooldowns off one constant-LR trunk per rung: set "
                                              "--optim.schedule wsd (it is 'cosine')"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "0.5,1", "--flops", "1e3"],
     "--flops 1e+03 FLOPs is below the compute of the smallest rung 32x2 at budget 1"),
    ([*TARGET, *RUNGS, "--flops", "1e20"], "--flops plans N and D with the L(N, D) fit, which needs several budgets"),
    ([*TARGET, *RUNGS, "--target"], "--target plans N and D with the L(N, D) fit, which needs several budgets"),
    ([*TARGET, *RUNGS, "--flops", "-1"], "argument --flops: expected a finite number > 0"),
    ([*TARGET, *RUNGS, "--rung", "32x2"], "unknown flag --rung: did you mean --rungs? the ladder's flags are --rungs, "
                                          "--check, --budgets"),
    ([*TARGET, *RUNGS, "--budget", "1"], "unknown flag --budget: did you mean --budgets?"),
    ([*TARGET, "--rung", "32x2,64x2,96x2,128x2"], "unknown flag --rung: did you mean --rungs?"),
    (TARGET, "--rungs is required: the sizes to fit"),
    ([*TARGET, *RUNGS, "--ladderdir=x"], "unknown flag --ladderdir: did you mean --ladder_dir?"),
    ([*TARGET, *RUNGS, "--checkpoint.dir", "s3://b/c"], "--checkpoint.dir: each run of the ladder keeps its "
                                                        "checkpoints in its own run directory"),
    ([*TARGET, *RUNGS, "--checkpoint.load_from", "x"], "--checkpoint.load_from: each run of the ladder keeps"),
    ([*TARGET, *WSD, "--rungs", "32x2,64x2,96x2", "--budgets", "1,1.05"], "--budgets 1 and 1.05 are less than 1.1x apart"),
    ([*TARGET, *WSD, *RUNGS, "--budgets", "1,1e300"], "--budgets 1e+300 gives rung 32x2 "),  # was an OverflowError
    ([*TARGET, *WSD, *RUNGS, "--budgets", "1,1e15"], "more than train.steps can hold (2**63 - 1); use smaller budgets"),
    ([*TARGET, "--rungs", "32x4,64x2,96x4,128x4", "--parallel.pp", "4"],  # each run was refused after the data
     "ladder size 64x2: parallel.pp x its stages per rank (4 x 1) is more than its 2 layers; use parallel.pp <= 2"),
    ([*TARGET, *RUNGS, "--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B"],  # 2 x 2 stages of 2 layers
     "ladder size 32x2: parallel.pp x its stages per rank (2 x 2) is more than its 2 layers; use parallel.pp <= 1"),
    ([*TARGET, *RUNGS, "--model.n_experts", "4", "--model.experts_per_token", "2", "--parallel.ep", "3"],
     "parallel.ep (3) does not divide model.n_experts (4)"),
    ([*TARGET, *RUNGS, "--parallel.pp", "2", "--train.float8", "rowwise"],
     "parallel.pp 2 does not run with train.float8 yet"),
    ([*TARGET, *RUNGS, "--parallel.tp", "2"], "parallel.tp is 2: tensor parallelism runs with train_2d.py"),
    ([*TARGET, *RUNGS, "--script", "train_2d.py", "--parallel.tp", "2", "--train.float8", "rowwise"],
     "train.float8 rowwise does not run with parallel.tp 2 (train_2d.py) yet"),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, capsys, argv, msg):
    rc = ladder.main([*argv, "--ladder_dir", str(tmp_path / "l"), "--launcher", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert not os.path.exists(tmp_path / "l")


def test_the_schedule_remedy_is_accepted_as_printed(tmp_path, capsys):
    argv = [*TARGET, *RUNGS, "--budgets", "0.5,1"]
    line = refused(ladder.main, [*argv, "--ladder_dir", str(tmp_path / "l"), "--launcher", "false"], capsys)
    fix = re.search(r"set (--optim\.schedule \S+)", line).group(1).split()
    ladder.check_form(4, [0.5, 1], parse_config([*TARGET, *fix]))  # accepted: no error


def test_the_pipeline_depth_remedy_is_accepted_as_printed(tmp_path, monkeypatch, capsys):
    argv = [*TARGET, "--rungs", "32x4,64x2,96x4,128x4", "--ladder_dir", str(tmp_path / "l"), "--launcher", "false"]
    line = refused(ladder.main, [*argv, "--parallel.pp", "4"], capsys)
    pp = re.search(r"use parallel\.pp <= (\d+)", line).group(1)

    def prepared(*args):  # every check passed: the ladder goes on to tokenize the data
        raise KeyboardInterrupt
    monkeypatch.setattr(ladder, "prepare", prepared)
    assert ladder.main([*argv, "--parallel.pp", pp]) == 130


@pytest.mark.parametrize("ladder_dir, msg", [
    ("s3://bucket/ladder", "--ladder_dir 's3://bucket/ladder': must be a local directory"),
    ("/proc/forbidden/ladder", "--ladder_dir '/proc/forbidden/ladder' cannot be written"),
    ("a_file/ladder", "cannot be written"),
])
def test_an_unusable_ladder_dir_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, ladder_dir, msg):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would show up here as ./s3:/...
    rc = ladder.main([*TARGET, *RUNGS, "--ladder_dir", ladder_dir, "--launcher", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert os.listdir(tmp_path) == ["a_file"]


def test_a_launcher_with_an_unclosed_quote_is_one_line(tmp_path, capsys):
    rc = ladder.main([*TARGET, *RUNGS, "--ladder_dir", str(tmp_path / "l"),
                      "--launcher", "torchrun 'oops"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--launcher \"torchrun 'oops\" cannot be read as a command" in err[0], err
    assert not os.path.exists(tmp_path / "l")


def test_a_launcher_that_is_not_a_command_is_refused_before_any_rung(tmp_path, capsys):
    rc = ladder.main([*TARGET, *RUNGS, "--ladder_dir", str(tmp_path / "l"),
                      "--launcher", "/nonexistent/torchrun"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "/nonexistent/torchrun is not a command here" in err[0], err
    assert not os.path.exists(tmp_path / "l")


TINY = [*TARGET, "--train.global_batch_size", "4", "--data.seq_len", "32", "--optim.warmup_steps", "10",
        "--train.steps", "100", "--train.log_interval", "1"]
"""A target whose rungs train in well under a second: batch 4 x 32 tokens."""


def finished_before(run_dir: str, steps: int, val_loss: float) -> None:
    """Make run_dir look like a run that finished at steps with that final val_loss (its exit record and metrics)."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "exit.json"), "w") as f:
        json.dump({"status": "finished", "step": steps, "steps": steps}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": steps, "val_loss": val_loss}) + "\n")


def last_val_loss(run_dir) -> float:
    return [r["val_loss"] for r in metrics(run_dir) if "val_loss" in r][-1]


@pytest.mark.slow
def test_ladder_json_holds_the_check_runs_own_val_loss_and_a_rerun_skips_every_finished_run(tmp_path, capsys):
    """Four rungs finished before (L(N) points of a known law), one check to train: only the check is launched, as
    an ordinary run directory, and ladder.json's `measured` is the last val_loss of its metrics.jsonl (validated
    at two steps). Run again with a launcher that would fail, every run is skipped and the report is the same."""
    ld = tmp_path / "l"
    argv = [*TINY, "--train.val_interval", "3", "--rungs", "64x1,96x1,128x1,160x1", "--check", "32x1",
            "--tokens_per_param", "0.005", "--ladder_dir", str(ld), "--launcher", sys.executable]
    cfg = parse_config(argv[:argv.index("--rungs")])
    rungs = ladder.plan(cfg, ["64x1", "96x1", "128x1", "160x1"], 0.005, str(ld))
    for r in rungs:
        finished_before(r.runs[0].run_dir, r.runs[0].steps, 2.0 + 400 * r.n_params ** -0.3)
    prepared_data_dir(ld)  # the ladder's shared data, as it prepares it (saves the test the tokenizing)
    assert ladder.main(argv) == 0
    first = capsys.readouterr().out
    assert first.count("finished before") == 4 and "predicted val_loss" in first
    (check,) = ladder.plan(cfg, ["32x1"], 0.005, str(ld))
    run_dir = check.runs[0].run_dir
    assert {"config.toml", "metrics.jsonl", "checkpoints", "exit.json"} <= set(os.listdir(run_dir))
    assert "data" not in os.listdir(run_dir) and f"prepared = \"{ld / 'data'}\"" in open(f"{run_dir}/config.toml").read()
    assert len([r for r in metrics(run_dir) if "val_loss" in r]) == 2
    with open(ld / "ladder.json") as f:
        lj = json.load(f)
    assert lj["form"] == "L(N) = E + A/N^alpha" and set(lj["fit"]) == {"E", "A", "alpha"}
    (c,) = lj["checks"]
    assert (c["rung"], c["run_dir"], c["measured"]) == ("32x1", run_dir, last_val_loss(run_dir))
    assert c["tokens"] == check.runs[0].steps * 4 * 32 and c["params"] == check.n_params
    assert c["interval"][0] <= c["predicted"] <= c["interval"][1]
    assert [(p["rung"], p["val_loss"]) for p in lj["points"]] == [(r.name, last_val_loss(r.runs[0].run_dir))
                                                                  for r in rungs]
    assert [b["predicted_rung"] for b in lj["backtest"]] == ["160x1"]  # L(N) on the smallest 3 predicts the 4th
    assert lj["fit"]["alpha"] == pytest.approx(0.3, rel=1e-2)
    md = (ld / "ladder.md").read_text()
    assert "Made by: `python ladder.py " + " ".join(argv[:4]) in md and "Mean |error|" in md
    assert ladder.main([*argv[:-1], "false"]) == 0  # every run finished: none is started
    second = capsys.readouterr().out
    assert second.count("finished before") == 5
    assert second.split("Fit")[1].split("Made by")[0] == first.split("Fit")[1].split("Made by")[0]


@pytest.mark.slow
def test_a_cooldown_branch_equals_a_run_given_its_schedule_from_the_start_and_resumes_exactly_after_a_kill(
        tmp_path, monkeypatch, capsys):
    """Reference: budget 1 trained as a plain run with its WSD schedule from the start. One rung trains (two more
    finished before): its trunk in two segments (to budget 0.5's branch point, then budget 1's) and both
    branches. A SIGKILL of the ladder and its run in the middle of budget 1's branch, then the same command: the
    finished runs are skipped, the trunk is not run again, and the branch resumes from its own checkpoint. Every
    step's loss of the branch equals the reference's to 1e-6; so do its val_loss and ladder.json's point."""
    ld = tmp_path / "l"
    base = [*TINY, "--optim.schedule", "wsd", "--optim.decay_fraction", "0.5", "--checkpoint.interval", "4",
            "--train.val_interval", "0"]
    argv = [*base, "--rungs", "32x1,64x1,96x1", "--budgets", "0.5,1", "--tokens_per_param", "0.036",
            "--ladder_dir", str(ld), "--launcher", sys.executable]
    rungs = ladder.plan(parse_config(base), ["32x1", "64x1", "96x1"], 0.036, str(ld), (0.5, 1))
    for r in rungs[1:]:  # on a law through the trained rung's two losses (about 7.70 and 7.05), for a sound fit
        for run in r.runs:
            finished_before(run.run_dir, run.steps, 2.0 + 74.9 * r.n_params ** -0.3 + 38.2 * (run.steps * 128) ** -0.3)
    prepared_data_dir(ld)
    rung, cmd = rungs[0], [sys.executable, os.path.join(ROOT, "ladder.py"), *argv]
    half, full = rung.runs
    assert (half.steps, half.start, full.steps, full.start) == (21, 11, 41, 21)  # the schedules this test is about

    proc = spawn(cmd, tmp_path / "1.log")
    wait_for_step(full.run_dir, full.start + 10, proc)
    kill_tree(proc.pid)
    proc.wait(timeout=60)
    assert not os.path.exists(os.path.join(full.run_dir, "exit.json"))  # killed in the middle of the branch
    assert final_val_loss(half.run_dir) is not None

    proc = spawn(cmd, tmp_path / "2.log")  # the same command
    assert proc.wait(timeout=240) == 0, (tmp_path / "2.log").read_text()[-3000:]
    out = (tmp_path / "2.log").read_text()
    assert out.count("finished before") == 5 and "trunk to step" not in out.split("[ladder] data")[1]
    assert f"resumed from {full.run_dir}/checkpoints/step_" in out

    ref = tmp_path / "ref"
    prepared_data_dir(ref)
    train_in_process(monkeypatch, capsys, *base, "--run_dir", ref,  # the reference: train_fsdp.main in this process
                     "--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "1", "--model.n_kv_heads", "1",
                     "--model.ffn_dim", rung.args.ffn_dim, "--optim.warmup_steps", rung.warmup,
                     "--train.steps", full.steps, "--train.val_interval", full.steps)
    got, want = losses(full.run_dir), losses(ref)
    assert sorted(got) == list(range(full.start + 1, full.steps + 1))
    assert max(abs(got[k] - want[k]) for k in got) < 1e-6
    with open(ld / "ladder.json") as f:
        points = {p["run_dir"]: p["val_loss"] for p in json.load(f)["points"]}
    assert abs(last_val_loss(full.run_dir) - last_val_loss(ref)) < 1e-6
    assert points[full.run_dir] == last_val_loss(full.run_dir)


@pytest.mark.slow
def test_ctrl_c_waits_for_the_run_to_save_prints_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches the ladder and its run together: the ladder keeps waiting for the run (which saves its step
    and exits) instead of killing it, prints one line and exits 130; the same command then trains that run again
    (resuming it) and carries on. The runs are stood in for by a process whose first wait is interrupted."""
    ld = tmp_path / "l"
    argv = [*TINY, "--rungs", "32x1,64x1,96x1,128x1", "--tokens_per_param", "0.005", "--ladder_dir", str(ld),
            "--launcher", sys.executable]
    prepared_data_dir(ld)
    started, waits = [], []

    class Run:
        def __init__(self, cmd):
            started.append(cmd)
            self.run_dir = cmd[cmd.index("--run_dir") + 1]
            self.steps = int(cmd[len(cmd) - 1 - cmd[::-1].index("--train.steps") + 1])

        def wait(self):
            waits.append(self.run_dir)
            if len(started) == 2:  # Ctrl-C while the second run trains: it saves its step and exits 130
                if waits.count(self.run_dir) == 1:
                    raise KeyboardInterrupt
                return 130
            finished_before(self.run_dir, self.steps, 9.0 - len(started) / 10)
            return 0

    monkeypatch.setattr(ladder.subprocess, "Popen", Run)
    assert ladder.main(argv) == 130
    out, err = capsys.readouterr()
    assert err == "" and out.strip().splitlines()[-1] == "[ladder] interrupted; run the same command again to resume"
    assert len(started) == 2 and waits == [started[0][started[0].index("--run_dir") + 1]] + [waits[1]] * 2
    assert ladder.main(argv) == 0  # the same command
    out = capsys.readouterr().out
    assert out.count("finished before") == 1 and len(started) == 5 and started[2] == started[1]


def final_val_loss(run_dir) -> float | None:
    return ladder.final_val_loss(str(run_dir), json.load(open(os.path.join(run_dir, "exit.json")))["step"]) \
        if os.path.exists(os.path.join(run_dir, "exit.json")) else None
