"""ladder.py: the fit against a known law, the rungs' shapes and steps, skipping finished rungs, and bad input."""
import json
import math
import os
import sys

import numpy as np
import pytest

import ladder
from config import parse_config
from launch import DEBUG, prepared_data_dir
from model import num_params

TARGET = ["--config", DEBUG, "--model.parametrization", "mup", "--model.base_dim", "32", "--model.n_kv_heads", "4"]


def test_the_fit_recovers_a_known_law_and_its_prediction():
    e, a, alpha = 1.7, 400.0, 0.35
    n = np.array([5e4, 1e5, 2e5, 4e5, 8e5])
    e2, a2, alpha2 = ladder.fit(n, e + a * n ** -alpha)
    assert (e2, a2, alpha2) == pytest.approx((e, a, alpha), rel=2e-3)
    pred, lo, hi = ladder.predict(n[:4], e + a * n[:4] ** -alpha, 1.6e6)
    assert pred == pytest.approx(e + a * 1.6e6 ** -alpha, rel=1e-3) and lo <= pred <= hi


def test_rungs_keep_the_targets_head_dim_ratios_and_tokens_per_parameter(tmp_path):
    cfg = parse_config(TARGET)
    rungs = ladder.plan(cfg, ["32x2", "64x3"], 20, str(tmp_path))
    for r, (dim, layers) in zip(rungs, [(32, 2), (64, 3)]):
        a = r.args
        assert (a.dim, a.n_layers, a.head_dim, a.n_heads, a.n_kv_heads) == (dim, layers, 32, dim // 32, dim // 32)
        assert a.ffn_dim == 32 * math.ceil(cfg.model.ffn_dim / cfg.model.dim * dim / 32)
        assert (a.parametrization, a.base_dim) == ("mup", 32)
        tokens = 20 * num_params(a, exclude_embedding=True)
        assert r.steps == math.ceil(tokens / (cfg.train.global_batch_size * cfg.data.seq_len))


@pytest.mark.parametrize("argv, msg", [
    (["--config", DEBUG, "--rungs", "32x2,64x2,96x2"], "set --model.parametrization mup (or completep)"),
    ([*TARGET, "--rungs", "32x2,64x2"], "--rungs needs at least 3 sizes"),
    ([*TARGET, "--rungs", "32x2,48x2,64x2"], "ladder size 48x2: width must be a multiple of the target's head_dim"),
    ([*TARGET, "--rungs", "32x2,64x2,big"], "ladder size 'big' is not WIDTHxDEPTH"),
    ([*TARGET, "--model.base_dim", "64", "--rungs", "32x2,64x2,128x2"], "ladder size 32x2: model.parametrization"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2", "--check", "64x2"], "ladder size 64x2 is given twice"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2", "--tokens_per_param", "inf"], "--tokens_per_param: expected a finite"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2", "--tokens_per_param", "lots"], "--tokens_per_param: expected a finite"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2,064X2"], "ladder size 64x2 is given twice"),
    ([*TARGET, "--rungs", "32x2,64x2,96x2", "--check", "32X2"], "ladder size 32x2 is given twice"),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, capsys, argv, msg):
    rc = ladder.main([*argv, "--ladder_dir", str(tmp_path / "l"), "--launcher", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert not os.path.exists(tmp_path / "l")


@pytest.mark.parametrize("ladder_dir, msg", [
    ("s3://bucket/ladder", "--ladder_dir 's3://bucket/ladder': must be a local directory"),
    ("/proc/forbidden/ladder", "--ladder_dir '/proc/forbidden/ladder' cannot be written"),
    ("a_file/ladder", "cannot be written"),
])
def test_an_unusable_ladder_dir_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, ladder_dir, msg):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would show up here as ./s3:/...
    rc = ladder.main([*TARGET, "--rungs", "32x2,64x2,96x2", "--ladder_dir", ladder_dir, "--launcher", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert os.listdir(tmp_path) == ["a_file"]


def test_a_launcher_with_an_unclosed_quote_is_one_line(tmp_path, capsys):
    rc = ladder.main([*TARGET, "--rungs", "32x2,64x2,96x2", "--ladder_dir", str(tmp_path / "l"),
                      "--launcher", "torchrun 'oops"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--launcher \"torchrun 'oops\" cannot be read as a command" in err[0], err
    assert not os.path.exists(tmp_path / "l")


def test_a_launcher_that_is_not_a_command_is_refused_before_any_rung(tmp_path, capsys):
    rc = ladder.main([*TARGET, "--rungs", "32x2,64x2,96x2", "--ladder_dir", str(tmp_path / "l"),
                      "--launcher", "/nonexistent/torchrun"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "/nonexistent/torchrun is not a command here" in err[0], err
    assert not os.path.exists(tmp_path / "l")


@pytest.mark.slow
def test_a_ladder_trains_a_missing_rung_as_a_run_directory_and_skips_finished_ones(tmp_path, capsys):
    """Two rungs finished before (their exit record and final val_loss), one to train: only that one is launched, as
    an ordinary run directory; run again with a launcher that would fail, every rung is skipped and the fit is the
    same."""
    argv = [*TARGET, "--train.global_batch_size", "4", "--data.seq_len", "32", "--train.val_interval", "0",
            "--optim.warmup_steps", "10", "--train.steps", "100", "--rungs", "32x1,64x1,96x1",
            "--tokens_per_param", "0.005", "--ladder_dir", str(tmp_path / "l"),
            "--launcher", f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node=1"]
    rungs = ladder.plan(parse_config(argv[:argv.index("--rungs")]), ["32x1", "64x1", "96x1"], 0.005,
                        str(tmp_path / "l"))
    for r, loss in zip(rungs[1:], (7.9, 7.7)):  # finished before
        os.makedirs(r.run_dir)
        with open(os.path.join(r.run_dir, "exit.json"), "w") as f:
            json.dump({"status": "finished", "step": r.steps, "steps": r.steps}, f)
        with open(os.path.join(r.run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": r.steps, "val_loss": loss}) + "\n")
    prepared_data_dir(rungs[0].run_dir)
    assert ladder.main(argv) == 0
    first = capsys.readouterr().out
    assert first.count("finished before") == 2 and "predicted val_loss" in first
    assert {"config.toml", "metrics.jsonl", "checkpoints", "exit.json"} <= set(os.listdir(rungs[0].run_dir))
    assert os.path.isfile(tmp_path / "l" / "ladder.md")
    assert ladder.main([*argv[:-1], "false"]) == 0  # every rung finished: none is started
    second = capsys.readouterr().out
    assert second.count("finished before") == 3
    assert second.split("Fit:")[1] == first.split("Fit:")[1]
