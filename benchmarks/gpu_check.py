"""The CUDA paths the CPU test suite cannot reach, each against a reference, then the 1B preset's speed.

    python benchmarks/gpu_check.py                  # on one CUDA GPU, under 9 minutes on an H200
    python benchmarks/gpu_check.py --dry-run        # print the plan; needs no GPU
    python benchmarks/gpu_check.py --only nccl,flex --json out.json --table out.md

Checks (each prints one PASS/FAIL line with its figures), in this order (CHECKS):
  nccl      the NCCL process group on 1 GPU: an all-reduce of a CUDA tensor (and gloo for CPU ones)
  bf16      one training step of the debug model in bf16 mixed precision vs fp32: loss within 1e-2 relative
  flex      FlexAttention with the document block mask vs SDPA with the boolean mask, forward and
            backward, at the 1B preset's head shape (bf16: max abs diff <= 2e-2; fp32: <= 1e-4)
  chunked   peak memory (torch.cuda.max_memory_allocated) of the loss step at vocab 128,256 with and
            without train.loss_chunk_size; loss equal within 1e-4 relative
  cp        (2 GPUs; skipped on one) the debug model with document_mask, fp32, 4 steps on 1 GPU vs
            cp 2 (Ulysses over NCCL, FlexAttention over the whole sequence): losses within 1e-4 relative
  pp        (2 GPUs; skipped on one) the debug model, 4 layers, fp32, 4 steps on 1 GPU vs pp 2 under 1F1B and
            GPipe (activations and gradients sent over NCCL): losses within 1e-4 relative
  ep        (2 GPUs; skipped on one) an MoE debug model (4 experts, top-2), fp32, 4 steps on 1 GPU vs ep 2
            (all-to-all over NCCL): losses within 1e-4 relative
  offload   two fp32 steps with parallel.cpu_offload vs without, gradient clipping acting
            (pytorch#148532): losses and gradient norms within 1e-4 relative, parameters on CPU
  float8    two bf16 steps of a 1024-dim model with train.float8 tensorwise and rowwise vs bf16:
            losses within 2e-2 relative (and not equal), every block Linear converted
  snapshot  train.profile_steps' trace and CUDA memory snapshot of one step: written, unpickled, drawn
  moe       the MoE experts' torch._grouped_mm (bf16) vs the loop over experts, forward and backward: within
            1e-2 of the largest value, with empty experts; and both times
  speed     llama3_1b, compiled, seq 2048 and 8192 x bf16, float8 tensorwise, float8 rowwise x full
            and chunked loss: tokens/s, MFU against 989 TFLOP/s, peak memory (gpu_speed.py)
  plan      (only with --only plan: about 5 minutes more) plan.py's peak and tokens/s for llama3_1b (bf16, eager and compiled, seq 2048 and 8192, micro-batches
            4 and 16, full and chunked loss) against the real step's, and the MFU of the layout --search picks
            (gpu_plan.py; goals: eager peak within 5%, tokens/s within 15%, MFU above the preset's 50.6%)
  goals     over the speed rows: bf16 MFU >= 45%, float8 tensorwise >= 1.2x bf16 tokens/s

Runs in one process (torchrun is not needed). Exit status 0 when every check that ran passed.
A check that raises fails with the exception's first line, and the others still run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gpu_plan  # noqa: E402
import gpu_speed  # noqa: E402
import gpu_train_checks  # noqa: E402
from core.cli import ArgumentParser, number  # noqa: E402
from core.errors import one_line  # noqa: E402
from model import PRESETS, ModelArgs  # noqa: E402
from nn.documents import block_causal_mask, block_mask  # noqa: E402
from nn.loss import token_loss_sum  # noqa: E402
from parallel import distributed, layout, parallelize  # noqa: E402
from parallel.runner import OneStage  # noqa: E402

CHUNK = 4096


@dataclasses.dataclass
class Context:
    """What a check gets: the flags, the device, the 1-GPU mesh, and the results of the checks before it."""

    args: argparse.Namespace
    device: torch.device
    mesh: object
    results: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    plan: Callable[[argparse.Namespace], str | list[str]]
    """Its --dry-run line(s), with its settings."""
    run: Callable[[Context], tuple]
    """(ok, one line of figures[, rows for --json]); may raise (then it fails)."""


def _step_loss(cfg_model: ModelArgs, dtype: str, mesh, device, tokens, chunk: int = 0) -> float:
    """Mean token loss of one forward/backward (no update) of a fresh model from seed 0."""
    model = parallelize.build_model(cfg_model, mesh, device, 0, layout.ParallelConfig(), dtype=dtype)
    n = tokens[:, 1:].numel()
    loss, _ = OneStage(model, mesh, device, chunk).forward_backward([(tokens[:, :-1], tokens[:, 1:])], n)
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
    """FlexAttention against SDPA with the boolean mask, both against SDPA in fp32 on the same inputs.

    fp32: max abs diff to SDPA <= 1e-4. bf16: each output's and gradient's max error against the
    fp32 reference at most 2x SDPA-in-bf16's own error (+1e-3), the rule flash-attention's tests
    use: a bf16 kernel is as good as the reference kernel in the same precision, whatever the
    magnitudes (at seq 2048 dv sums ~2000 products, so a fixed absolute bound says nothing).
    """
    from model import _flex_attention

    gen = torch.Generator(device=device).manual_seed(0)
    b, h, kv, t, d = 2, 32, 8, 2048, 64
    starts = torch.zeros(b, t, dtype=torch.bool, device=device)
    starts[:, torch.tensor([0, 300, 700, 1200, 1900])] = True
    doc = starts.long().cumsum(1)
    rep = h // kv

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=block_causal_mask(doc))

    def out_and_grads(fn, inputs, grad):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    figures, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(b, h, t, d, device=device, generator=gen)
        k, v = (torch.randn(b, kv, t, d, device=device, generator=gen) for _ in range(2))
        grad = torch.randn(b, h, t, d, device=device, generator=gen)
        flex = out_and_grads(lambda q, k, v: _flex_attention()(q, k, v, block_mask=block_mask(doc), enable_gqa=True),
                             [x.to(dtype) for x in (q, k, v)], grad.to(dtype))
        ref = out_and_grads(sdpa, [x.to(dtype) for x in (q, k, v)], grad.to(dtype))
        names = ("out", "dq", "dk", "dv")
        if dtype == torch.float32:
            diffs = [(a - r).abs().max().item() for a, r in zip(flex, ref)]
            ok &= max(diffs) <= 1e-4
            figures.append("float32 vs SDPA: max abs diff " + ", ".join(f"{n} {x:.1e}" for n, x in zip(names, diffs))
                           + " (need <= 1e-4)")
        else:
            exact = out_and_grads(sdpa, [q, k, v], grad)  # fp32, the same inputs
            err_flex = [(a.float() - e).abs().max().item() for a, e in zip(flex, exact)]
            err_sdpa = [(r.float() - e).abs().max().item() for r, e in zip(ref, exact)]
            ok &= all(f <= 2 * s + 1e-3 for f, s in zip(err_flex, err_sdpa))
            figures.append("bfloat16 max error vs fp32, flex / SDPA-bf16: " + ", ".join(
                f"{n} {f:.1e} / {s:.1e}" for n, f, s in zip(names, err_flex, err_sdpa)) + " (need flex <= 2x SDPA)")
    return ok, "; ".join(figures)


def check_chunked(device) -> tuple[bool, str]:
    dim, vocab, n = 2048, 128_256, 4096
    gen = torch.Generator(device=device).manual_seed(0)
    output = torch.nn.Linear(dim, vocab, bias=False, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (2, n), device=device, generator=gen)
    start = torch.randn(2, n, dim, device=device, dtype=torch.bfloat16, generator=gen)  # one input for both
    results = {}
    for chunk in (0, CHUNK):
        hidden = start.clone().requires_grad_()
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


def check_moe(device) -> tuple[bool, str]:
    """The MoE experts' grouped matmul (torch._grouped_mm, bf16) against the loop over experts, forward and backward,
    with empty experts and group sizes that are not multiples of 16; and their times (median of 20 after 3)."""
    from nn import grouped_mm as gm

    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    gen = torch.Generator(device=device).manual_seed(0)
    n_experts, dim, hidden = 8, 1024, 2048
    counts = torch.tensor([700, 0, 333, 1, 0, 2048, 97, 917], device=device)
    x = torch.randn(int(counts.sum()), dim, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n_experts, hidden, dim, device=device, generator=gen, dtype=torch.bfloat16) / dim ** 0.5
    grad = torch.randn(len(x), hidden, device=device, generator=gen, dtype=torch.bfloat16)

    def run(fn):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws, counts)
        out.backward(grad)
        return out, xs.grad, ws.grad

    def timed(fn):
        times = []
        for i in range(23):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            run(fn)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return sorted(times[3:])[10] * 1e3

    assert gm.kernel_applies(x, w)
    got, want = run(gm.grouped_mm_kernel), run(gm.grouped_mm_loop)
    diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-9)).item()
             for a, b in zip(got, want)]
    ok = max(diffs) <= 1e-2
    return ok, (f"{n_experts} experts, {len(x)} tokens (two experts empty), {dim} -> {hidden}, bf16: max diff / max "
                f"out {diffs[0]:.1e}, dx {diffs[1]:.1e}, dw {diffs[2]:.1e} (need <= 1e-2); forward + backward "
                f"{timed(gm.grouped_mm_kernel):.2f} ms grouped vs {timed(gm.grouped_mm_loop):.2f} ms loop")


CHECKS: list[Check] = [
    Check("nccl", lambda a: "nccl: all_reduce of a CUDA tensor over backend 'cpu:gloo,cuda:nccl' (world 1)",
          lambda c: check_nccl(c.device)),
    Check("bf16", lambda a: "bf16: debug model, seq 128, batch 8: one step with train.dtype bfloat16 vs float32, "
                            "same seed", lambda c: check_bf16(c.device, c.mesh)),
    Check("flex", lambda a: "flex: q/k/v (2, 32 heads, 2048, 64), 8 KV heads, 5 documents a row: FlexAttention vs "
                            "SDPA mask", lambda c: check_flex(c.device)),
    Check("chunked", lambda a: f"chunked: dim 2048, vocab 128,256, 2 x 4096 tokens: loss step peak memory, chunk "
                               f"{CHUNK} vs none", lambda c: check_chunked(c.device)),
    Check("cp", lambda a: "cp: debug model, document_mask, fp32, 4 steps: train_fsdp.py on 1 GPU vs --parallel.cp 2 "
                          "on 2 GPUs (skipped with fewer)", lambda c: gpu_train_checks.check_cp()),
    Check("pp", lambda a: "pp: debug model, 4 layers, fp32, 4 steps: train_fsdp.py on 1 GPU vs --parallel.pp 2, "
                          "1F1B and GPipe, on 2 GPUs (skipped with fewer)", lambda c: gpu_train_checks.check_pp()),
    Check("ep", lambda a: "ep: debug model, 4 experts top-2, fp32, 4 steps: train_fsdp.py on 1 GPU vs --parallel.ep 2 "
                          "on 2 GPUs (skipped with fewer)", lambda c: gpu_train_checks.check_ep()),
    Check("offload", lambda a: f"offload: debug model, fp32, 2 steps, grad_clip {gpu_train_checks.OFFLOAD_CLIP}: "
                               f"parallel.cpu_offload true vs false", lambda c: gpu_train_checks.check_offload(
                                   c.device, c.mesh)),
    Check("float8", lambda a: "float8: dim 1024, 4 layers, seq 1024, batch 8, bf16, 2 steps: train.float8 "
                              "tensorwise and rowwise vs off", lambda c: gpu_train_checks.check_float8(c.device,
                                                                                                       c.mesh)),
    Check("snapshot", lambda a: "snapshot: debug model, bf16, one step under the loop's profiler: trace and memory "
                                "snapshot written, unpickled, drawn", lambda c: gpu_train_checks.check_snapshot(
                                    c.device, c.mesh)),
    Check("moe", lambda a: "moe: the experts' torch._grouped_mm vs the loop over experts, bf16, forward and backward, "
                           "empty experts", lambda c: check_moe(c.device)),
    Check("speed", lambda a: gpu_speed.plan(a.steps), lambda c: gpu_speed.check_speed(c.args.steps, c.mesh,
                                                                                        c.device)),
    Check("plan", lambda a: gpu_plan.plan_lines(), lambda c: gpu_plan.check_plan(c.args.steps, c.mesh, c.device)),
    Check("goals", lambda a: "goals: over the speed rows (needs speed): bf16 MFU >= 45%, float8 tensorwise >= "
                             "1.2x bf16 tokens/s", lambda c: gpu_speed.goals(c.results.get("speed", {}).get(
                                 "rows", []))),
]
"""Every check, in run order; a new one is one entry here (its name becomes an --only choice)."""
NAMES = [c.name for c in CHECKS]
OPT_IN = ("plan",)
"""Checks run only when --only names them: the plan row adds about 5 minutes, and the default run must fit a
10-minute device call."""


def plan(args) -> list[str]:
    """The lines of the checks that will run, with their settings."""
    lines = []
    for check in CHECKS:
        if check.name in args.only:
            got = check.plan(args)
            lines += [got] if isinstance(got, str) else got
    return lines


def parse(argv):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit; needs no GPU")
    p.add_argument("--only", default=",".join(n for n in NAMES if n not in OPT_IN),
                   help=f"comma list of checks among {', '.join(NAMES)} (default: all but {', '.join(OPT_IN)})")
    p.add_argument("--steps", type=number(int, lambda v: v >= 1, "an int >= 1"), default=10,
                   help="timed steps of each speed row")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--table", default="", help="also write the speed rows here as a Markdown table")
    args = p.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in only if c not in NAMES]
    if unknown or not only:
        p.error(f"--only: unknown check(s) {unknown or args.only!r}; choose among {', '.join(NAMES)}")
    args.only = only
    return args


def run_check(check: Check, ctx: Context) -> dict:
    """Run one check, print its PASS/FAIL line; a check that raises fails with the exception's first line."""
    t0 = time.perf_counter()
    try:
        ok, text, *rows = check.run(ctx)
    except Exception as e:  # one broken path must not hide the others' results
        ok, text, rows = False, f"raised {one_line(e)}", []
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    print(f"{'PASS' if ok else 'FAIL'} {check.name}: {text} [{seconds:.0f} s]", flush=True)
    return {"ok": ok, "text": text, "seconds": seconds, **({"rows": rows[0]} if rows and rows[0] else {})}


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
    ctx = Context(args, device, layout.build_mesh(device, 1))
    t0 = time.perf_counter()
    for check in CHECKS:
        if check.name in args.only:
            ctx.results[check.name] = run_check(check, ctx)
    ok_all = all(r["ok"] for r in ctx.results.values())
    print(f"{sum(r['ok'] for r in ctx.results.values())} of {len(ctx.results)} passed in "
          f"{time.perf_counter() - t0:.0f} s on {torch.cuda.get_device_name(device)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "checks": ctx.results}, f, indent=1)
    if args.table and "speed" in ctx.results:
        with open(args.table, "w") as f:
            f.write(gpu_speed.table(ctx.results["speed"].get("rows", [])) + "\n")
    distributed.finish_distributed()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
