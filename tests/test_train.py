"""End-to-end training on ranks as torchrun starts them (forked: launch.run), CPU/gloo: gradient accumulation on 2
ranks vs one big batch on one (train_fsdp.main in the test's process), the metrics a run must log, an odd-sized
corpus over 2 ranks."""
import math

import pytest

from launch import debug_run, debug_run_in_process, losses, metrics, prepared_data_dir

pytestmark = pytest.mark.slow  # every test here trains on ranks or for seconds

FAST = ["--train.steps", "4", "--checkpoint.interval", "1000", "--train.val_interval", "0"]


def run(tmp_path, name, nproc, *overrides, here=None):
    """The losses of a debug run of nproc ranks with FAST and overrides; here: (monkeypatch, capsys) runs a 1-rank one
    in this process (launch.debug_run_in_process)."""
    rd = tmp_path / name
    prepared_data_dir(rd)
    if here:
        assert nproc == 1
        debug_run_in_process(*here, rd, *FAST, *overrides)
    else:
        debug_run(nproc, rd, *FAST, *overrides, timeout=240)
    return losses(rd)


def max_rel(a, b):
    assert a.keys() == b.keys() and a
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


def test_gradient_accumulation_equals_one_big_batch(tmp_path, monkeypatch, capsys):
    # 1 rank x 1 batch of 16 against 2 ranks x 2 accumulated micro-batches of 4. Gradients
    # of other layouts against one process: tests/test_2d.py.
    big = run(tmp_path, "big", 1, here=(monkeypatch, capsys))
    accum = run(tmp_path, "accum2", 2, "--train.micro_batch_size", "4")
    assert max_rel(accum, big) <= 1e-5


def test_metrics_records_and_validation(tmp_path):
    rd = tmp_path / "m"
    prepared_data_dir(rd)
    debug_run(2, rd, "--train.steps", "3", "--train.val_interval", "2", "--checkpoint.interval", "1000")
    recs = metrics(rd)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "peak_mem_gib"):
            assert math.isfinite(r[key]), key
        assert 0 < r["mfu"] < 1.5
    assert abs(train[0]["loss"] - math.log(4096)) < 0.3  # a fresh model is near uniform over the vocabulary
    # warmup: step k of 20 runs at lr * k / 20
    assert train[0]["lr"] == pytest.approx(3e-3 / 20) and train[2]["lr"] == pytest.approx(3 * 3e-3 / 20)
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 3] and all("loss" not in r for r in val)
    assert (rd / "config.toml").exists() and (rd / "checkpoints").is_dir()


def test_a_tiny_odd_sized_corpus_runs_epochs_on_two_ranks_without_hanging(tmp_path):
    """Uneven data cannot strand a rank: the global cursor gives every rank the same step count."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(7):
        (src / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (3 + i))
    rd = tmp_path / "run"
    debug_run(2, rd, "--data.dataset", str(src), "--data.tokenizer_vocab_size", "300", "--data.seq_len", "16",
              "--data.val_fraction", "0", "--train.global_batch_size", "4", "--train.steps", "12",
              "--checkpoint.interval", "1000", timeout=180)
    recs = [r for r in metrics(rd) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert recs[-1]["epoch"] >= 1  # the run went through the corpus more than once
