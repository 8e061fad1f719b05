"""gpu_check.py's speed table: llama3_1b compiled on one GPU, per sequence length x precision x loss.

Every row is the trainer's own step (build_trainable, train_step: forward,
backward, clipping, AdamW, schedule) on random tokens, timed after warm-up steps (compilation)
as the median of --steps steps, with torch.cuda.max_memory_allocated over the timed steps.
MFU is against the GPU's data-sheet dense bf16 peak, for float8 rows too (the convention of
torchtitan's float8 figures: float8's gain shows as a higher "bf16 MFU").
"""
from __future__ import annotations

import dataclasses
import gc
import time

import torch

from config import parse_config
from model import flops_per_token
from training.step import build_trainable, train_step

SEQ_LENS = (2048, 8192)
PRECISIONS = ("bf16", "tensorwise", "rowwise")
CHUNK = 4096
TOKENS_PER_STEP = 32_768
"""Tokens a step (micro-batch x seq): 16 x 2048 or 4 x 8192; halved on an out-of-memory error."""
H200_BF16_TFLOPS = 989.0
GOAL_MFU = 0.45
GOAL_FLOAT8_SPEEDUP = 1.2


@dataclasses.dataclass(frozen=True)
class Setting:
    seq_len: int
    precision: str
    """'bf16', or a train.float8 recipe (bf16 mixed precision around the float8 matmuls)."""
    chunk: int
    """train.loss_chunk_size (0: full logits)."""

    def label(self) -> str:
        return f"seq {self.seq_len}, {self.precision}, loss {'chunks of ' + str(self.chunk) if self.chunk else 'full'}"


def settings() -> list[Setting]:
    return [Setting(s, p, c) for s in SEQ_LENS for p in PRECISIONS for c in (0, CHUNK)]


def plan(steps: int) -> list[str]:
    """The speed table's rows, for --dry-run."""
    head = (f"speed: llama3_1b, compiled, {TOKENS_PER_STEP:,} tokens a step (halved on OOM), {steps} timed steps "
            f"after 3 warm-up steps, per row: tokens/s, MFU of {H200_BF16_TFLOPS:g} TFLOP/s bf16, peak memory; "
            f"goals: bf16 MFU >= {GOAL_MFU:.0%}, float8 >= {GOAL_FLOAT8_SPEEDUP}x bf16 tokens/s")
    return [head] + [f"  speed row: {s.label()}" for s in settings()]


def _overrides(s: Setting, micro: int) -> list[str]:
    f8 = "off" if s.precision == "bf16" else s.precision
    return ["--model.preset", "llama3_1b", "--train.dtype", "bfloat16", "--train.compile", "true",
            "--data.seq_len", str(s.seq_len), "--train.global_batch_size", str(micro),
            "--train.loss_chunk_size", str(s.chunk), "--train.float8", f8, "--optim.warmup_steps", "10",
            "--train.steps", "1000"]


def run_row(s: Setting, micro: int, steps: int, mesh, device) -> dict:
    """One row: build, 3 warm-up steps, `steps` timed steps; returns its figures."""
    cfg = parse_config(_overrides(s, micro))
    tr = build_trainable(cfg, 0, mesh, device)
    gen = torch.Generator(device=device).manual_seed(0)

    def step():
        tokens = torch.randint(0, cfg.model.vocab_size, (micro, s.seq_len + 1), device=device, generator=gen)
        train_step(tr, [(tokens[:, :-1], tokens[:, 1:])])

    median_s, peak = timed(step, steps, device)
    tps = micro * s.seq_len / median_s
    return {**dataclasses.asdict(s), "micro_batch": micro, "tokens_per_sec": tps,
            "mfu": tps * flops_per_token(cfg.model, s.seq_len) / (H200_BF16_TFLOPS * 1e12),
            "peak_mem_gib": peak / 2**30}


def timed(step, steps: int, device) -> tuple[float, int]:
    """step() 3 times untimed (compilation, the optimizer's state), then `steps` times: (the median step in seconds,
    torch.cuda.max_memory_allocated over the timed steps in bytes)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated(device)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.compiler.reset()  # each row's model compiles afresh (on-disk caches keep repeats fast), never past dynamo's recompile limit


def measure(s: Setting, steps: int, mesh, device) -> dict | None:
    """run_row at TOKENS_PER_STEP, halving the micro-batch on OOM; None if not even 1 sequence fits."""
    micro = max(TOKENS_PER_STEP // s.seq_len, 1)
    while micro >= 1:
        try:
            return run_row(s, micro, steps, mesh, device)
        except torch.OutOfMemoryError:
            micro //= 2
        finally:
            _free()
    return None


def goals(rows: list[dict]) -> tuple[bool, str]:
    """The first GPU run's goals over the table: bf16 MFU, and float8 tensorwise's speed-up, per seq and loss."""
    by = {(r["seq_len"], r["precision"], r["loss_chunk"]): r for r in rows}
    ok, parts = True, []
    for seq in SEQ_LENS:
        for chunk in (0, CHUNK):
            bf16, f8 = by.get((seq, "bf16", chunk)), by.get((seq, "tensorwise", chunk))
            if bf16 is None or f8 is None:
                ok, parts = False, parts + [f"seq {seq} chunk {chunk}: missing rows"]
                continue
            speedup = f8["tokens_per_sec"] / bf16["tokens_per_sec"]
            ok &= bf16["mfu"] >= GOAL_MFU and speedup >= GOAL_FLOAT8_SPEEDUP
            parts.append(f"seq {seq} chunk {chunk}: bf16 MFU {bf16['mfu']:.1%}, float8 {speedup:.2f}x")
    return ok, "; ".join(parts) + f" (goals: MFU >= {GOAL_MFU:.0%}, float8 >= {GOAL_FLOAT8_SPEEDUP}x)"


def check_speed(steps: int, mesh, device) -> tuple[bool, str, list]:
    """Every row of settings(); ok when each ran. Prints each row as it finishes (the table is long)."""
    rows = []
    for s in settings():
        t0 = time.perf_counter()
        row = measure(s, steps, mesh, device)
        if row is None:
            print(f"  {s.label()}: no micro-batch fits", flush=True)
            continue
        row["loss_chunk"] = row.pop("chunk")
        rows.append(row)
        print(f"  {s.label()}: micro-batch {row['micro_batch']}, {row['tokens_per_sec']:,.0f} tokens/s, "
              f"MFU {row['mfu']:.1%}, peak {row['peak_mem_gib']:.1f} GiB [{time.perf_counter() - t0:.0f} s]",
              flush=True)
    return len(rows) == len(settings()), f"{len(rows)} of {len(settings())} rows ran", rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, for benchmarks/results/."""
    out = ["| seq | precision | loss | micro-batch | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = f"chunks of {r['loss_chunk']}" if r["loss_chunk"] else "full"
        out.append(f"| {r['seq_len']} | {r['precision']} | {loss} | {r['micro_batch']} | {r['tokens_per_sec']:,.0f} | "
                   f"{r['mfu']:.1%} | {r['peak_mem_gib']:.1f} |")
    return "\n".join(out)
