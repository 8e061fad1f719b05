"""gpu_check.py's checks of whole training steps on CUDA: context, pipeline and expert parallelism, CPU offload, float8 against bf16, the
memory snapshot.

Each builds small runs with the trainer's own code (config overrides -> build_trainable
-> train_step) on random tokens and returns (ok, one line of figures); the cp, pp and ep checks run train_fsdp.py
under torchrun, as a user would.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from config import parse_config
from observability.profiling import StepProfiler
from parallel import float8
from storage.rundir import RunDir
from training.step import Trainable, build_trainable, train_step

DEBUG = ["--model.preset", "debug", "--data.seq_len", "128", "--train.global_batch_size", "8"]
# A shape float8 is built for (dims multiples of 16, matmuls large enough to matter), small enough to build in seconds.
FLOAT8_SHAPE = ["--model.dim", "1024", "--model.n_layers", "4", "--model.n_heads", "16", "--model.n_kv_heads", "4",
                "--model.ffn_dim", "4096", "--model.vocab_size", "32768", "--model.max_seq_len", "1024",
                "--data.seq_len", "1024", "--train.global_batch_size", "8"]
OFFLOAD_CLIP = 0.05
"""optim.grad_clip of the offload check: below the debug model's first gradient norms, so clipping acts."""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun_parity(what: str, common: list[str], layouts: list[tuple[str, int, list[str]]]) -> tuple[bool, str]:
    """train_fsdp.py under torchrun, 4 fp32 steps per layout; each later layout's losses against the first's (1e-4)."""
    if torch.cuda.device_count() < 2:  # NCCL refuses two ranks on one GPU
        return True, f"skipped: needs 2 GPUs, {torch.cuda.device_count()} visible"
    tmp = tempfile.mkdtemp(prefix=f"gpu_check_{what}_")
    common = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--train.device", "cuda", "--train.dtype",
              "float32", "--train.steps", "4", "--train.val_interval", "0", "--checkpoint.interval", "1000", *common]
    runs = {}
    for name, n, extra in layouts:
        rd = os.path.join(tmp, name)
        if runs:  # the corpus tokenized once
            shutil.copytree(os.path.join(tmp, layouts[0][0], "data"), os.path.join(rd, "data"))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               os.path.join(ROOT, "train_fsdp.py"), *common, "--run_dir", rd, *extra],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            return False, f"{name} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"
        with open(os.path.join(rd, "metrics.jsonl")) as f:
            runs[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    first = layouts[0][0]
    parts, ok = [], True
    for name, _, _ in layouts[1:]:
        rel = _rel(runs[name], runs[first])
        ok &= rel <= 1e-4 and len(runs[name]) == 4
        parts.append(f"{name} vs {first}: max relative difference {rel:.1e}")
    return ok, f"losses over 4 steps, {'; '.join(parts)} (need <= 1e-4)"


def check_cp() -> tuple[bool, str]:
    """Context parallelism on CUDA: 1 GPU vs cp 2 on 2 GPUs (Ulysses over NCCL); skipped on one GPU."""
    return _torchrun_parity("cp", ["--model.n_kv_heads", "4", "--model.document_mask", "true"],
                            [("cp1", 1, []), ("cp2", 2, ["--parallel.cp", "2"])])


def check_pp() -> tuple[bool, str]:
    """Pipeline parallelism on CUDA: 1 GPU vs pp 2 (1F1B and GPipe, activations sent over NCCL); skipped on one GPU."""
    return _torchrun_parity("pp", ["--model.n_layers", "4"], [
        ("pp1", 1, []),
        *((f"pp2-{s}", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", s, "--parallel.pp_microbatches", "4"])
          for s in ("1F1B", "GPipe"))])


def check_ep() -> tuple[bool, str]:
    """Expert parallelism on CUDA: an MoE debug model on 1 GPU vs ep 2 (tokens sent by all-to-all over NCCL, the
    experts' grouped matmul); skipped on one GPU."""
    moe = ["--model.n_experts", "4", "--model.experts_per_token", "2", "--model.expert_ffn_dim", "192"]
    return _torchrun_parity("ep", moe, [("ep1", 1, []), ("ep2", 2, ["--parallel.ep", "2"])])


def _steps(overrides: list[str], mesh, device, n: int) -> tuple[list[float], list[float], Trainable]:
    """(losses, pre-clip gradient norms, the Trainable) of n trainer steps on one fixed random batch."""
    cfg = parse_config([*overrides, "--train.steps", "100", "--optim.warmup_steps", "1"])
    tr = build_trainable(cfg, 0, mesh, device)
    m, t = cfg.model, cfg.data.seq_len
    tokens = torch.randint(0, m.vocab_size, (cfg.train.global_batch_size, t + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    losses, norms = [], []
    for _ in range(n):
        r = train_step(tr, [(tokens[:, :-1], tokens[:, 1:])])
        losses.append(r.global_loss(dist.group.WORLD))
        norms.append(r.grad_norm.item())
    return losses, norms, tr


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_offload(device, mesh) -> tuple[bool, str]:
    """Two fp32 steps with parallel.cpu_offload against two without, clipping on (pytorch#148532)."""
    common = [*DEBUG, "--train.dtype", "float32", "--optim.grad_clip", str(OFFLOAD_CLIP)]
    ref_losses, ref_norms, _ = _steps(common, mesh, device, 2)
    losses, norms, tr = _steps([*common, "--parallel.cpu_offload", "true"], mesh, device, 2)
    on_cpu = all(p.to_local().device.type == "cpu" for p in tr.model.parameters())
    rel_loss, rel_norm = _rel(losses, ref_losses), _rel(norms, ref_norms)
    clipped = min(ref_norms) > OFFLOAD_CLIP
    ok = on_cpu and clipped and rel_loss <= 1e-4 and rel_norm <= 1e-4
    return ok, (f"2 steps, fp32, grad_clip {OFFLOAD_CLIP} (norms {norms[0]:.3f}, {norms[1]:.3f}: clipped "
                f"{'yes' if clipped else 'NO'}); parameters on CPU: {on_cpu}; vs no offload: loss rel {rel_loss:.1e}, "
                f"grad norm rel {rel_norm:.1e} (need <= 1e-4)")


def check_float8(device, mesh) -> tuple[bool, str]:
    """Two bf16 steps with train.float8 tensorwise and rowwise against plain bf16, same weights and tokens."""
    for recipe in float8.RECIPES:
        float8.check(recipe, device)  # torchao present, a GPU with float8 matmuls
    common = [*FLOAT8_SHAPE, "--train.dtype", "bfloat16", "--optim.lr", "1e-3"]
    ref, _, _ = _steps(common, mesh, device, 2)
    ok, figures = True, [f"bf16 loss {ref[0]:.4f}, {ref[1]:.4f}"]
    for recipe in float8.RECIPES:
        losses, _, tr = _steps([*common, "--train.float8", recipe], mesh, device, 2)
        n = len(float8.converted(tr.model))
        rel = _rel(losses, ref)
        ok &= n == 4 * 7 and rel <= 2e-2 and losses != ref
        figures.append(f"{recipe} {losses[0]:.4f}, {losses[1]:.4f} (rel {rel:.1e}, {n} Float8Linear)")
        del tr
        torch.cuda.empty_cache()
    return ok, "; ".join(figures) + " (need rel <= 2e-2, not equal, 28 converted)"


def check_snapshot(device, mesh) -> tuple[bool, str]:
    """train.profile_steps' trace and CUDA memory snapshot of one step, written and read back."""
    from torch.cuda import _memory_viz

    cfg = parse_config([*DEBUG, "--train.dtype", "bfloat16", "--train.steps", "10"])
    tr = build_trainable(cfg, 0, mesh, device)
    tokens = torch.randint(0, cfg.model.vocab_size, (8, 129), device=device)
    with tempfile.TemporaryDirectory() as run_dir:
        prof = StepProfiler((1, 1), run_dir, device, True)  # the loop's profiler, as --train.profile_steps 1-1
        prof.before_step(1)
        train_step(tr, [(tokens[:, :-1], tokens[:, 1:])])
        trace = prof.after_step(1)
        path = os.path.join(RunDir(run_dir).profile, "memory_steps_1-1.pickle")
        with open(path, "rb") as f:
            snap = pickle.load(f)
        events = sum(len(t) for t in snap.get("device_traces", []))
        html = _memory_viz.trace_plot(snap)  # what pytorch.org/memory_viz draws
        trace_kib, snap_kib = os.path.getsize(trace) / 1024, os.path.getsize(path) / 1024
    ok = bool(snap.get("segments")) and events > 0 and len(html) > 0 and trace_kib > 0
    return ok, (f"trace {trace_kib:,.0f} KiB; snapshot {snap_kib:,.0f} KiB, {len(snap.get('segments', []))} "
                f"segments, {events} allocator events, drawn by torch.cuda._memory_viz.trace_plot")
