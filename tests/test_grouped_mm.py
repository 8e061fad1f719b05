"""The experts' grouped matmul (nn/grouped_mm.py): torch._grouped_mm on CPU against the loop over the groups (the
reference), forward and both gradients, with empty groups and the zero-stride gradient of ``.sum()``; and which
inputs fall back to the loop."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nn import grouped_mm as gm

COUNTS = [5, 0, 1, 0, 9, 3, 0]  # empty groups first-but-one, in the middle and last; sizes not multiples of 16


def inputs(dtype, n=16, m=24, counts=COUNTS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), n, generator=gen).to(dtype)
    w = (torch.randn(len(counts), m, n, generator=gen) / n ** 0.5).to(dtype)
    return x, w, counts


def forward_backward(fn, x, w, counts, grad=None):
    """(out, dx, dw) of fn; grad None: out.sum()'s gradient, all ones expanded from a scalar (zero strides)."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(xs, ws, counts)
    (out.sum() if grad is None else out).backward(grad)
    return out, xs.grad, ws.grad


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_stride", [False, True])
def test_the_kernel_on_cpu_computes_the_loop_forward_and_both_gradients(dtype, zero_stride):
    x, w, counts = inputs(dtype)
    assert gm.kernel_applies(x, w)
    grad = None if zero_stride else torch.randn(len(x), w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    got = forward_backward(gm.grouped_mm_kernel, x, w, counts, grad)
    want = forward_backward(gm.grouped_mm_loop, x, w, counts, grad)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # torch 2.13 on CPU: equal bitwise; the bound allows other BLAS
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert got[2][[1, 3, 6]].abs().max() == 0  # the empty groups' weights get no gradient


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_all_tokens_in_one_group_and_no_token_at_all():
    for counts in ([0, 0, 18, 0], [0, 0, 0, 0]):
        x, w, c = inputs(torch.float32, counts=counts)
        got, want = (forward_backward(f, x, w, c) for f in (gm.grouped_mm_kernel, gm.grouped_mm_loop))
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype, n, m", [
    (torch.float64, 16, 24),  # the CPU kernel takes fp32, bf16 and fp16 only
    (torch.float32, 6, 12),   # rows of 24 bytes: the kernel wants multiples of 16
    (torch.float32, 16, 6),   # the same for the backward's dx = grad @ w
    (torch.bfloat16, 12, 16),  # 8 bf16 values make 16 bytes
])
def test_what_the_kernel_refuses_runs_the_loop_with_the_same_results(dtype, n, m):
    x, w, counts = inputs(dtype, n, m)
    assert not gm.kernel_applies(x, w)
    got, want = (forward_backward(f, x, w, counts) for f in (gm.grouped_mm, gm.grouped_mm_loop))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp32_under_fake_tensors_runs_the_loop_whose_tracing_torch_offers():
    # torch 2.13's meta function for _grouped_mm refuses fp32 (plan.py's dry run and compile's tracing use it)
    x, w, _ = inputs(torch.float32)
    with FakeTensorMode() as mode:
        assert not gm.kernel_applies(mode.from_tensor(x), mode.from_tensor(w))
