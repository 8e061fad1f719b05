"""A Llama-style decoder in plain PyTorch, free of distributed code.

With ``document_mask`` a packed window holding several documents is computed as if each
document were alone: attention stays inside a document and RoPE positions restart at each
``[EOT]`` (which precedes every document, as a BOS would). On CUDA this runs FlexAttention
with a block mask; elsewhere SDPA with a boolean block-causal mask.

Module names follow Meta's Llama (``tok_embeddings``, ``layers.{i}.attention.wq``,
``feed_forward.w1``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so the tensor
parallel plan in ``train_2d.py`` and the Hugging Face mapping in ``hf.py`` read naturally.
RoPE uses the "rotate half" layout of Hugging Face's ``LlamaForCausalLM``, so exported
weights need no permutation.

Parallelism is applied from outside: attention infers its local head count from the width
of the projections, so the same code runs whole or with column-sharded ``wq``/``wk``/``wv``;
its kernel is the replaceable ``Attention.attend`` (context_parallel.py swaps in Ulysses), and a
forward on a slice of longer windows takes the slice's ``SequenceLayout`` (positions and the
windows' documents, computed from the whole windows by nn/documents.py's ``slice_layout``).
Decoding (generate.py) runs this same forward with a ``KVCache`` per layer, unsharded.
Under ``parametrization`` mup or completep (nn/parametrization.py) the init follows its table and
constants of the shape multiply the embedding, the queries, the residual branches and the logits.
With ``n_experts`` > 0 the feed-forward of every block past the first ``moe_first_dense`` is a
mixture of experts (nn/moe.py: ``feed_forward.router``, ``.experts.w1/w2/w3``, ``.shared_experts``,
the balancing buffer ``.expert_bias``); with 0, the default, the model is the dense one, bit for bit.
Each module declares its own tensors' roles (``ROLES``, nn/roles.py), which init_weights reads.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from nn.documents import SequenceLayout, block_causal_mask, block_mask, document_positions
from nn.moe_args import MoEArgs, moe_feed_forward
from nn.parametrization import check as check_parametrization
from nn.parametrization import init_std, multipliers
from nn.presets import PRESETS  # noqa: F401  (model.PRESETS: the configs' presets, re-exported)
from nn.roles import Role, roles


@dataclasses.dataclass
class LlamaArgs:
    """The dense decoder's fields of ModelArgs (its MoE fields follow them: nn/moe_args.MoEArgs)."""

    dim: int = 768
    """Width of the residual stream (hidden size)."""
    n_layers: int = 12
    """Number of decoder blocks."""
    n_heads: int = 12
    """Number of query heads."""
    n_kv_heads: int = 3
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    vocab_size: int = 50_000
    """Rows of the embedding and of the output projection; the tokenizer must fit in it."""
    ffn_dim: int = 3072
    """Hidden width of the SwiGLU MLP (w1/w3 output, w2 input)."""
    max_seq_len: int = 2048
    """Length of the RoPE table: the longest sequence the model accepts."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (Llama 1-3 use 1e-5)."""
    rope_theta: float = 10_000.0
    """RoPE base frequency (Llama 3 uses 500000)."""
    document_mask: bool = False
    """Attend only within the current document of a packed window and restart RoPE positions at each [EOT] (Llama 3's packing); off: plain causal attention over the whole window."""
    eot_id: int = 2
    """Token id of [EOT], the token that precedes every document (2 in tokenizers trained here); used by document_mask."""
    parametrization: str = "sp"
    """How init, per-parameter LRs and forward multipliers scale with width and depth: 'sp' (standard), 'mup' (hyperparameters transfer across width), 'completep' (across width and depth); nn/parametrization.py."""
    base_dim: int = 0
    """mup/completep: the proxy width the hyperparameters were tuned at (a divisor of dim); 0 under sp."""
    base_n_layers: int = 0
    """completep: the proxy depth the hyperparameters were tuned at (1..n_layers); 0 otherwise."""
    base_head_dim: int = 0
    """mup/completep: the proxy's head_dim (even, up to head_dim); 0: head_dim itself (the proxy had fewer heads, not smaller ones)."""
    mup_input_mult: float = 1.0
    """mup/completep: the proxy's multiplier on the embedding's output (a base multiplier, tuned on the proxy)."""
    mup_output_mult: float = 1.0
    """mup/completep: the proxy's multiplier on the logits (a base multiplier; the logits carry it / m_N)."""
    mup_attn_mult: float = 1.0
    """mup/completep: the proxy's multiplier on the attention scores, q.k mup_attn_mult sqrt(base_head_dim) / head_dim (1: sp's scores at the proxy)."""


@dataclasses.dataclass
class ModelArgs(MoEArgs, LlamaArgs):
    """Shape of a Llama decoder. Derived sizes are computed and validated on construction."""

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        for name in ("norm_eps", "rope_theta"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a finite number > 0, got {getattr(self, name)}")
        if not 0 <= self.eot_id < self.vocab_size:
            raise ValueError(f"model.eot_id must be in 0..model.vocab_size-1 ({self.vocab_size - 1}), got {self.eot_id}")
        check_parametrization(self)
        self.check_moe()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin tables for rotary embeddings, computed in fp64 and returned in fp32.

    Returns two tensors of shape (max_seq_len, head_dim), dtype float32, laid out for the
    rotate-half convention: frequency i sits at columns i and i + head_dim/2.
    Source: Su et al., RoFormer (2021), eq. 34; theta_i = theta^(-2i/head_dim).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (batch, seq, heads, head_dim) by position; computed in fp32, returned in x.dtype.

    cos, sin: tables (positions, head_dim) whose first seq rows are positions 0..seq-1, or
    per-token values (batch, seq, head_dim) (positions that restart at each document). They
    are fp32 unsharded, but under bf16 mixed precision FSDP2 casts a block's floating-point
    inputs, cos and sin included, to bf16: the rotation then runs in fp32 on bf16-rounded
    tables (as Hugging Face's Llama, whose rotary tables take x's dtype).
    """
    seq_len = x.shape[1]
    if cos.dim() == 2:
        cos, sin = cos[:seq_len].unsqueeze(0), sin[:seq_len].unsqueeze(0)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: x / sqrt(mean(x^2) + eps) * weight, normalised in fp32.

    Matches Hugging Face's LlamaRMSNorm: the normalisation runs in fp32 and is cast back to
    the input dtype before the weight is applied.
    """

    ROLES = {"weight": Role.NORM}

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@functools.cache
def _flex_attention():
    # Compiled once per process: eager FlexAttention materialises the scores and is slow.
    return torch.compile(flex_attention, dynamic=False)


class KVCache:
    """Keys and values of one attention layer for decoding, unsharded: k, v (batch, max_len, n_kv_heads, head_dim)."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device=None):
        self.k = torch.zeros(batch, max_len, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Store k, v (batch, seq, n_kv_heads, head_dim) at positions start..start+seq-1; return the
        keys and values of positions 0..start+seq-1. Raises ValueError past max_len."""
        end = start + k.shape[1]
        if end > self.k.shape[1]:
            raise ValueError(f"position {end} exceeds the KV cache length {self.k.shape[1]}")
        self.k[:, start:end], self.v[:, start:end] = k, v
        return self.k[:, :end], self.v[:, :end]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
    """Grouped-query attention of q (batch, seq_q, heads, head_dim) over k, v (batch, seq_k, kv_heads, head_dim).

    mask: None (causal), SDPA's boolean (batch, 1, seq_q, seq_k), or a FlexAttention BlockMask.
    Returns (batch, seq_q, heads, head_dim) in q's dtype. The default Attention.attend.
    """
    n_rep = q.shape[2] // k.shape[2]
    # (bsz, heads, seq, head_dim). The CPU kernel shares K/V heads itself (enable_gqa, no copies);
    # elsewhere K/V are repeated so every SDPA kernel applies.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, BlockMask):
        out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=n_rep > 1)
    else:
        gqa = n_rep > 1 and q.device.type == "cpu"
        if n_rep > 1 and not gqa:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; optionally masked to documents or reading a KV cache.

    attend(q, k, v, mask): the kernel (see attention), an attribute so that parallelism can
    replace it from outside (context_parallel.py's Ulysses runs it over the whole sequence).
    """

    ROLES = {"wq.weight": Role.QUERY, "wk.weight": Role.HIDDEN, "wv.weight": Role.HIDDEN, "wo.weight": Role.RESIDUAL}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.query_scale = multipliers(args).query
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.attend: Callable[[Tensor, Tensor, Tensor, Tensor | BlockMask | None], Tensor] = attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None = None,
                cache: KVCache | None = None, start: int = 0) -> Tensor:
        """x: (batch, seq, dim); cos/sin: see apply_rope; mask: None (causal), SDPA's boolean
        (batch, 1, seq, seq) or a FlexAttention BlockMask. Returns (batch, seq, dim). With cache, x
        holds positions start..start+seq-1 (cos/sin from start on), its keys and values join cache,
        and queries attend to positions 0..start+seq-1 under mask: boolean (seq, start+seq), or None
        (causal) when start is 0."""
        bsz, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv hold only this rank's heads.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        if self.query_scale != 1.0:
            q = q * self.query_scale  # mup's score scale (nn/parametrization.py), whatever the kernel (Ulysses included)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, start)  # (bsz, start + seq, kv heads, head_dim)
        out = self.attend(q, k, v, mask)
        return self.wo(out.reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). Source: Shazeer, GLU Variants (2020)."""

    ROLES = {"w1.weight": Role.HIDDEN, "w2.weight": Role.RESIDUAL, "w3.weight": Role.HIDDEN}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    feed_forward: the dense SwiGLU MLP, or the MoE (nn/moe.py) when args.is_moe_layer(layer_id).
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = moe_feed_forward(args) if args.is_moe_layer(layer_id) else FeedForward(args)
        self.residual_scale = multipliers(args).residual

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None = None,
                cache: KVCache | None = None, start: int = 0) -> Tensor:
        # cache and start by keyword: the TP plan's PrepareModuleInput lays out the 4 positional inputs.
        r = self.residual_scale  # completep's 1/m_L; 1 otherwise, and then no op
        a = self.attention(self.attention_norm(x), cos, sin, mask, cache=cache, start=start)
        h = x + (a if r == 1.0 else r * a)
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if r == 1.0 else r * f)


class Transformer(nn.Module):
    """Llama decoder: tokens (batch, seq) int64 -> logits (batch, seq, vocab_size) float32."""

    ROLES = {"tok_embeddings.weight": Role.EMBEDDING, "output.weight": Role.READOUT, "rope_cos": Role.BUFFER,
             "rope_sin": Role.BUFFER}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.logits_scale = multipliers(args).logits
        self.input_scale = multipliers(args).input
        # Not persistent: recomputed by init_weights, never checkpointed. fp32 here; a block
        # sharded with bf16 mixed precision receives them cast to bf16 (see apply_rope).
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        roles(self)  # every parameter and buffer declares its role (raises otherwise)
        self.init_weights(seed=0)

    def forward(self, tokens: Tensor, head: Callable[[nn.Module, Tensor], Tensor] | None = None,
                cache: list[KVCache] | None = None, start: int = 0, layout: SequenceLayout | None = None) -> Tensor:
        """tokens: (batch, seq) int64 with seq <= max_seq_len. Returns fp32 logits (batch, seq, vocab).

        head: applied as head(self.output, h) to the final norm's output h (batch, seq, dim)
        instead of self.output(h).float(), and its result returned: e.g. a loss that runs the
        output projection chunk by chunk. It runs inside forward, so wrappers that manage the
        parameters around forward (FSDP) see it as part of it.

        cache (one KVCache per layer, see kv_cache; unsharded only): the tokens are positions
        start..start+seq-1 and attend causally to themselves and to positions 0..start-1 held in
        cache, which their keys and values join. This path ignores document_mask: it serves
        generation, one document (a prompt starting with [EOT], stopped at the next), whose
        document layout is the causal one. Raises ValueError when start + seq exceeds
        max_seq_len (the RoPE table) or the cache, or for start < 0 or start without a cache.

        layout (no cache): tokens are a slice of longer windows (context parallelism), with the
        slice's RoPE positions and the whole windows' documents (see nn/documents.slice_layout); the mask
        is that of the whole windows, for an Attention.attend that attends over them.
        """
        seq_len = tokens.shape[1]
        if start + seq_len > self.args.max_seq_len:
            raise ValueError(f"sequence length {start + seq_len} exceeds model.max_seq_len {self.args.max_seq_len}")
        if start < 0 or (start and cache is None):
            raise ValueError(f"start ({start}) must be >= 0, and 0 without a cache")
        cos, sin, mask = self.rope_cos, self.rope_sin, None
        if cache is not None:
            # Query i (position start + i) sees keys 0..start + i; from position 0 that is the causal kernel.
            cos, sin = cos[start:], sin[start:]
            if start:
                mask = torch.ones(seq_len, start + seq_len, dtype=torch.bool, device=tokens.device).tril(start)
        elif layout is not None:
            cos, sin = self.rope_cos[layout.positions], self.rope_sin[layout.positions]
            if layout.doc is not None:
                mask = block_mask(layout.doc) if tokens.device.type == "cuda" else block_causal_mask(layout.doc)
        elif self.args.document_mask:
            cos, sin, mask = self._document_layout(tokens)
        # A pipeline stage (parallel/pipeline.py) holds some blocks: without the embedding it takes the
        # residual stream (batch, seq, dim) as `tokens`; without the final norm it returns it.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.tok_embeddings is not None and self.input_scale != 1.0:
            h = h * self.input_scale  # mup's base input multiplier
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, mask, cache[i], start)
        if self.norm is None:
            return h
        h = self.norm(h)
        if self.logits_scale != 1.0:
            h = h * self.logits_scale  # mup's 1/m_N on the logits, before any head (chunked or vocab-parallel)
        if head is not None:
            return head(self.output, h)
        # fp32 logits: the loss must never be taken on bf16 logits.
        return self.output(h).float()

    def kv_cache(self, batch: int, max_len: int) -> list[KVCache]:
        """One empty KVCache per layer for batch sequences of up to max_len positions, in the dtype
        and on the device of the parameters."""
        w, a = self.tok_embeddings.weight, self.args
        return [KVCache(batch, max_len, a.n_kv_heads, a.head_dim, w.dtype, w.device) for _ in self.layers]

    def _document_layout(self, tokens: Tensor):
        """Per-token RoPE tables (batch, seq, head_dim) and the attention mask of packed documents.

        A batch without [EOT] is plain causal: the tables and the causal kernel of today (no
        mask), so its logits are exactly those without document_mask. On CUDA the mask is a
        FlexAttention BlockMask; elsewhere (FlexAttention has no CPU backward) SDPA's boolean mask.
        """
        if tokens.device.type != "cuda" and not bool((tokens == self.args.eot_id).any()):
            return self.rope_cos, self.rope_sin, None
        doc, pos = document_positions(tokens, self.args.eot_id)
        mask = block_mask(doc) if tokens.device.type == "cuda" else block_causal_mask(doc)
        return self.rope_cos[pos], self.rope_sin[pos], mask

    def reset_buffers(self) -> None:
        """Recompute the RoPE tables on their device (init_weights calls this, and each module's own)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int, copy_: Callable[[Tensor, Tensor], None] = Tensor.copy_) -> None:
        """Fill every parameter and buffer, deterministically from seed.

        A parameter's std follows its declared role (nn/roles.py; nn/parametrization.init_std: Normal(0, 0.02) under
        sp, GPT-2's 1/sqrt(2 n_layers) on the residual writers, norm weights at one); each module that holds
        buffers resets them (reset_buffers). Each parameter's full value is drawn from its own generator, seeded
        by (seed, name), so the result does not depend on world size, sharding or layer order, and no two
        layers repeat. copy_(param, full) writes the full value into the parameter; callers
        that hold sharded parameters pass a function that keeps only the local shard.
        Generation runs on the RoPE buffer's device (after to_empty: the training device).
        """
        device = self.rope_cos.device
        if device.type == "meta":
            return
        for module in self.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        role = roles(self)
        for name, param in self.named_parameters():
            std = init_std(self.args, role[name])
            if std is None:
                full = torch.ones(param.shape, device=device)
            else:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(param.shape, device=device).normal_(0.0, std, generator=gen)
            copy_(param, full.to(param.dtype))


def num_params(a: ModelArgs, exclude_embedding: bool = False, active: bool = False) -> int:
    """Number of parameters of the full (unsharded) model with shape a.

    exclude_embedding drops the token embedding table (a lookup, no FLOPs); the output
    projection is kept, as it is a matmul. active: an MoE layer counts only the
    experts_per_token routed experts a token runs through (with the router and the shared
    experts), not all n_experts; the same as the total for a dense model.
    """
    per_layer = 2 * a.dim + a.dim * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads)
    n_moe = max(0, a.n_layers - a.moe_first_dense) if a.n_experts else 0  # is_moe_layer's count, in O(1)
    routed = a.experts_per_token if active else a.n_experts
    moe_ffn = a.dim * a.n_experts + 3 * a.dim * a.expert_hidden * (routed + a.n_shared_experts)
    ffn = (a.n_layers - n_moe) * 3 * a.dim * a.ffn_dim + n_moe * moe_ffn
    total = a.n_layers * per_layer + ffn + a.dim + 2 * a.vocab_size * a.dim
    return total - a.vocab_size * a.dim if exclude_embedding else total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at sequence length seq_len.

    6 N + 12 L H Q T, from the PaLM paper (Chowdhery et al. 2022, appendix B): N the
    non-embedding parameters a token runs through (an MoE's active ones, num_params(active=True)), L layers, H heads, Q head dim, T sequence length. The
    attention term counts the full T x T score matrix, as PaLM does (causal masking is not
    subtracted). Activation recomputation is not counted (this is model FLOPs, for MFU).
    """
    n = num_params(args, exclude_embedding=True, active=True)
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len

