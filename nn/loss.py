"""The training loss: fp32 next-token cross-entropy, summed over tokens; optionally chunked.

With a large vocabulary the logits dominate memory: (batch x seq x vocab) fp32 values, plus
as many again for log-softmax and for their gradient. ``loss_chunk_size`` computes the
output projection and the cross-entropy chunk by chunk of the flattened tokens, and each
chunk's gradients (for the hidden states and the output weight) right away, so only one
chunk's logits ever exist and nothing is recomputed: the same FLOPs as the full loss (the
approach of Liger's fused linear cross-entropy, and of torchtitan's ChunkedCELoss, which runs
each chunk's output-layer backward in forward and feeds the hidden states' gradient to one
backward through the trunk). Without autograd (``torch.no_grad``: validation, evaluate.py) only
the chunks' forward runs: one (chunk, vocab) matmul per chunk, no gradient.

With tensor parallelism the output projection leaves the logits sharded on the vocabulary
(a DTensor, Shard(-1)); ``loss_parallel`` then computes the cross-entropy without gathering
(batch, seq, vocab) on any rank, each rank holding vocab / tp of them. ``loss_context`` picks
it under TP, and chunking is not applied there (the rule: TP's vocabulary split wins).

The z-loss (train.z_loss; PaLM, Chowdhery et al. 2022, section 5) adds z_loss * logsumexp(logits)^2
per token, which pulls the softmax normaliser towards 1. It is computed in all three forms: on full
logits, chunk by chunk (its gradient joins the cross-entropy's, 2 z lse softmax per chunk), and
vocabulary-parallel (the logsumexp of the whole vocabulary from each rank's shard: one max and one
sum all-reduce over the tp group, never a gathered logits tensor).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def applied_chunk_size(vocab_parallel: bool, loss_chunk_size: int) -> int:
    """train.loss_chunk_size as applied: 0 (full logits) when the logits are vocabulary-parallel (TP)."""
    return 0 if vocab_parallel else loss_chunk_size


def loss_context(vocab_parallel: bool):
    """The context the loss and its backward run in: loss_parallel when the logits are vocabulary-parallel (TP)."""
    return loss_parallel if vocab_parallel else contextlib.nullcontext


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, labels_i), with both gradients computed chunk by chunk in forward.

    Applied only when autograd will ask for a gradient (see chunked_cross_entropy_sum). With
    z_loss > 0 it returns (CE sum + z_loss * sum lse^2, sum lse^2), the second without a gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, z_loss=0.0):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
            logits = (h @ weight.t()).float()  # as output(h).float(): matmul in the compute dtype
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            # d(sum of CE)/d(logits) = softmax - one_hot(labels), computed in place of the logits;
            # d(z lse^2)/d(logits) = 2 z lse softmax.
            g = logits.sub_(lse[:, None]).exp_()
            if z_loss:
                z_sum += lse.square().sum()
                g.mul_(1 + 2 * z_loss * lse[:, None])
            g[torch.arange(len(y), device=y.device), y] -= 1
            g = g.to(weight.dtype)
            grad_hidden[start:start + chunk_size] = g @ weight
            grad_weight += g.t() @ h  # the matmul in the compute dtype, the sum over chunks in fp32
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(z_sum)
        return total + z_loss * z_sum, z_sum

    @staticmethod
    def backward(ctx, grad_total, _grad_z_sum):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total.to(grad_hidden.dtype), grad_weight * grad_total.to(grad_weight.dtype),
                None, None, None)


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk_size: int, z_loss: float = 0.0) -> torch.Tensor:
    """Sum over tokens of cross_entropy((hidden @ weight.T).float(), labels), chunk_size tokens at a time.

    hidden: (n_tokens, dim) and weight (vocab, dim) in the compute dtype; labels: (n_tokens,)
    int64. With grad enabled and hidden or weight requiring grad, the gradients of both
    are computed in forward and scaled in backward, so nothing is recomputed: peak memory
    holds one chunk's fp32 logits (chunk_size, vocab) plus the gradients of hidden (its
    size) and of weight (fp32, its size). Otherwise (torch.no_grad, inference_mode) only the
    forward runs: one (chunk_size, vocab) matmul per chunk and one chunk's logits in memory.
    Same value and gradients as the unchunked loss up to fp32 summation order. Returns a
    0-dim fp32 tensor; with z_loss > 0 a LossSums (the sum plus z_loss * sum of lse^2, and that
    sum of lse^2).
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        total, z_sum = _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, z_loss)
        return LossSums(total, z_sum) if z_loss else total
    # Forward only (under no_grad the Function's needs_input_grad would still ask for both gradients).
    # One logits buffer for every chunk: on CPU a fresh (chunk, vocab) tensor per chunk is mapped and
    # page-faulted anew each time (measured 1.14x the full-logits time at vocab 32k; reused: 1.0x).
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    buf = hidden.new_empty((min(chunk_size, hidden.shape[0]), weight.shape[0]))
    buf32 = buf if buf.dtype == torch.float32 else torch.empty(buf.shape, dtype=torch.float32, device=buf.device)
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start:start + chunk_size]
        logits = torch.mm(h, weight.t(), out=buf[:len(h)])  # in the compute dtype, as output(h)
        if buf32 is not buf:
            logits = buf32[:len(h)].copy_(logits)
        total += F.cross_entropy(logits, labels[start:start + chunk_size], reduction="sum")
        if z_loss:
            z_sum += torch.logsumexp(logits, dim=-1).square().sum()
    return LossSums(total + z_loss * z_sum, z_sum) if z_loss else total


class LossSums(NamedTuple):
    """The training objective of a batch, summed over its tokens, and the z-loss term's sum."""

    objective: torch.Tensor
    """Sum of cross-entropy + z_loss * logsumexp^2 over the tokens, 0-dim fp32, with autograd."""
    z_sum: torch.Tensor
    """Sum of logsumexp(logits)^2 over the tokens, 0-dim fp32, detached (0 when z_loss is 0)."""


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) over a process group in forward, the identity in backward.

    Every rank goes on to compute the same replicated loss from the sum, so the gradient of a
    rank's own addend is the gradient of the sum (Megatron-LM's "g" operator).
    """

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last (vocabulary) dim of fp32 logits (..., vocab) -> (...), with autograd.

    A DTensor sharded on the vocabulary (Shard(-1), tensor parallelism) is reduced without being
    gathered: a max all-reduce (the shift, no gradient) and a sum all-reduce of the shards'
    exp-sums over its mesh; the result is a plain tensor, the same on every rank.
    """
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits, dim=-1)
    local, group = logits.to_local(), logits.device_mesh.get_group()
    shift = local.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    return shift.squeeze(-1) + _SumOverGroup.apply((local - shift).exp().sum(dim=-1), group).log()


def token_loss_sums(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, chunk_size: int = 0,
                    z_loss: float = 0.0, layout=None) -> LossSums:
    """The training objective: token_loss_sum plus z_loss * sum over tokens of logsumexp(logits)^2.

    Shapes, chunk_size, layout and the context to call it in as token_loss_sum. The z term is
    taken on the full logits, chunk by chunk, or vocabulary-parallel (logsumexp), as the
    cross-entropy is. Returns LossSums of plain 0-dim fp32 tensors (objective with autograd).
    """
    if not z_loss:
        return LossSums(scalar(token_loss_sum(model, inputs, labels, chunk_size, layout)),
                        torch.zeros((), device=inputs.device))
    kw = {} if layout is None else {"layout": layout}
    if chunk_size > 0:
        sums = model(inputs, head=ChunkedLossHead(labels, chunk_size, z_loss), **kw)
        return LossSums(sums[0], sums[1].detach())
    return logits_loss_sums(model(inputs, **kw), labels, z_loss)


def logits_loss_sums(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0) -> LossSums:
    """token_loss_sums of logits already computed: logits (batch, seq, vocab) fp32 (a vocabulary-sharded DTensor
    under loss_parallel), labels (batch, seq) int64. The objective is the summed cross-entropy, plus z_loss times
    the summed logsumexp^2 (ST-MoE's z-loss, Zoph et al. 2022) when z_loss is not 0."""
    ce = scalar(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    if not z_loss:
        return LossSums(ce, torch.zeros((), device=ce.device))
    z_sum = logsumexp(logits).square().sum()
    return LossSums(ce + z_loss * z_sum, z_sum.detach())


def token_loss_sum(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   chunk_size: int = 0, layout=None) -> torch.Tensor:
    """Sum over tokens of the fp32 cross-entropy of next-token prediction.

    model: a model.Transformer (whole or parallelized); inputs, labels: (batch, seq) int64 on
    its device. chunk_size > 0: the output projection and loss run chunk by chunk (see
    chunked_cross_entropy_sum); 0: on the full logits. Returns a 0-dim fp32 tensor (a
    replicated DTensor under loss_parallel: see scalar). Call inside loss_context(vocab_parallel), and
    with chunk_size 0 under tensor parallelism. layout: the nn/documents.SequenceLayout of inputs
    and labels when they are one CP rank's slice of longer windows (context_parallel.shard_batch).
    """
    kw = {} if layout is None else {"layout": layout}  # other model classes (benchmarks) take no layout
    if chunk_size > 0:
        return model(inputs, head=ChunkedLossHead(labels, chunk_size), **kw)[0]
    logits = model(inputs, **kw)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@dataclasses.dataclass
class ChunkedLossHead:
    """A model head (Transformer.forward's head=) that returns the chunked loss sums of labels: a (2,) fp32 tensor
    [objective (cross-entropy sum plus z_loss times the logsumexp^2 sum, with autograd), logsumexp^2 sum].

    The one chunked head: token_loss_sum and token_loss_sums pass it to the whole model, and a pipeline's last
    stage takes its loss inside its forward with it, where FSDP has gathered the output weight; a dataclass, so
    that the schedule splits its labels (batch, seq) int64 into micro-batches with the tokens (parallel/pipeline.py
    registers it as a pytree).
    """

    labels: torch.Tensor
    chunk_size: int
    z_loss: float = 0.0

    def __call__(self, output: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        sums = chunked_cross_entropy_sum(hidden.flatten(0, 1), output.weight, self.labels.flatten(), self.chunk_size,
                                         self.z_loss)
        return torch.stack(list(sums) if self.z_loss else [sums, torch.zeros_like(sums)])


def scalar(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a replicated DTensor scalar (loss_parallel's result), else t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def token_logprobs(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   vocab_parallel: bool = False) -> torch.Tensor:
    """log p(targets[b, t] | inputs[b, :t + 1]) per position, fp32 (batch, seq); 0 where targets is -100.

    Forward only (for downstream scoring): -model(inputs, head=nll_head(targets, vocab_parallel)).
    """
    return -model(inputs, head=nll_head(targets, vocab_parallel))


def nll_head(targets: torch.Tensor, vocab_parallel: bool = False) -> Callable:
    """The model head (Transformer.forward's head=) that returns -log p(targets) per position, fp32 (batch, seq), 0
    where targets (batch, seq) is -100.

    Without tensor parallelism only the positions with a target go through the output projection
    (a continuation is a few tokens of a long row). vocab_parallel (whether TP is on; call
    inside loss_context): the logits are vocabulary-sharded, all positions go through it, and
    loss_parallel's cross-entropy gives the per-token values.
    """
    keep = targets != -100

    def head(output, hidden):
        if vocab_parallel:  # no boolean indexing of sequence-sharded activations
            logits = output(hidden).float()
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
            return scalar(nll).view_as(targets)
        out = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        out[keep] = F.cross_entropy(output(hidden[keep]).float(), targets[keep], reduction="none")
        return out

    return head
