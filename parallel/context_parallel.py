"""Context parallelism (``parallel.cp``): each sequence split over cp ranks, attention by DeepSpeed-Ulysses.

Every rank of a CP group holds one contiguous slice of seq_len / cp tokens of each of its
data-parallel rank's windows (``shard_batch``): embeddings, norms, projections, the MLP and the
loss run on that slice only, so activation memory per rank falls by about cp. Attention needs
the whole sequence, and Ulysses (Jacobs et al. 2023, arXiv:2309.14509) gives it that by trading
sequence shards for head shards: after the q/k/v projections an all-to-all turns
(batch, seq / cp, heads, head_dim) into (batch, seq, heads / cp, head_dim), the unchanged
attention kernel (SDPA, our document mask, FlexAttention) runs over the whole sequence for
heads / cp heads, and a second all-to-all turns the result back. It is exact (the same kernel
on the same numbers), needs only all-to-all (gloo has it), and needs n_heads and n_kv_heads
divisible by cp (by cp x tp under tensor parallelism, which first splits the heads).

Per layer and rank, forward: the all-to-alls of q, k, v and the output move
(2 n_heads + 2 n_kv_heads) x head_dim x (batch x seq / cp) elements in, of which (cp - 1) / cp
leave the rank; the backward moves the same again (docs/long_context.md).

RoPE positions and document ids are those of the whole windows (nn/documents.slice_layout): a document
that crosses a slice boundary keeps its positions, and the mask the kernel applies over the
whole sequence is the whole windows' one. FSDP shards parameters over the data-parallel and
CP ranks together (layout.Mesh.fsdp), so CP adds no parameter memory, and gradients are
reduced over both; the loss is summed over every rank's tokens and divided by the global
target count, as without CP (runner.OneStage.forward_backward).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from core.errors import SetupError
from model import Transformer, attention
from nn.documents import SequenceLayout, slice_layout
from parallel.pipeline_stages import PassThrough


def check_cp_layout(cp: int, tp: int, seq_len: int, n_heads: int, n_kv_heads: int) -> None:
    """The CP checks that need no collective; raises SetupError naming the numbers and the fix.

    seq_len (data.seq_len) must split into cp slices of whole TP shards (cp x tp divides it);
    Ulysses gives each rank n_heads / (cp x tp) query and n_kv_heads / (cp x tp) key/value
    heads. What CP does not run with (in-loop [[eval.tasks]]) is composition.TABLE's.
    """
    if cp < 1:
        raise SetupError(f"parallel.cp must be >= 1, got {cp}")
    if cp == 1:
        return
    split = cp * tp
    what = f"parallel.cp ({cp})" if tp == 1 else f"parallel.cp ({cp}) x parallel.tp ({tp}) = {split}"
    if seq_len % split:
        raise SetupError(f"data.seq_len ({seq_len}) is not divisible by {what}: every sequence is split into equal "
                         f"slices; use a data.seq_len that is a multiple of {split} or change parallel.cp")
    for name, n in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
        if n % split:
            valid = [d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0 and n_heads % d == 0 and d % tp == 0]
            knob = "parallel.cp" if tp == 1 else "parallel.cp x parallel.tp"
            raise SetupError(f"{name} ({n}) is not divisible by {what}: Ulysses attention gives every CP rank whole "
                             f"heads; use {knob} in {valid} or change {name}")


def _seq_to_heads(x: Tensor, cp: int, group) -> Tensor:
    """(batch, seq / cp, heads, d) on each rank -> (batch, seq, heads / cp, d): rank r keeps head group r."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j goes to rank j
    x = funcol.all_to_all_single_autograd(x, None, None, group)  # chunk j came from rank j: sequence slice j
    return x.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def _heads_to_seq(x: Tensor, cp: int, group) -> Tensor:
    """The inverse of _seq_to_heads: (batch, seq, heads / cp, d) -> (batch, seq / cp, heads, d)."""
    b, n, h, d = x.shape
    x = x.reshape(b, cp, n // cp, h, d).transpose(0, 1).contiguous()  # sequence slice j goes to rank j
    x = funcol.all_to_all_single_autograd(x, None, None, group)  # chunk j: head group j of my slice
    return x.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * h, d)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, mask, *, cp: int, group, inner=attention) -> Tensor:
    """Attention of this rank's sequence slice, exact, by two all-to-alls over the CP group (collective).

    q (batch, seq / cp, heads, head_dim), k and v (batch, seq / cp, kv_heads, head_dim): this rank's
    slice, in rank order along the sequence. mask: the whole sequence's (None: causal), as inner
    (model.attention) takes it. heads and kv_heads must be divisible by cp; rank r computes
    query heads [r h / cp, (r + 1) h / cp) with their grouped key/value heads
    [r kv / cp, (r + 1) kv / cp) over the whole sequence. Returns (batch, seq / cp, heads, head_dim).
    """
    q, k, v = (_seq_to_heads(t, cp, group) for t in (q, k, v))
    return _heads_to_seq(inner(q, k, v, mask), cp, group)


def apply_ulysses(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Replace every layer's attention kernel (Attention.attend) by Ulysses over cp_mesh (1-D, "cp"). (A mixture of
    experts' balance loss sums its choices over the CP group: parallel/moe_sequence.py.)"""
    fn = functools.partial(ulysses_attention, cp=cp_mesh.size(), group=cp_mesh.get_group())
    for block in model.layers:
        if isinstance(block, PassThrough):  # another pipeline stage's
            continue
        block.attention.attend = fn


def shard_batch(model: torch.nn.Module, inputs: Tensor, labels: Tensor, cp_mesh: DeviceMesh | None
                ) -> tuple[Tensor, Tensor, SequenceLayout | None]:
    """This CP rank's slice of whole windows: (inputs, labels, layout) to pass to the model and the loss.

    inputs, labels: (batch, seq) int64, the same on every rank of a CP group. Returns
    inputs[:, lo:hi], labels[:, lo:hi] with [lo, hi) the rank's contiguous seq / cp slice, and
    the slice's SequenceLayout computed from the whole inputs (nn/documents.slice_layout); cp_mesh is
    the CP group's (layout.Mesh.cp); without one, (inputs, labels, None) unchanged.
    """
    if cp_mesh is None:
        return inputs, labels, None
    r, n = cp_mesh.get_local_rank(), inputs.shape[1] // cp_mesh.size()
    args = model.args
    layout = slice_layout(inputs, r * n, (r + 1) * n, args.document_mask, args.eot_id)
    return inputs[:, r * n:(r + 1) * n].contiguous(), labels[:, r * n:(r + 1) * n].contiguous(), layout
