"""Packed windows' documents: per-token document ids and positions, the block-causal masks, a slice's layout.

With model.document_mask a window packing several documents is computed as if each were alone:
attention stays inside a document and RoPE positions restart at each [EOT] (which precedes every
document, as a BOS would). The mask is SDPA's boolean one, or on CUDA a FlexAttention BlockMask.
A slice of longer windows (context parallelism) carries its SequenceLayout, computed here from
the whole windows, so a document that crosses the slice keeps its positions and its mask.
Layer 1, with model.py: imports torch only; no distributed code.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def document_positions(tokens: Tensor, eot_id: int) -> tuple[Tensor, Tensor]:
    """(document ids, positions), each (batch, seq) int64, of packed windows tokens (batch, seq).

    Each eot_id token starts a new document (it precedes every document in the stream); the
    tokens before a window's first eot_id are the tail of a document that began earlier and
    form document 0. Positions count from 0 at each document's first token.
    """
    is_start = tokens == eot_id
    doc = is_start.long().cumsum(1)
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    start = torch.where(is_start, index, torch.zeros_like(index)).cummax(1).values
    return doc, index - start


def block_causal_mask(doc: Tensor) -> Tensor:
    """SDPA's boolean mask (batch, 1, seq, seq): query i sees key j iff j <= i and both are in one document."""
    seq = doc.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def block_mask(doc: Tensor) -> BlockMask:
    """FlexAttention's BlockMask of the same rule as block_causal_mask, for doc (batch, seq) on CUDA."""
    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    return create_block_mask(mask_mod, doc.shape[0], None, doc.shape[1], doc.shape[1], device=doc.device)


@dataclasses.dataclass
class SequenceLayout:
    """Where a slice of tokens sits in its whole windows (context parallelism: one rank's share of each window).

    positions: (batch, slice) int64, the RoPE position of every token of the slice, taken from
    the whole windows' positions (restarting at each [EOT] under document_mask).
    doc: (batch, seq) int64 document ids of the whole windows, for the attention mask that the
    attention kernel applies over the whole sequence; None for plain causal attention.
    """

    positions: Tensor
    doc: Tensor | None = None


def slice_layout(tokens: Tensor, lo: int, hi: int, document_mask: bool, eot_id: int) -> SequenceLayout:
    """The SequenceLayout of tokens[:, lo:hi] within whole windows tokens (batch, seq) int64.

    Computed from the whole windows, so a document that crosses the slice boundary keeps its
    positions and its mask. Under document_mask a batch without eot_id is plain causal (doc
    None), as Transformer.forward does for whole windows.
    """
    if document_mask and bool((tokens == eot_id).any()):
        doc, pos = document_positions(tokens, eot_id)
        return SequenceLayout(pos[:, lo:hi].contiguous(), doc)
    pos = torch.arange(lo, hi, device=tokens.device).expand(tokens.shape[0], hi - lo)
    return SequenceLayout(pos, None)
