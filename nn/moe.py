"""Mixture-of-experts feed-forward: a router, token-choice top-k, dropless, SwiGLU experts computed grouped.

Every token goes to the k experts of highest score (plus the bias below), none is dropped
(no capacity factor); its output is the weighted sum of those experts' SwiGLU outputs, plus
the always-on shared experts' (DeepSeek-V3, Llama 4). Scores: softmax over the experts
(Mixtral) or a sigmoid per expert (DeepSeek-V3); the k weights are optionally renormalised to
sum to one (Mixtral's softmax over the top-k logits is the renormalised softmax).

Balancing (docs/moe.md):
- aux-loss-free (DeepSeek-V3, Wang et al. 2024 "Auxiliary-Loss-Free Load Balancing"): the
  buffer ``expert_bias`` (n_experts,) is added to the scores for the top-k choice only, never
  to the weights; the training step nudges it after each update from the global token counts
  (``counts``, recorded by every forward) by gamma * sign(mean - count).
- the Switch / Mixtral auxiliary loss (Fedus et al. 2021, eq. 4) in DeepSeek-V3's sequence-wise
  form: per sequence, sum_i f_i P_i with f_i = E / (k T) * (tokens of the sequence choosing i)
  and P_i the mean normalised score of expert i over the sequence's T tokens (1 when even).
- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): logsumexp of the router logits, squared.
Both losses are kept as sums over tokens (a sequence's balance loss counted T times), so the
step divides them by the global token count as it does the cross-entropy: the result is the
mean over sequences, whatever the data-parallel layout. ``aux_loss`` holds the coefficients'
weighted sum of the last forward, with autograd, for the step to add to the objective.

The routed experts are 3-D parameters: w1, w3 (n_experts, expert_ffn_dim, dim), w2
(n_experts, dim, expert_ffn_dim). Tokens are sorted by expert and each projection is one
grouped matmul (nn/grouped_mm.py: torch._grouped_mm on CPU in fp32, bf16, fp16 and on CUDA in bf16;
a loop over the experts, the same math, where the kernel does not run). Sorting and unsorting
are gathers on the device whose gradients are gathers too (nn/rows.py), and the counts a scatter-add:
no host sync there, and the same bits on every run.
Layer 1: imports torch, nn/grouped_mm.py, nn/roles.py and nn/rows.py only; no distributed code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nn.grouped_mm import grouped_mm
from nn.roles import Role
from nn.rows import gather_rows, inverse_permutation

SCORES = ("softmax", "sigmoid")


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts held as 3-D parameters (FeedForward's math per expert)."""

    ROLES = {"w1": Role.EXPERTS, "w2": Role.EXPERTS_RESIDUAL, "w3": Role.EXPERTS}

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (tokens, dim) sorted by expert, counts (n_experts,) tokens per expert -> (tokens, dim).

        Expert parallelism (parallel/expert_parallel.py) replaces this method on each instance by
        one that sends the tokens to the ranks holding their experts and calls swiglu_experts there.
        """
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3)


def swiglu_experts(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """Each group of rows of x through its expert's SwiGLU: x (tokens, dim) sorted by expert, counts (E,) int64
    summing to tokens, w1/w3 (E, F, dim), w2 (E, dim, F) plain tensors -> (tokens, dim) in x's dtype."""
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    return grouped_mm(F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts), w2, counts)


class SharedExperts(nn.Module):
    """The always-on experts, fused into one SwiGLU MLP of width n_shared_experts * expert_ffn_dim (DeepSeek-V3)."""

    ROLES = {"w1.weight": Role.HIDDEN, "w2.weight": Role.RESIDUAL, "w3.weight": Role.HIDDEN}

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def expert_counts(choice: Tensor, n_experts: int) -> Tensor:
    """(n_experts,) int64: how many of choice's entries (rows,) int64 in [0, n_experts) name each expert.

    A scatter-add of ones, where torch.bincount would read the largest id back to the host to size its output (a
    sync on CUDA every layer). planning/dryrun.py replaces this function to plant a planned load."""
    return torch.zeros(n_experts, dtype=torch.int64, device=choice.device).scatter_add_(0, choice, torch.ones_like(choice))


def moe_layers(model: nn.Module) -> list[MoE]:
    """model's MoE feed-forwards, in module order (layer order); [] for a dense model."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class MoE(nn.Module):
    """The MoE feed-forward: x (batch, seq, dim) -> (batch, seq, dim), with ``aux_loss`` and ``counts`` recorded.

    After each forward: ``counts`` (n_experts,) int64, the tokens routed to each expert (no
    autograd); ``aux_loss`` a 0-dim fp32 tensor with autograd, aux_coef * (sum over sequences
    of seq_len * balance loss) + z_coef * (sum over tokens of logsumexp(router logits)^2), or
    None when both coefficients are 0.
    """

    ROLES = {"router.weight": Role.ROUTER, "expert_bias": Role.BUFFER}

    def __init__(self, dim: int, n_experts: int, experts_per_token: int, expert_ffn_dim: int,
                 n_shared_experts: int = 0, score: str = "softmax", renormalize: bool = True,
                 aux_coef: float = 0.0, z_coef: float = 0.0):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        self.n_experts, self.top_k, self.score, self.renormalize = n_experts, experts_per_token, score, renormalize
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, expert_ffn_dim)
        self.shared_experts = SharedExperts(dim, n_shared_experts * expert_ffn_dim) if n_shared_experts else None
        # Persistent: the bias is training state, saved and resumed with the weights.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.counts: Tensor | None = None
        self.aux_loss: Tensor | None = None
        # Context parallelism gives each rank a slice of every sequence; the balance loss needs the whole
        # sequence's choices, so parallel/ sets this to a sum over the CP group (no autograd). None: identity.
        self.sequence_sum = None

    def reset_buffers(self) -> None:
        """Balancing starts neutral: expert_bias zero (the model's init_weights calls this)."""
        self.expert_bias.zero_()

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(expert ids (tokens, k) int64, weights (tokens, k), scores (tokens, E), router logits (tokens, E)) of x
        (tokens, dim); the last three in fp32 (fp64 for an fp64 x)."""
        logits = self.router(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        # The bias steers the choice only; the weights are the unbiased scores of the chosen experts.
        ids = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights, scores, logits

    def forward(self, x: Tensor) -> Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        ids, weights, scores, logits = self.route(flat)
        choice = ids.flatten()  # (tokens * k): token t's j-th expert at t * k + j
        counts = expert_counts(choice, self.n_experts)
        order = torch.argsort(choice, stable=True)
        inverse = inverse_permutation(order)
        routed = self.experts(gather_rows(flat, order // self.top_k, inverse), counts)  # (tokens * k, dim), by expert
        out = gather_rows(routed, inverse, order).view(-1, self.top_k, dim)  # back to (token, j): no scatter-add
        y = torch.bmm(weights.unsqueeze(1).to(out.dtype), out).squeeze(1)  # (tokens, 1, k) @ (tokens, k, dim)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        self.counts = counts.detach()
        self.aux_loss = self._losses(ids, scores, logits, bsz, seq)
        return y.view(bsz, seq, dim)

    def _losses(self, ids: Tensor, scores: Tensor, logits: Tensor, bsz: int, seq: int) -> Tensor | None:
        """aux_coef * sequence-wise balance loss summed over tokens + z_coef * router z-loss summed over tokens."""
        total = None
        if self.aux_coef:
            e = self.n_experts
            chosen = torch.zeros(bsz * seq, e, dtype=scores.dtype, device=ids.device).scatter_(1, ids, 1.0).view(bsz, seq, e)
            chosen = chosen.sum(1)  # (batch, E): no gradient, as in Switch
            if self.sequence_sum is not None:
                chosen = self.sequence_sum(chosen)  # the whole sequences' choices
            f = chosen * (e / chosen.sum(-1, keepdim=True))  # E / (k T) x choices: each of T tokens chose k
            p = scores / scores.sum(-1, keepdim=True) if self.score == "sigmoid" else scores
            # T x (f . mean P) = f . (sum of P over this rank's tokens): a slice's share adds up over CP ranks.
            total = self.aux_coef * (f * p.view(bsz, seq, e).sum(1)).sum()
        if self.z_coef:
            z = self.z_coef * torch.logsumexp(logits, dim=-1).square().sum()
            total = z if total is None else total + z
        return total
