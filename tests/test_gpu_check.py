"""benchmarks/gpu_check.py's parts that need no GPU: the plan, its flags, and its refusal without CUDA."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_check  # noqa: E402


def test_dry_run_prints_one_line_per_check(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == list(gpu_check.CHECKS)
    assert "llama3_1b" in lines[-1] and "20 timed steps" in lines[-1]


def test_only_selects_checks_in_the_given_order(capsys):
    assert gpu_check.main(["--dry-run", "--only", "flex,nccl", "--steps", "5"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.strip().splitlines()] == ["flex", "nccl"]


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
