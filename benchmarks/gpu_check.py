"""The CUDA paths the CPU test suite cannot reach, each against a reference, then the 1B preset's speed.

    python benchmarks/gpu_check.py                  # on one CUDA GPU, under 8 minutes on an H200
    python benchmarks/gpu_check.py --dry-run        # print the plan; needs no GPU
    python benchmarks/gpu_check.py --only nccl,flex --json out.json

Checks (each prints one PASS/FAIL line with its figures):
  nccl     the NCCL process group on 1 GPU: an all-reduce of a CUDA tensor (and gloo for CPU ones)
  bf16     one training step of the debug model in bf16 mixed precision vs fp32: loss within 1e-2 relative
  flex     FlexAttention with the document block mask vs SDPA with the boolean mask, forward and
           backward, at the 1B preset's head shape (bf16: max abs diff <= 2e-2; fp32: <= 1e-4)
  chunked  peak memory (torch.cuda.max_memory_allocated) of the loss step at vocab 128,256 with and
           without train.loss_chunk_size; loss equal within 1e-4 relative
  cp       (2 GPUs; skipped on one) the debug model with document_mask, fp32, 4 steps on 1 GPU vs cp 2
           (Ulysses over NCCL, FlexAttention over the whole sequence): losses within 1e-4 relative
  speed    the llama3_1b preset, bf16, compiled, 20 steps at the largest micro-batch that fits,
           with and without the chunked loss: tokens/s, MFU against 989 TFLOP/s, peak memory
           (informational: no threshold)

Runs in one process (torchrun is not needed). Exit status 0 when every check that ran passed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distributed  # noqa: E402
import parallelize  # noqa: E402
import trainer  # noqa: E402
from cli import ArgumentParser, number  # noqa: E402
from config import parse_config  # noqa: E402
from loss import token_loss_sum  # noqa: E402
from model import PRESETS, ModelArgs, block_causal_mask, block_mask, flops_per_token  # noqa: E402

CHECKS = ("nccl", "bf16", "flex", "chunked", "cp", "speed")
H200_BF16_TFLOPS = 989.0
SPEED_SEQ_LEN = 2048
SPEED_MICRO_BATCHES = (16, 8, 4, 2, 1)
CHUNK = 4096


def plan(args) -> list[str]:
    """One line per check that will run, with its settings."""
    lines = {
        "nccl": "nccl: all_reduce of a CUDA tensor over backend 'cpu:gloo,cuda:nccl' (world 1)",
        "bf16": "bf16: debug model, seq 128, batch 8: one step with train.dtype bfloat16 vs float32, same seed",
        "flex": "flex: q/k/v (2, 32 heads, 2048, 64), 8 KV heads, 5 documents a row: FlexAttention vs SDPA mask",
        "chunked": f"chunked: dim 2048, vocab 128,256, 2 x 4096 tokens: loss step peak memory, chunk {CHUNK} vs none",
        "cp": "cp: debug model, document_mask, fp32, 4 steps: train_fsdp.py on 1 GPU vs --parallel.cp 2 on 2 GPUs "
              "(skipped with fewer)",
        "speed": f"speed: llama3_1b, bf16, compile, seq {SPEED_SEQ_LEN}, micro-batch the largest of "
                 f"{SPEED_MICRO_BATCHES} that fits, {args.steps} timed steps, loss_chunk_size 0 and {CHUNK}",
    }
    return [lines[name] for name in args.only]


def _step_loss(cfg_model: ModelArgs, dtype: str, mesh, device, tokens, chunk: int = 0) -> float:
    """Mean token loss of one forward/backward (no update) of a fresh model from seed 0."""
    model = parallelize.build_model(cfg_model, mesh, device, 0, parallelize.ParallelConfig(), dtype=dtype)
    n = tokens[:, 1:].numel()
    loss, _ = trainer.forward_backward(model, [(tokens[:, :-1], tokens[:, 1:])], n, 1, device, mesh, chunk)
    return loss.item() / n


def check_nccl(device) -> tuple[bool, str]:
    x = torch.full((4,), 3.0, device=device)
    dist.all_reduce(x)
    y = torch.ones(2)
    dist.all_reduce(y)  # the CPU half of the backend: gloo
    ok = torch.equal(x.cpu(), torch.full((4,), 3.0)) and torch.equal(y, torch.ones(2))
    return ok, f"backend {dist.get_backend()}, all_reduce of a CUDA tensor and a CPU tensor"


def check_bf16(device, mesh) -> tuple[bool, str]:
    args = ModelArgs(**PRESETS["debug"])
    tokens = torch.randint(0, args.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0)).to(device)
    fp32 = _step_loss(args, "float32", mesh, device, tokens)
    bf16 = _step_loss(args, "bfloat16", mesh, device, tokens)
    rel = abs(bf16 - fp32) / fp32
    return rel <= 1e-2, f"loss fp32 {fp32:.5f}, bf16 {bf16:.5f}, relative difference {rel:.2e} (need <= 1e-2)"


def check_flex(device) -> tuple[bool, str]:
    from model import _flex_attention

    gen = torch.Generator(device=device).manual_seed(0)
    b, h, kv, t, d = 2, 32, 8, 2048, 64
    starts = torch.zeros(b, t, dtype=torch.bool, device=device)
    starts[:, torch.tensor([0, 300, 700, 1200, 1900])] = True
    doc = starts.long().cumsum(1)
    figures, ok = [], True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q = torch.randn(b, h, t, d, device=device, generator=gen, dtype=dtype, requires_grad=True)
        k = torch.randn(b, kv, t, d, device=device, generator=gen, dtype=dtype, requires_grad=True)
        v = torch.randn(b, kv, t, d, device=device, generator=gen, dtype=dtype, requires_grad=True)
        grad = torch.randn(b, h, t, d, device=device, generator=gen, dtype=dtype)
        out_flex = _flex_attention()(q, k, v, block_mask=block_mask(doc), enable_gqa=True)
        g_flex = torch.autograd.grad(out_flex, (q, k, v), grad)
        rep = h // kv
        out_ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=block_causal_mask(doc))
        g_ref = torch.autograd.grad(out_ref, (q, k, v), grad)
        diffs = [(a.float() - r.float()).abs().max().item() for a, r in zip((out_flex, *g_flex), (out_ref, *g_ref))]
        ok &= max(diffs) <= tol
        figures.append(f"{str(dtype)[6:]}: max abs diff out {diffs[0]:.1e}, dq {diffs[1]:.1e}, dk {diffs[2]:.1e}, "
                       f"dv {diffs[3]:.1e} (need <= {tol:g})")
    return ok, "; ".join(figures)


def check_chunked(device) -> tuple[bool, str]:
    dim, vocab, n = 2048, 128_256, 4096
    gen = torch.Generator(device=device).manual_seed(0)
    output = torch.nn.Linear(dim, vocab, bias=False, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (2, n), device=device, generator=gen)
    results = {}
    for chunk in (0, CHUNK):
        hidden = torch.randn(2, n, dim, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        output.weight.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)

        def model(inputs, head=None):  # the model's tail: head(output, final hidden states)
            return head(output, hidden) if head is not None else output(hidden).float()

        loss = token_loss_sum(model, None, labels, chunk)
        loss.backward()
        torch.cuda.synchronize(device)
        results[chunk] = (loss.item(), (torch.cuda.max_memory_allocated(device) - base) / 2**30)
    (full_loss, full_gib), (chunk_loss, chunk_gib) = results[0], results[CHUNK]
    rel = abs(chunk_loss - full_loss) / full_loss
    return rel <= 1e-4, (f"loss step peak above the inputs: full logits {full_gib:.2f} GiB, chunks of {CHUNK} "
                         f"{chunk_gib:.2f} GiB ({chunk_gib / full_gib:.2f}x); loss relative difference {rel:.1e}")


def check_cp() -> tuple[bool, str]:
    """Context parallelism on CUDA: 1 GPU vs cp 2 on 2 GPUs, each a torchrun of train_fsdp.py; skipped on one GPU."""
    import subprocess
    import tempfile

    if torch.cuda.device_count() < 2:
        return True, f"skipped: needs 2 GPUs, {torch.cuda.device_count()} visible"
    tmp = tempfile.mkdtemp(prefix="gpu_check_cp_")
    common = ["--config", os.path.join(ROOT, "configs", "debug.toml"), "--train.device", "cuda", "--train.dtype",
              "float32", "--train.steps", "4", "--train.val_interval", "0", "--checkpoint.interval", "1000",
              "--model.n_kv_heads", "4", "--model.document_mask", "true"]
    runs = {}
    for name, n, extra in (("cp1", 1, []), ("cp2", 2, ["--parallel.cp", "2"])):
        rd = os.path.join(tmp, name)
        if runs:  # the corpus tokenized once
            os.makedirs(rd)
            subprocess.run(["cp", "-r", os.path.join(tmp, "cp1", "data"), rd], check=True)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               os.path.join(ROOT, "train_fsdp.py"), *common, "--run_dir", rd, *extra],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            return False, f"{name} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"
        with open(os.path.join(rd, "metrics.jsonl")) as f:
            runs[name] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    rel = max(abs(a - b) / abs(b) for a, b in zip(runs["cp2"], runs["cp1"]))
    return rel <= 1e-4 and len(runs["cp2"]) == 4, f"losses cp 2 vs 1 GPU, 4 steps: max relative difference {rel:.1e}"


def _speed_run(args, mesh, device, micro: int, chunk: int) -> dict:
    cfg = parse_config(["--model.preset", "llama3_1b", "--train.dtype", "bfloat16", "--train.compile", "true",
                        "--data.seq_len", str(SPEED_SEQ_LEN), "--train.global_batch_size", str(micro),
                        "--train.loss_chunk_size", str(chunk), "--optim.warmup_steps", "10", "--train.steps", "1000"])
    m = cfg.model
    tr = trainer.build_trainable(cfg, 0, mesh, device)
    gen = torch.Generator(device=device).manual_seed(0)
    n = micro * SPEED_SEQ_LEN

    def step():  # the trainer's own step
        tokens = torch.randint(0, m.vocab_size, (micro, SPEED_SEQ_LEN + 1), device=device, generator=gen)
        trainer.train_step(tr, [(tokens[:, :-1], tokens[:, 1:])])

    for _ in range(3):  # compilation and allocator warm-up
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    tps = n / median
    return {"micro_batch": micro, "loss_chunk_size": chunk, "tokens_per_sec": tps,
            "mfu": tps * flops_per_token(m, SPEED_SEQ_LEN) / (H200_BF16_TFLOPS * 1e12),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def check_speed(args, mesh, device) -> tuple[bool, str, list]:
    rows = []
    for chunk in (0, CHUNK):
        for micro in SPEED_MICRO_BATCHES:
            try:
                rows.append(_speed_run(args, mesh, device, micro, chunk))
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
    text = "; ".join(f"chunk {r['loss_chunk_size']}: micro-batch {r['micro_batch']}, {r['tokens_per_sec']:,.0f} "
                     f"tokens/s, MFU {r['mfu']:.1%}, peak {r['peak_mem_gib']:.1f} GiB" for r in rows)
    return len(rows) == 2, text or "no micro-batch fits", rows


def parse(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit; needs no GPU")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma list of checks among {', '.join(CHECKS)}")
    p.add_argument("--steps", type=number(int, lambda v: v >= 1, "an int >= 1"), default=20,
                   help="timed steps of the speed check")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in only if c not in CHECKS]
    if unknown or not only:
        p.error(f"--only: unknown check(s) {unknown or args.only!r}; choose among {', '.join(CHECKS)}")
    args.only = only
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the checks; exit 0 when all pass, 1 when one fails, 2 on bad flags or without a GPU."""
    args = parse(argv)
    if args.dry_run:
        print("\n".join(plan(args)))
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; run this on a GPU machine, or pass --dry-run to see the plan",
              file=sys.stderr)
        return 2
    _, _, device = distributed.init_distributed("cuda")
    mesh = parallelize.build_mesh(device, 1)
    results, ok_all = {}, True
    for name in args.only:
        t0 = time.perf_counter()
        extra = None
        if name == "nccl":
            ok, text = check_nccl(device)
        elif name == "bf16":
            ok, text = check_bf16(device, mesh)
        elif name == "flex":
            ok, text = check_flex(device)
        elif name == "chunked":
            ok, text = check_chunked(device)
        elif name == "cp":
            ok, text = check_cp()
        else:
            ok, text, extra = check_speed(args, mesh, device)
        ok_all &= ok
        seconds = time.perf_counter() - t0
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text} [{seconds:.0f} s]", flush=True)
        results[name] = {"ok": ok, "text": text, "seconds": seconds, **({"rows": extra} if extra else {})}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "checks": results}, f, indent=1, default=lambda o: dataclasses.asdict(o))
    distributed.finish_distributed()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
