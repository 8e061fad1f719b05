"""What a run shows: metrics.jsonl, TensorBoard and W&B stay one record per step across resumes, plain log
lines without a terminal, profiles, one error line under torchrun, and the small pieces behind them."""
import json
import os
import signal

import pytest
import torch

from config import compute_dtype, parse_config
from core import cli
from core.errors import ConfigError
from launch import DEBUG, ROOT, debug_run, debug_run_in_process, metrics, prepared_data_dir, torchrun
from observability import profiling
from observability.metrics import MetricsLog
from observability.progress import Progress
from parallel import distributed
from wandb_files import by_step, offline_runs, rewound_history

FAST = ["--train.val_interval", "0", "--train.seed", "0"]


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_log_drops_the_records_after_the_resumed_step(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 8):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
        f.write(json.dumps({"step": 5, "val_loss": 2.0}) + "\n")
        f.write('{"step": 8, "lo')  # cut by a crash mid-write
    log = MetricsLog(str(tmp_path), enabled=True, resume_step=5)
    assert [(r["step"], "loss" in r) for r in _lines(tmp_path / "metrics.jsonl")] == \
        [(1, True), (2, True), (3, True), (4, True), (5, True), (5, False)]
    log.write({"step": 6, "loss": 0.5})
    assert _lines(tmp_path / "metrics.jsonl")[-1] == {"step": 6, "loss": 0.5}
    MetricsLog(str(tmp_path), enabled=False, resume_step=0)  # other ranks never touch the file
    assert len(_lines(tmp_path / "metrics.jsonl")) == 7


def test_progress_without_a_terminal_prints_plain_lines(capsys):
    p = Progress(total=10, initial=0, enabled=True, tty=False)
    for step in (1, 2):
        p.step()
        p.log({"step": step, "loss": 3.25, "lr": 1e-3, "tokens_per_sec": 1234.5, "mfu": 0.4})
    p.write("[val] step 2: val_loss 3.0")
    p.close()
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    lines = out.out.strip().splitlines()
    assert lines[0].startswith("step 1/10 | loss 3.2500 | lr 1.00e-03 | 1,234 tok/s | MFU 40.0% | ETA ")
    assert lines[-1] == "[val] step 2: val_loss 3.0"


@pytest.mark.parametrize("text, span", [("", None), ("7", (7, 7)), ("10-12", (10, 12))])
def test_profile_steps_parse(text, span):
    assert profiling.parse_steps(text) == span


def test_a_profile_span_past_the_runs_last_step_ends_there_and_writes_its_trace(tmp_path):
    """--train.profile_steps 2-100 in a run of 3 steps: the profiler left open at exit crashed the process."""
    prof = profiling.StepProfiler((2, 100), str(tmp_path), torch.device("cpu"), True)
    prof.before_step(2)
    torch.ones(8, 8) @ torch.ones(8, 8)
    assert not prof.finishes(2) and prof.after_step(2) is None  # the span goes on
    assert prof.finishes(3, last=True)
    trace = prof.after_step(3, last=True)
    assert trace.endswith("trace_steps_2-3.json") and os.path.getsize(trace) > 0 and not prof.finishes(3, last=True)


@pytest.mark.parametrize("text", ["0", "5-3", "a-b", "1-2-3", "1-", "-3"])
def test_bad_profile_steps_name_the_field(text):
    with pytest.raises(ConfigError, match="train.profile_steps must look like '10-12'"):
        parse_config(["--config", DEBUG, "--train.profile_steps", text])


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    cfg = parse_config(["--config", DEBUG, "--train.dtype", "auto"])
    assert compute_dtype(cfg.train, torch.device("cpu")) == "float32"
    assert compute_dtype(cfg.train, torch.device("cuda", 0)) == "bfloat16"
    assert parse_config(["--config", os.path.join(ROOT, "configs", "llama_125m.toml")]).train.dtype == "bfloat16"


def test_help_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    assert "--model.preset debug|llama_125m|llama3_1b|llama3_8b" in capsys.readouterr().out


def test_a_mistyped_flag_of_a_command_gets_the_near_name(capsys):
    p = cli.ArgumentParser()
    p.add_argument("--temperature", type=float)
    with pytest.raises(SystemExit):
        p.parse_args(["--tempreture", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'--tempreture': did you mean '--temperature'?" in err[0]


def test_a_second_ctrl_c_aborts_but_the_forwarded_copy_does_not():
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        flag = distributed.StopFlag()
        flag._handle(signal.SIGINT, None)
        flag._handle(signal.SIGINT, None)  # torchrun's agent forwarding the same Ctrl-C
        assert flag.signum == signal.SIGINT
        flag._first_sigint -= 2 * flag.REPEAT_S
        with pytest.raises(KeyboardInterrupt):
            flag._handle(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])


@pytest.mark.slow
def test_resume_keeps_metrics_tensorboard_and_wandb_one_record_per_step_and_logs_plain_lines(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("wandb")
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    args = ["--train.steps", "6", "--checkpoint.interval", "3", "--checkpoint.keep", "0", "--metrics.tensorboard",
            "true", "--metrics.wandb", "true", *FAST]  # W&B offline (conftest)
    first = debug_run(1, rd, *args)
    # Lose the step-6 checkpoint: the same command resumes from step 3 and logs steps 4-6 again.
    ckpts = rd / "checkpoints"
    os.rename(ckpts / "step_00000006", ckpts / "step_00000006.tmp")
    second = debug_run(1, rd, *args)
    assert "resumed from" in second.stdout and "at step 3" in second.stdout
    assert [r["step"] for r in metrics(rd) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    acc = event_accumulator.EventAccumulator(str(rd / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert {"lr", "grad_norm", "tokens_per_sec", "mfu", "peak_mem_gib"} <= set(acc.Tags()["scalars"])
    # W&B: one offline folder per start, of one run id; the resume rewound the run to step 3.
    runs = offline_runs(rd)
    assert [[r["step"] for r in rows] for _, rows in runs] == [[1, 2, 3, 4, 5, 6], [4, 5, 6]]
    assert len({run["run_id"] for run, _ in runs}) == 1 and runs[1][0]["branch_point"]["value"] == 3
    assert rewound_history(runs) == by_step(metrics(rd))
    assert runs[1][0]["config"]["update"]["train"]["steps"] == 6  # the resolved config
    for out in (first, second):  # captured: no terminal
        assert "\r" not in out.stdout + out.stderr
    assert "step 6/6 | loss " in second.stdout and "[train] finished: step 6 of 6" in second.stdout


@pytest.mark.slow
def test_profile_steps_write_a_chrome_trace(tmp_path, monkeypatch, capsys):
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    out = debug_run_in_process(monkeypatch, capsys, rd, "--train.steps", "3", "--train.profile_steps", "2-3", *FAST)
    trace = rd / "profile" / "trace_steps_2-3.json"
    assert f"[profile] steps 2-3: {trace}" in out.stdout
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)


@pytest.mark.slow
def test_a_bad_config_under_torchrun_prints_one_error_line_and_torchrun_shows_it(tmp_path):
    proc = torchrun(2, "train_fsdp.py", "--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--optim.lr", "-1",
                    check=False, timeout=120)
    out = proc.stdout + proc.stderr
    message = "error: optim.lr must be > 0"
    assert proc.returncode != 0
    assert sum(line.startswith(message) for line in out.splitlines()) == 1, out[-3000:]
    assert "<N/A>" not in out and out.count(message) >= 2, out[-3000:]  # printed once, and in torchrun's summary


def test_a_rollback_record_survives_a_resume_from_its_target_and_is_never_written_twice(tmp_path):
    """After a spent budget's stop, its remedy resumes from the checkpoint the earlier rollback went back to: that
    rollback is history (plot.py marks it), kept; made again (a resume without the remedy), it is not doubled."""
    from observability.metrics import MetricsLog

    rollback = {"step": 10, "rollback": {"to_step": 8, "skip": [9, 10], "trigger": "non-finite"}}
    lines = [{"step": s, "loss": 1.0} for s in range(1, 11)] + [rollback] + \
            [{"step": s, "loss": 2.0} for s in range(9, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = MetricsLog(str(tmp_path), True, resume_step=8)
    kept = metrics(tmp_path)
    assert [r["step"] for r in kept if "loss" in r] == list(range(1, 9)) and rollback in kept
    log.note(rollback)  # the same rollback, made again
    log.note({**rollback, "step": 12, "rollback": {**rollback["rollback"], "skip": [9, 12]}})  # another one
    assert [r.get("rollback", {}).get("skip") for r in metrics(tmp_path) if "rollback" in r] == [[9, 10], [9, 12]]
    log.rewind(5)  # a rollback to step 5: later train records go, every rollback record stays
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == list(range(1, 6))
    assert len([r for r in metrics(tmp_path) if "rollback" in r]) == 2
    log.close()
