"""The training loss: fp32 next-token cross-entropy, summed over tokens; optionally chunked.

With a large vocabulary the logits dominate memory: (batch x seq x vocab) fp32 values, plus
as many again for log-softmax and for their gradient. ``loss_chunk_size`` computes the
output projection and the cross-entropy chunk by chunk of the flattened tokens, and each
chunk's gradients (for the hidden states and the output weight) right away, so only one
chunk's logits ever exist and nothing is recomputed: the same FLOPs as the full loss (the
approach of Liger's fused linear cross-entropy; torchtitan's chunked loss recomputes instead).

With tensor parallelism the output projection leaves the logits sharded on the vocabulary
(a DTensor, Shard(-1)); ``loss_parallel`` then computes the cross-entropy without gathering
(batch, seq, vocab) on any rank, each rank holding vocab / tp of them. ``loss_context`` picks
it from the mesh, and chunking is not applied there (the rule: TP's vocabulary split wins).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def has_tp(mesh: DeviceMesh | None) -> bool:
    """Whether mesh has a "tp" dimension (the logits are then vocabulary-sharded)."""
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def applied_chunk_size(mesh: DeviceMesh | None, loss_chunk_size: int) -> int:
    """train.loss_chunk_size as applied on mesh: 0 (full logits, vocabulary-parallel) when it has "tp"."""
    return 0 if has_tp(mesh) else loss_chunk_size


def loss_context(mesh: DeviceMesh | None):
    """The context the loss and its backward run in: loss_parallel when mesh has a "tp" dimension, else none."""
    return loss_parallel if has_tp(mesh) else contextlib.nullcontext


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, labels_i), with both gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        want_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grads else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
            logits = (h @ weight.t()).float()  # as output(h).float(): matmul in the compute dtype
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if want_grads:
                # d(sum of CE)/d(logits) = softmax - one_hot(labels), computed in place of the logits.
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(len(y), device=y.device), y] -= 1
                g = g.to(weight.dtype)
                grad_hidden[start:start + chunk_size] = g @ weight
                grad_weight += g.t() @ h  # the matmul in the compute dtype, the sum over chunks in fp32
        if want_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), grad_weight * grad_total.to(grad_weight.dtype), None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk_size: int) -> torch.Tensor:
    """Sum over tokens of cross_entropy((hidden @ weight.T).float(), labels), chunk_size tokens at a time.

    hidden: (n_tokens, dim) and weight (vocab, dim) in the compute dtype; labels: (n_tokens,)
    int64. Peak memory holds one chunk's fp32 logits (chunk_size, vocab) plus the gradients
    of hidden (its size) and of weight (fp32, its size); the gradients are computed in
    forward (when autograd needs them) and scaled in backward, so nothing is recomputed.
    Same value and gradients as the unchunked loss up to fp32 summation order. Returns a
    0-dim fp32 tensor.
    """
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size)


def token_loss_sum(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   chunk_size: int = 0) -> torch.Tensor:
    """Sum over tokens of the fp32 cross-entropy of next-token prediction.

    model: a model.Transformer (whole or parallelized); inputs, labels: (batch, seq) int64 on
    its device. chunk_size > 0: the output projection and loss run chunk by chunk (see
    chunked_cross_entropy_sum); 0: on the full logits. Returns a 0-dim fp32 tensor (a
    replicated DTensor under loss_parallel: see scalar). Call inside loss_context(mesh), and
    with chunk_size 0 under tensor parallelism.
    """
    if chunk_size > 0:
        def head(output, hidden):
            return chunked_cross_entropy_sum(hidden.flatten(0, 1), output.weight, labels.flatten(), chunk_size)

        return model(inputs, head=head)
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def scalar(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a replicated DTensor scalar (loss_parallel's result), else t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
