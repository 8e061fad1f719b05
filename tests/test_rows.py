"""The MoE's row gathers (nn/rows.py) against autograd's own ``x[index]`` (the reference), forward and gradient:
a permutation, each row k times as the MoE's sort makes it, and no rows; and the same gradient bits on every run
with several threads, which ``x[index]``'s accumulate does not give on CPU."""
import pytest
import torch

from nn.rows import gather_rows, inverse_permutation


def reference_and_ours(x, index, inverse, grad):
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = a[index], gather_rows(b, index, inverse)
    want.backward(grad)
    got.backward(grad)
    return (want, a.grad), (got, b.grad)


@pytest.mark.parametrize("rows, k", [(7, 1), (7, 3), (1, 5), (0, 2)])
def test_gather_rows_equals_indexing_forward_and_gradient(rows, k):
    gen = torch.Generator().manual_seed(rows * 10 + k)
    x = torch.randn(rows, 6, dtype=torch.float64, generator=gen)
    choice = torch.randint(0, 4, (rows * k,), generator=gen)  # expert ids of the (row, j) copies, as MoE.route gives
    order = torch.argsort(choice, stable=True)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(rows * k))
    grad = torch.randn(rows * k, 6, dtype=torch.float64, generator=gen)
    (want, want_grad), (got, got_grad) = reference_and_ours(x, order // k, inverse, grad)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)  # the same sum, maybe in another order
    # and the way back: the rows in expert order to (row, j) order, a permutation
    (want, want_grad), (got, got_grad) = reference_and_ours(want.detach(), inverse, order, grad)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_the_gradient_is_the_same_bits_on_every_run_with_2_threads():
    # x[index]'s backward (index_put_ with accumulate) put in place of gather_rows fails this here (2 threads)
    gen = torch.Generator().manual_seed(0)
    rows, k = 2048, 7
    x = torch.randn(rows, 64, generator=gen)
    order = torch.argsort(torch.randint(0, 64, (rows * k,), generator=gen), stable=True)
    inverse = inverse_permutation(order)
    grad = torch.randn(rows * k, 64, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(4):
            a = x.clone().requires_grad_()
            gather_rows(a, order // k, inverse).backward(grad)
            grads.append(a.grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads)
