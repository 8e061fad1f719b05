"""metrics.wandb: W&B holds what metrics.jsonl holds, one row per step, in one W&B run across resumes (offline)."""
import json
import os
import sys

import pytest

import train_fsdp
from config import parse_config
from core.errors import ConfigError, SetupError
from launch import DEBUG, refused
from observability import wandblog
from observability.metrics import MetricsConfig, MetricsLog
from storage.rundir import RunDir
from wandb_files import by_step, offline_runs, rewound_history

wandb = pytest.importorskip("wandb")
CFG = MetricsConfig(wandb=True, wandb_project="proj", wandb_group="sweep1")


def records(tmp_path) -> list[dict]:
    with open(RunDir(str(tmp_path)).metrics) as f:
        return [json.loads(line) for line in f]


def log_steps(log: MetricsLog, steps, scale: float) -> None:
    """Train records of steps, a validation record every 3rd step and eval records at step 6 (same steps: one row)."""
    for step in steps:
        log.write({"step": step, "loss": scale / step, "lr": 1e-3 * step, "skipped": step == 2})
        if step % 3 == 0:
            log.write({"step": step, "val_loss": 2 * scale / step})
        if step == 6:
            log.write({"step": step, "eval/toy/acc": 0.5 * scale, "eval/toy/acc_norm": 0.25 * scale})


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # in-process: leave pytest's capture of sys.stdout alone
    yield
    wandb.teardown()  # the wandb-core service this process started


@pytest.mark.slow
def test_a_resume_past_the_last_checkpoint_rewinds_w_and_b_to_one_row_per_step(tmp_path, offline):
    first = MetricsLog(str(tmp_path), True, 0, CFG, {"train": {"steps": 6}})
    log_steps(first, range(1, 7), 1.0)
    first.close()
    # The run went on to step 6 but resumes from its step-3 checkpoint: steps 4-6 are logged again, other values.
    second = MetricsLog(str(tmp_path), True, 3, CFG, {"train": {"steps": 8}})
    log_steps(second, range(4, 9), 10.0)
    second.close()
    # A later start from the last step logged continues the run without a rewind.
    third = MetricsLog(str(tmp_path), True, 8, CFG, {"train": {"steps": 9}})
    log_steps(third, [9], 100.0)
    third.close()

    expected = by_step(records(tmp_path))
    assert sorted(expected) == list(range(1, 10)) and expected[4]["loss"] == 10.0 / 4  # the resumed values
    assert set(expected[6]) == {"loss", "lr", "val_loss", "eval/toy/acc", "eval/toy/acc_norm"}  # no bool
    runs = offline_runs(tmp_path)
    with open(RunDir(str(tmp_path)).wandb_id) as f:
        rid = f.read().strip()
    # One offline folder per start (W&B's offline mode), all of the one run id.
    assert [run["run_id"] for run, _ in runs] == [rid] * 3
    assert [[r["step"] for r in rows] for _, rows in runs] == [[1, 2, 3, 4, 5, 6], [4, 5, 6, 7, 8], [9]]
    assert [run.get("branch_point", {}).get("value") for run, _ in runs] == [None, 3, None]
    assert runs[2][0]["resume"] is True
    assert rewound_history(runs) == expected
    run = runs[1][0]
    assert run["project"] == "proj" and run["run_group"] == "sweep1" and run["display_name"] == tmp_path.name
    assert run["config"]["update"]["train"] == {"steps": 8}


def test_a_refused_rewind_continues_the_run_and_says_so(tmp_path, monkeypatch, capsys):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(kw)
        if "resume_from" in kw:
            raise wandb.errors.CommError("rewind is not enabled for this entity")
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    with open(RunDir(str(tmp_path)).wandb_id, "w") as f:
        f.write("abc123\n")
    with open(RunDir(str(tmp_path)).metrics, "w") as f:
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    log = MetricsLog(str(tmp_path), True, 3, CFG, {})
    log.write({"step": 4, "loss": 2.0})
    log.close()
    assert calls[0]["resume_from"] == "abc123?_step=3" and "id" not in calls[0]
    assert calls[1]["id"] == "abc123" and calls[1]["resume"] == "allow"
    assert calls[2:] == [("log", 4, {"loss": 2.0}), ("finish",)]
    err = capsys.readouterr().err
    assert "W&B refused to rewind run abc123 to step 3" in err and "metrics.jsonl holds the new ones" in err


def test_w_and_b_that_cannot_start_is_one_error_naming_the_fix(tmp_path, monkeypatch):
    def init(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(SetupError, match=r"^metrics.wandb = true: W&B could not start run \w{8} \(UsageError: api_key "
                                         r"not configured \(no-tty\)\); check the WANDB_\* variables, run `wandb login`"):
        MetricsLog(str(tmp_path), True, 0, CFG, {})


@pytest.mark.parametrize("content", ["", "a/b", "two words"])
def test_a_bad_run_id_file_names_the_file(tmp_path, content):
    path = RunDir(str(tmp_path)).wandb_id
    with open(path, "w") as f:
        f.write(content)
    with pytest.raises(SetupError, match=f"^{path} holds .*, not a W&B run id; .* or delete the file"):
        wandblog.run_id(str(tmp_path))  # noqa: B018


@pytest.mark.parametrize("project", ["team/proj", "a:b", "x" * 129])
def test_a_project_name_w_and_b_refuses_names_the_field(project):
    with pytest.raises(ConfigError, match=r"^metrics.wandb_project must be at most 128 characters without any of"):
        parse_config(["--config", DEBUG, "--metrics.wandb_project", project])


def test_wandb_without_the_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it now raises ImportError
    monkeypatch.setenv("WORLD_SIZE", "1")
    rd = tmp_path / "run"
    assert refused(train_fsdp.main, ["--config", DEBUG, "--run_dir", str(rd), "--metrics.wandb", "true"], capsys) == (
        "error: metrics.wandb = true needs the Python package 'wandb', which is not installed: "
        "pip install -e \".[wandb]\"; or set it to false")
    assert not (rd / "data").exists()


def test_a_bad_id_file_or_wandb_mode_stops_the_run_before_anything_is_written(tmp_path, monkeypatch, capsys):
    rd = tmp_path / "run"
    rd.mkdir()
    with open(RunDir(str(rd)).wandb_id, "w") as f:
        f.write("bad id\n")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", DEBUG, "--run_dir", str(rd), "--metrics.wandb", "true"]
    line = refused(train_fsdp.main, argv, capsys)
    assert "wandb_run_id holds 'bad id', not a W&B run id" in line, line
    os.remove(RunDir(str(rd)).wandb_id)
    monkeypatch.setenv("WANDB_MODE", "bogus")
    line = refused(train_fsdp.main, argv, capsys)
    assert "WANDB_MODE='bogus' is not a W&B mode; use one of online, offline, disabled" in line, line
    assert sorted(os.listdir(rd)) == []  # no config.toml, no data: refused before the run started


def test_a_refused_w_and_b_start_leaves_the_run_directory_byte_identical(tmp_path, monkeypatch):
    """A finished run directory, resumed at step 4 with records of step 5 in metrics.jsonl and no W&B id yet: a
    W&B that refuses to start writes no id file and drops no record."""
    log = MetricsLog(str(tmp_path), True, 0, None, {})
    log_steps(log, range(1, 6), 1.0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def init(**kw):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(SetupError, match="W&B could not start run"):
        MetricsLog(str(tmp_path), True, 4, CFG, {})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
