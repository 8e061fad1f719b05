"""benchmarks/bench.py runs end to end on a tiny shape and reports every field (never a speed)."""
import json
import math
import os
import subprocess
import sys

import pytest

from model import ModelArgs, num_params

pytestmark = pytest.mark.slow  # the benchmark runs in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=512, max_seq_len=64)


def test_bench_reports_throughput_mfu_memory_loader_and_transformers(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40)
    out = tmp_path / "bench.json"
    model = [a for k, v in TINY.items() for a in (f"--model.{k}", str(v))]
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--config", os.path.join(ROOT, "configs", "debug.toml"),
           "--run_dir", str(tmp_path / "run"), *model, "--data.dataset", str(src), "--data.tokenizer_vocab_size", "300",
           "--data.val_fraction", "0", "--data.seq_len", "32", "--train.global_batch_size", "4",
           "--warmup", "1", "--steps", "2", "--threads", "1", "--hf", "--loader_seconds", "0.2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "tokens/s" in proc.stdout and "loader:" in proc.stdout
    res = json.loads(out.read_text())

    assert res["world_size"] == 1 and res["threads"] == 1 and res["tokens_per_step"] == 4 * 32
    assert res["peak_tflops"]["min"] > 0 and res["flops_per_token"] > 0
    assert set(res["variants"]) == {"ours", "transformers"}
    full_mib = num_params(ModelArgs(**TINY)) * 4 / 2 ** 20
    for name, v in res["variants"].items():
        for key in ("tokens_per_sec", "mfu", "step_s", "cpu_busy"):
            s = v[key]
            assert s["min"] <= s["median"] <= s["max"] and all(math.isfinite(x) for x in s.values()), (name, key)
        assert len(v["step_s_all"]) == 2 and v["tokens_per_sec"]["min"] > 0 and v["mfu"]["min"] > 0
        assert v["vs_ours"] > 0
        m = v["mem_mib_per_rank"]
        # One process holds the whole model: fp32 parameters, gradients and two AdamW moments
        # (plus a scalar step per tensor); the same shape in transformers has the same size.
        assert abs(m["params_mib"] - full_mib) < 1e-6 and abs(m["grads_mib"] - full_mib) < 1e-6, (name, m)
        assert 2 * full_mib <= m["optim_mib"] < 2 * full_mib + 0.01, (name, m)
        assert m["step_peak_mib"] > m["params_mib"] + m["optim_mib"]
    assert res["variants"]["ours"]["vs_ours"] == 1.0
    ld = res["loader"]
    assert ld["tokens_per_sec_per_rank"] > 0 and ld["step_consumes_per_rank"] > 0 and ld["ratio"] > 0
