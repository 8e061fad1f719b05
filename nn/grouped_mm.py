"""The grouped matmul of the MoE experts: out[rows of group e] = x[rows of group e] @ w[e].T, one kernel for all groups.

torch._grouped_mm where it runs: on CPU in fp32, bf16 and fp16 (torch 2.13 gives the loop's outputs and
both gradients exactly there, 3-6x faster at 64 experts), on CUDA in bf16 (Hopper and newer). The loop
over the groups is kept as the tests' reference and for what the kernel refuses: another dtype (fp64),
rows whose byte stride is not a multiple of 16, and fp32/fp16 under fake tensors (torch.compile's
tracing, plan.py's dry run), whose meta function in torch 2.13 asks for bf16 although the CPU kernel does not.
Layer 1: imports torch only.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

# The dtypes the CPU kernel takes (checked against the loop in tests/test_grouped_mm.py); fp64 is refused by it.
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_applies(x: Tensor, w: Tensor) -> bool:
    """Whether torch._grouped_mm computes grouped_mm_loop(x, w, counts) here, forward and backward.

    x (tokens, n), w (groups, m, n). The kernel wants rows of 16 bytes' multiples in every operand of
    the forward and the backward (n and m: 4 fp32 or 8 bf16 values); x's group sizes are free.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if (x.shape[-1] * x.element_size()) % 16 or (w.shape[-2] * w.element_size()) % 16:
        return False
    if x.dtype == torch.bfloat16:
        return x.device.type in ("cuda", "cpu")
    # fp32/fp16: the meta function (fake tensors, compile's tracing) refuses them in torch 2.13; the loop traces
    return (x.device.type == "cpu" and x.dtype in CPU_DTYPES and not is_fake(x)
            and not torch.compiler.is_compiling())


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """x (tokens, n) sorted by group, w (groups, m, n), counts (groups,) int64 summing to tokens -> (tokens, m).

    Rows of group e are x[sum(counts[:e]) : sum(counts[:e + 1])]; a group may be empty. The kernel
    where kernel_applies (no host sync: it takes the groups' offsets on the device), else the loop.
    """
    return grouped_mm_kernel(x, w, counts) if kernel_applies(x, w) else grouped_mm_loop(x, w, counts)


def grouped_mm_loop(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """grouped_mm by a Python loop over the groups (the reference); asks the host for the group sizes (a sync)."""
    pieces = [xe @ w[e].T for e, xe in enumerate(x.split(counts.tolist()))]
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[1])


def grouped_mm_kernel(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """grouped_mm by one torch._grouped_mm; raises RuntimeError where kernel_applies(x, w) is False."""
    offsets = counts.cumsum(0).to(torch.int32)  # the kernel takes int32 end offsets only
    out = torch._grouped_mm(x.contiguous(), w.contiguous().transpose(-2, -1), offs=offsets)
    return _ContiguousGrad.apply(out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity on (tokens, m) whose backward gives the incoming gradient the strides (m, 1): _grouped_mm's backward
    refuses a zero-stride one (the expanded gradient of ``out.sum()``), and ``contiguous()`` alone keeps the zero
    strides of an empty or one-row tensor, which count as contiguous."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad if grad.stride() == (grad.shape[1], 1) else grad.new_empty(grad.shape).copy_(grad)
