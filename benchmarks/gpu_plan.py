"""gpu_check.py's plan row: plan.py's peak memory and tokens/s for llama3_1b on this GPU against the real step's.

Each setting is planned by plan.py (a process of its own: it builds fake process groups, which this process, already
in a real one, cannot), all of them at once on the CPU, while the GPU measures them one after the other with
gpu_speed.py's timing (the trainer's build_trainable and train_step on random tokens, the median of the timed steps,
torch.cuda.max_memory_allocated over them). The plan models the eager step; the compiled rows show how far
compilation moves a run from it. Goals (docs/planning.md): eager peak within 5%, tokens/s within 15%. Then the
layout `plan.py --search` picks for llama3_1b on one GPU of this kind, measured the same way, against the preset's
bf16 MFU in benchmarks/results/h200_2026-12-04_gpu_check.md (50.6%).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile

import torch

from config import parse_config
from gpu_speed import timed
from model import flops_per_token
from planning.gpus import gpu_named
from training.planned import LAUNCHER_ENV
from training.step import build_trainable, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--model.preset", "llama3_1b", "--train.device",
        "cuda", "--train.dtype", "bfloat16", "--optim.warmup_steps", "10", "--train.steps", "1000"]
PEAK_GOAL, SPEED_GOAL = 0.05, 0.15
PRESET_MFU = 0.506
"""llama3_1b's bf16 MFU on one H200, compiled, seq 2048, micro-batch 16 (the gpu_check run of 2026-12-04)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    compiled: bool
    seq_len: int
    micro_batch: int
    chunk: int
    """train.loss_chunk_size (0: full logits)."""

    def overrides(self) -> list[str]:
        return [*BASE, "--train.compile", str(self.compiled).lower(), "--data.seq_len", str(self.seq_len),
                "--train.global_batch_size", str(self.micro_batch), "--train.loss_chunk_size", str(self.chunk)]

    def label(self) -> str:
        return (f"{'compiled' if self.compiled else 'eager'}, seq {self.seq_len}, micro-batch {self.micro_batch}, "
                f"loss {'chunks of ' + str(self.chunk) if self.chunk else 'full'}")


SETTINGS = [Setting(c, s, m, k) for c in (False, True) for s, m, k in
            ((2048, 16, 0), (2048, 16, 4096), (2048, 4, 0), (8192, 4, 4096))]


def gpu_kind(device) -> str:
    """planning/gpus.py's name for this GPU ('h200', 'h100', ...; 'h100' when the name is not in the table)."""
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "b200", "a100", "mi300x") if k in name), "h100")


def start_plan(words: list[str], gpu: str, out: str, search: bool = False) -> subprocess.Popen:
    """plan.py for one rank of `gpu` on the command line `words`, its JSON (or --search's list) written to out."""
    cmd = [sys.executable, os.path.join(ROOT, "plan.py"), *words, "--world_size", "1", "--gpu", gpu, "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return subprocess.Popen(cmd + (["--search"] if search else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**env, "CUDA_VISIBLE_DEVICES": ""})


def measure(words: list[str], steps: int, mesh, device) -> dict:
    """The real step of the command line `words` on this GPU: tokens/s (median of `steps` after 3 warm-up steps),
    MFU against the GPU table's bf16 peak, and max_memory_allocated in bytes over the timed steps."""
    cfg = parse_config(words)
    batch, seq = cfg.train.global_batch_size, cfg.data.seq_len
    micro = cfg.train.micro_batch_size or batch  # --search may pick gradient accumulation
    tr = build_trainable(cfg, 0, mesh, device)
    gen = torch.Generator(device=device).manual_seed(0)

    def step():
        tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), device=device, generator=gen)
        train_step(tr, [(t[:, :-1], t[:, 1:]) for t in tokens.split(micro)])

    median_s, peak = timed(step, steps, device)
    tps = batch * seq / median_s
    return {"tokens_per_sec": tps, "peak_bytes": peak,
            "mfu": tps * flops_per_token(cfg.model, seq) / gpu_named(gpu_kind(device)).bf16_flops}


def free() -> None:
    """Release the last row's model and compiled graphs before the next row."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.compiler.reset()


def read_plan(proc: subprocess.Popen, path: str) -> dict:
    """plan.py's JSON once it has finished; raises RuntimeError with its last line when it failed."""
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"plan.py exited {proc.returncode}: {out.strip().splitlines()[-1:]}")
    with open(path) as f:
        return json.load(f)


def check_plan(steps: int, mesh, device) -> tuple[bool, str, list]:
    """Every setting planned and measured; ok when the eager rows meet both goals and the searched layout's MFU is
    above the preset's. Prints each row as it finishes."""
    gpu, tmp = gpu_kind(device), tempfile.mkdtemp(prefix="gpu_plan-")
    plans = [start_plan(s.overrides(), gpu, os.path.join(tmp, f"{i}.json")) for i, s in enumerate(SETTINGS)]
    searched = start_plan(SETTINGS[0].overrides(), gpu, os.path.join(tmp, "search.json"), search=True)
    rows, ok = [], True
    for i, (s, proc) in enumerate(zip(SETTINGS, plans)):
        p = read_plan(proc, os.path.join(tmp, f"{i}.json"))
        try:
            real = measure(s.overrides(), steps, mesh, device)
        finally:
            free()
        planned_peak = max(r["peak_bytes"] for r in p["ranks"])
        row = {**dataclasses.asdict(s), "planned_peak_bytes": planned_peak, "peak_bytes": real["peak_bytes"],
               "peak_err": planned_peak / real["peak_bytes"] - 1, "planned_tokens_per_sec": p["predicted_tokens_per_sec"],
               "tokens_per_sec": real["tokens_per_sec"],
               "speed_err": p["predicted_tokens_per_sec"] / real["tokens_per_sec"] - 1, "mfu": real["mfu"]}
        rows.append(row)
        if not s.compiled:
            ok &= abs(row["peak_err"]) <= PEAK_GOAL and abs(row["speed_err"]) <= SPEED_GOAL
        print(f"  plan row: {s.label()}: peak planned {planned_peak / 2 ** 30:.2f} GiB, measured "
              f"{real['peak_bytes'] / 2 ** 30:.2f} GiB ({row['peak_err']:+.1%}); tokens/s planned "
              f"{row['planned_tokens_per_sec']:,.0f}, measured {real['tokens_per_sec']:,.0f} ({row['speed_err']:+.1%})",
              flush=True)
    out, _ = searched.communicate(timeout=1200)
    cmds = [line[line.index("torchrun"):] for line in out.splitlines() if "torchrun" in line]
    if searched.returncode != 0 or not cmds:
        return False, f"plan.py --search printed no command (exit {searched.returncode})", rows
    words = shlex.split(cmds[0])[4:]  # after 'torchrun --standalone --nproc_per_node=1 SCRIPT'
    try:
        best = measure(words, steps, mesh, device)
    finally:
        free()
    ok &= best["mfu"] > PRESET_MFU
    rows.append({"searched": cmds[0], **best})
    eager = [r for r in rows if "compiled" in r and not r["compiled"]]
    return ok, (f"eager peak error up to {max(abs(r['peak_err']) for r in eager):.1%} (goal {PEAK_GOAL:.0%}), "
                f"tokens/s error up to {max(abs(r['speed_err']) for r in eager):.1%} (goal {SPEED_GOAL:.0%}); "
                f"--search's layout: MFU {best['mfu']:.1%} vs the preset's {PRESET_MFU:.1%} ({cmds[0]})"), rows


def plan_lines() -> list[str]:
    """The plan row's --dry-run lines."""
    return ([f"plan: llama3_1b, bf16, {len(SETTINGS)} settings: plan.py's peak and tokens/s vs the real step's "
             f"(goals for eager: peak within {PEAK_GOAL:.0%}, tokens/s within {SPEED_GOAL:.0%}); then plan.py "
             f"--search's layout on this GPU: MFU above the preset's {PRESET_MFU:.1%}"]
            + [f"  plan row: {s.label()}" for s in SETTINGS])
