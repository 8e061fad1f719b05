"""benchmarks/gpu_check.py's parts that need no GPU: the plan, its flags, its refusal without CUDA, a check that
raises, and the speed table's goals."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_check  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_speed  # noqa: E402


def test_dry_run_prints_one_line_per_check_and_every_speed_row(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == \
        [n for n in gpu_check.NAMES if n != "plan"]  # the plan row runs when named (it adds minutes)
    assert gpu_check.NAMES == ["nccl", "bf16", "flex", "chunked", "cp", "pp", "ep", "offload", "float8", "snapshot", "moe",
                               "speed", "plan", "goals"]
    speed = next(line for line in lines if line.startswith("speed:"))
    assert "llama3_1b" in speed and "10 timed steps" in speed
    rows = [line.strip() for line in lines if line.startswith("  speed row: ")]
    assert len(rows) == 12 and rows[0] == "speed row: seq 2048, bf16, loss full"
    assert "speed row: seq 8192, rowwise, loss chunks of 4096" in rows
    assert gpu_check.main(["--dry-run", "--only", "plan"]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[0].startswith("plan: llama3_1b") and len(lines) == 1 + len(gpu_plan.SETTINGS)


@pytest.mark.slow
def test_the_plan_rows_command_line_is_one_plan_py_accepts(tmp_path):
    """Device time is scarce: the plan row's plan.py command must not fail there for a flag (the largest setting)."""
    s = gpu_plan.SETTINGS[-1]
    p = gpu_plan.read_plan(gpu_plan.start_plan(s.overrides(), "h200", str(tmp_path / "p.json")), str(tmp_path / "p.json"))
    assert p["seq_len"] == s.seq_len == 8192 and p["global_batch_size"] == s.micro_batch and p["gpu"] == "h200"
    assert p["total_params"] > 1.2e9 and p["ranks"][0]["peak_bytes"] > 0


def test_the_multi_gpu_checks_skip_with_fewer_than_2_gpus():
    import gpu_train_checks
    for check in (gpu_train_checks.check_cp, gpu_train_checks.check_pp, gpu_train_checks.check_ep):
        ok, text = check()
        assert ok and text.startswith("skipped: needs 2 GPUs"), text


def test_only_runs_checks_in_the_table_order(capsys):
    assert gpu_check.main(["--dry-run", "--only", "flex,nccl", "--steps", "5"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.strip().splitlines()] == ["nccl", "flex"]


def test_a_check_that_raises_fails_with_one_line(capsys):
    def broken(ctx):
        raise RuntimeError("CUDA error: out of memory\nmore detail")

    result = gpu_check.run_check(gpu_check.Check("x", lambda a: "x", broken), None)
    line = capsys.readouterr().out.strip()
    assert not result["ok"] and line.startswith("FAIL x: raised RuntimeError: CUDA error: out of memory more detail ["), line


def _rows(f8_speedup: float, mfu: float) -> list[dict]:
    return [dict(seq_len=s, precision=p, loss_chunk=c, micro_batch=1, mfu=mfu, peak_mem_gib=1.0,
                 tokens_per_sec=1000.0 * (1 if p == "bf16" else f8_speedup))
            for s in gpu_speed.SEQ_LENS for p in gpu_speed.PRECISIONS for c in (0, gpu_speed.CHUNK)]


def test_the_goals_read_bf16_mfu_and_the_float8_speed_up():
    assert gpu_speed.goals(_rows(1.25, 0.46))[0]
    assert not gpu_speed.goals(_rows(1.1, 0.46))[0]
    ok, text = gpu_speed.goals(_rows(1.25, 0.40))
    assert not ok and "seq 2048 chunk 0: bf16 MFU 40.0%, float8 1.25x" in text
    assert not gpu_speed.goals(_rows(1.25, 0.46)[:3])[0]  # rows missing: the speed check did not finish
    assert gpu_speed.table(_rows(1.25, 0.46)).count("\n") == 2 + 11


@pytest.mark.parametrize("argv, words", [
    (["--only", "flex,warp"], "unknown check(s) ['warp']"),
    (["--steps", "0"], "expected an int >= 1, got '0'"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--only", "nccl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device is visible") and "--dry-run" in err
