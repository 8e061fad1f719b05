"""Moving token rows into expert order and back: a row gather whose backward is a gather too.

``x[index]`` differentiates by an indexed accumulate (``index_put_`` with accumulate, which torch's
``use_deterministic_algorithms`` lists as nondeterministic on CPU), ``x.index_select`` by ``index_add_``
(nondeterministic on CUDA). Every index the MoE gathers by is a permutation of the rows or of their k copies,
so the gradient is a gather by the inverse permutation, then a sum over each row's copies in a fixed
order: no scatter, the same bits on every run.
Layer 1: imports torch only.
"""
from __future__ import annotations

import torch
from torch import Tensor


def inverse_permutation(perm: Tensor) -> Tensor:
    """inv (n,) with inv[perm[i]] = i, of perm (n,) an integer permutation of range(n), in its dtype; on its device, no sync."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device))


def gather_rows(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """x.index_select(0, index), differentiable in x by gathers only: x (rows, ...) -> (index.numel(), ...).

    index (rows * r,) int64 names each row of x exactly r times (r >= 1: a permutation when 1);
    inverse (rows * r,) int64 says where those copies went: the output's row inverse[i * r + j] is
    row i's j-th copy. The gradient of row i is the sum over j in order of the incoming gradient at
    those rows. When index = order // r with order a permutation of rows * r, inverse is
    inverse_permutation(order). Shapes are not checked (a wrong inverse gives a wrong gradient); an index out of
    range raises torch's IndexError or RuntimeError, as index_select does.
    """
    return _GatherRows.apply(x, index, inverse)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        return x.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _, inverse = inputs
        ctx.save_for_backward(inverse)
        ctx.rows = x.shape[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if grad.shape[0] != ctx.rows:  # r copies of each row, adjacent after the gather: sum them in order
            grad = grad.view(ctx.rows, -1, *grad.shape[1:]).sum(1)
        return grad, None, None
