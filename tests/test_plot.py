"""plot.py draws two synthetic runs into a valid PNG and refuses bad input with one line 'error: ...' and status 2."""
import json
import math
import os

import pytest

import plot
from launch import refused

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, n_train=30, val_steps=(10, 20, 30), extra_val=False, seed=0.0, tasks=(), events=False,
               moe=False):
    """A metrics.jsonl like the trainer's: n_train train records, a validation record at each of val_steps; moe: the
    train records carry an MoE run's moe_max_load, moe_bias_range and moe_aux_loss; events:
    updates skipped at steps 5 (NaN loss) and 7, and rollbacks (steps 14 and 12 back to 10, step 25 back to 0) as the
    trainer leaves them (the train records of the steps trained again are the later ones)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, n_train + 1):
        loss = 8.3 - 3 * math.log1p(step) / math.log1p(n_train) + 0.1 * math.sin(step + seed)
        lines.append({"step": step, "loss": loss,
                      "lr": 3e-3 * min(1.0, step / 5), "grad_norm": 1.0, "tokens_per_sec": 3500.0 + 10 * step,
                      "mfu": 0.35, "tokens_seen": 2048 * step, "epoch": 0, "peak_mem_gib": 0.5})
        if moe:
            lines[-1].update(moe_max_load=1.1 + 2.8 / step, moe_bias_range=0.01 * min(step, 20), moe_aux_loss=0.02)
        if step in val_steps:
            rec = {"step": step, "val_loss": 8.0 - step / 10, "val_ppl": math.exp(8.0 - step / 10)}
            if extra_val:
                rec["val_loss/code"] = 8.2 - step / 10
            lines.append(rec)
            if tasks:  # the loop writes downstream scores as a record of their own, after validation's
                lines.append({"step": step, **{f"eval/{t}/{m}": 0.25 + step / 200 + i / 20 for i, t in enumerate(tasks)
                                               for m in ("acc", "acc_norm")}})
    if events:
        for r in lines:
            if r.get("step") in (5, 7) and "loss" in r:
                r.update(skipped=True, skip_reason="spike", loss=r["loss"] if r["step"] == 7 else math.nan)
        lines.insert(15, {"step": 14, "rollback": {"to_step": 10, "skip": [11, 14], "trigger": "2 outliers in a row"}})
        lines.insert(16, {"step": 12, "rollback": {"to_step": 10, "skip": [15, 16], "trigger": "2 outliers in a row"}})
        lines.append({"step": 25, "rollback": {"to_step": 0, "skip": [1, 25], "trigger": "non-finite gradient norm"}})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_read_metrics_fills_validation_tokens(tmp_path):
    train, val = plot.read_metrics(str(_write_run(tmp_path / "a", extra_val=True) / "metrics.jsonl"))
    assert len(train) == 30 and [r["step"] for r in val] == [10, 20, 30]
    assert [r["tokens_seen"] for r in val] == [20480, 40960, 61440] and "val_loss/code" in val[0]


def test_downstream_records_join_their_steps_validation(tmp_path):
    _, val = plot.read_metrics(str(_write_run(tmp_path / "a", tasks=("mc", "arc")) / "metrics.jsonl"))
    assert [r["step"] for r in val] == [10, 20, 30] and val[1]["tokens_seen"] == 40960
    assert val[1]["val_loss"] == 6.0 and val[1]["eval/mc/acc"] == 0.35 and val[1]["eval/arc/acc_norm"] == pytest.approx(0.4)


def test_rollbacks_and_skipped_updates_are_marked_where_they_happened(tmp_path):
    path = str(_write_run(tmp_path / "a", events=True) / "metrics.jsonl")
    train, _ = plot.read_metrics(path)
    rollbacks = plot.read_rollbacks(path)
    assert [(r["step"], r["to_step"], r["skip"]) for r in rollbacks] == [(14, 10, [11, 14]), (12, 10, [15, 16]),
                                                                         (25, 0, [1, 25])]
    m = plot.marks(train, rollbacks)
    # At step 10's tokens_seen (one mark for its two rollbacks), and at 0 for step 0.
    assert m["rollback"] == [(20480, 10, "skip 11-14, 15-16"), (0, 0, "skip 1-25")]
    # Step 5's loss is NaN: its x sits on step 4's loss; step 7's on its own.
    assert m["skipped"] == [(10240, train[3]["loss"], 5), (14336, train[6]["loss"], 7)]
    assert plot.marks(train, []) == {"rollback": [], "skipped": m["skipped"]}


def test_labels_and_smoothing():
    assert plot.run_labels(["runs/a", "runs/b/"]) == ["a", "b"]
    assert plot.run_labels(["r/x/a", "r/y/a", "r/y/a/"]) == ["x/a", "y/a", "y/a #2"]
    assert plot.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot._tokens(1_500_000) == "1.5M" and plot._tokens(10_000_000) == "10M" and plot._tokens(0) == "0"


def test_two_runs_make_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    a = _write_run(tmp_path / "runs" / "a")
    b = _write_run(tmp_path / "runs" / "b", extra_val=True, seed=1.0, tasks=("mc", "arc"), events=True)
    out = tmp_path / "new" / "dir" / "curves.png"  # the parent is created
    assert plot.main([str(a), str(b), "--out", str(out), "--smooth", "5"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (2 runs, 60 train records)"
    assert out.read_bytes()[:8] == PNG_MAGIC
    image = imread(str(out))
    assert image.ndim == 3 and image.shape[2] in (3, 4) and image.shape[0] >= 400 and image.shape[1] >= 600
    assert image.shape[1] > 1.4 * image.shape[0]  # a third column of panels: downstream acc and acc_norm


def test_moe_runs_get_a_load_column_and_dense_runs_do_not(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    dense, moe = _write_run(tmp_path / "dense"), _write_run(tmp_path / "moe", moe=True)
    assert plot.moe_keys([("dense", *plot.read_metrics(str(dense / "metrics.jsonl")))]) == []
    both = [(d.name, *plot.read_metrics(str(d / "metrics.jsonl"))) for d in (dense, moe)]
    assert plot.moe_keys(both) == ["moe_max_load", "moe_bias_range", "moe_aux_loss"]
    shapes = {}
    for name, runs in (("dense", both[:1]), ("both", both)):
        plot.draw(runs, str(tmp_path / f"{name}.png"))
        shapes[name] = imread(str(tmp_path / f"{name}.png")).shape
    # The same figure as the dense run's, with a third column of panels (load; bias range and aux loss).
    assert shapes["both"][0] == shapes["dense"][0]
    assert shapes["both"][1] == pytest.approx(1.5 * shapes["dense"][1], rel=0.02)


def test_bad_input_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "curves.png")
    missing = tmp_path / "nothing"
    missing.mkdir()
    assert f"{missing / 'metrics.jsonl'} not found" in refused(plot.main, [str(missing), "--out", out], capsys)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert f"{empty / 'metrics.jsonl'} is empty" in refused(plot.main, [str(empty), "--out", out], capsys)

    bad = _write_run(tmp_path / "bad")
    with open(bad / "metrics.jsonl", "a") as f:
        f.write('{"step": 31, "loss": 4.2, "lr"\n')
    assert f"{bad / 'metrics.jsonl'} line 34:" in refused(plot.main, [str(bad), "--out", out], capsys)

    assert "no run directories" in refused(plot.main, ["--out", out], capsys)
    assert "--smooth" in refused(plot.main, [str(bad), "--out", out, "--smooth", "0"], capsys)
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("out, msg", [
    ("s3://bucket/curves.png", "--out 's3://bucket/curves.png' is a URL; pass a local file ending in .png"),
    ("/proc/forbidden/curves.png", "cannot write /proc/forbidden/curves.png"),
    ("run/metrics.jsonl/curves.png", "cannot write run/metrics.jsonl/curves.png"),
    ("run", "--out 'run' is a folder; pass a file ending in .png, e.g. run/curves.png"),
])
def test_an_unusable_out_is_one_line_and_creates_nothing(tmp_path, capsys, monkeypatch, out, msg):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would show up here as ./s3:/...
    assert msg in refused(plot.main, ["run", "--out", out], capsys)
    assert os.listdir(tmp_path) == ["run"] and os.listdir(tmp_path / "run") == ["metrics.jsonl"]


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    line = refused(plot.main, [str(_write_run(tmp_path / "a")), "--out", str(tmp_path / "c.png")], capsys)
    assert line == ("error: plot.py needs the Python package 'matplotlib', which is not installed: "
                    "pip install -e \".[plot]\"")
