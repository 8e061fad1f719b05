"""The mixture-of-experts fields of model.ModelArgs and their checks, beside the MoE itself (nn/moe.py).

MoEArgs is a dataclass mixin: model.ModelArgs inherits its fields after the dense decoder's, so
they keep their place in ``--help``, the saved config and the field order. Its check reads the
decoder's n_layers and ffn_dim from the same object. MOE_FIELDS (the options besides n_experts)
and MOE_TRAINING_FIELDS (those that shape training, not the weights' function) are derived from
the fields here, the one list that the resume check and the Hugging Face comparison read.
Layer 1: imports torch and nn/ only; no distributed code.
"""
from __future__ import annotations

import dataclasses
import math

from nn.moe import SCORES, MoE


@dataclasses.dataclass
class MoEArgs:
    """The MoE fields of model.ModelArgs (a mixin: n_layers, ffn_dim and dim are the decoder's)."""

    n_experts: int = 0
    """Mixture of experts (nn/moe.py): routed experts per MoE feed-forward; 0 (default): every feed-forward is the dense SwiGLU MLP."""
    experts_per_token: int = 0
    """MoE: experts each token is routed to (token-choice top-k, dropless), in 1..n_experts."""
    expert_ffn_dim: int = 0
    """MoE: hidden width of each expert's SwiGLU; 0: ffn_dim."""
    n_shared_experts: int = 0
    """MoE: always-on experts of width expert_ffn_dim beside the routed ones (DeepSeek-V3, Llama 4)."""
    moe_score: str = "sigmoid"
    """MoE: router score function: 'sigmoid' per expert (DeepSeek-V3, the default: with the bias update it balanced best, docs/moe.md) or 'softmax' over the experts (Mixtral)."""
    moe_renormalize: bool = True
    """MoE: scale each token's k expert weights to sum to 1 (Mixtral, DeepSeek-V3); off: the raw scores."""
    moe_first_dense: int = 0
    """MoE: the first k layers keep the dense feed-forward (DeepSeek-V3 keeps 3); the others are MoE. In 0..n_layers-1."""
    moe_aux_loss: float = 0.0
    """MoE: coefficient of the Switch/Mixtral load-balancing loss, taken per sequence (0: off)."""
    moe_router_z_loss: float = 0.0
    """MoE: coefficient of the router z-loss, logsumexp(router logits)^2 per token (ST-MoE; 0: off)."""
    moe_bias_update_rate: float = 0.01
    """MoE: aux-loss-free balancing, the default (DeepSeek-V3's gamma; it used 0.001 over far longer runs): after each step every expert's routing bias moves by this toward even load (0: off)."""

    def check_moe(self) -> None:
        """Raise ValueError naming the field when the MoE fields are out of range, or set without n_experts."""
        if self.n_experts < 0:
            raise ValueError(f"model.n_experts must be >= 0 (0: dense), got {self.n_experts}")
        if not self.n_experts:
            default = MoEArgs.__dataclass_fields__
            moe = [f for f in MOE_FIELDS if getattr(self, f) != default[f].default]
            if moe:
                raise ValueError(f"{', '.join('model.' + f for f in moe)} {'applies' if len(moe) == 1 else 'apply'} "
                                 f"only to a mixture of experts; set --model.n_experts (and "
                                 f"--model.experts_per_token), or drop them")
            return
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"model.experts_per_token must be in 1..model.n_experts ({self.n_experts}), got "
                             f"{self.experts_per_token}")
        if self.expert_ffn_dim < 0:
            raise ValueError(f"model.expert_ffn_dim must be >= 0 (0: model.ffn_dim), got {self.expert_ffn_dim}")
        if self.n_shared_experts < 0:
            raise ValueError(f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.moe_score not in SCORES:
            raise ValueError(f"model.moe_score must be one of {', '.join(SCORES)}, got {self.moe_score!r}")
        if not 0 <= self.moe_first_dense < self.n_layers:
            raise ValueError(f"model.moe_first_dense must be in 0..model.n_layers-1 ({self.n_layers - 1}), got "
                             f"{self.moe_first_dense}")
        for name in MOE_TRAINING_FIELDS:
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"model.{name} must be a finite number >= 0 (0: off), got {getattr(self, name)}")

    @property
    def expert_hidden(self) -> int:
        """Hidden width of each expert (expert_ffn_dim, or ffn_dim when 0)."""
        return self.expert_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block layer_id (0-based) has the MoE feed-forward (n_experts > 0 and past moe_first_dense)."""
        return self.n_experts > 0 and layer_id >= self.moe_first_dense


MOE_FIELDS = tuple(f.name for f in dataclasses.fields(MoEArgs) if f.name != "n_experts")
"""The MoE options besides n_experts: refused with n_experts 0 unless at their defaults."""
MOE_TRAINING_FIELDS = ("moe_aux_loss", "moe_router_z_loss", "moe_bias_update_rate")
"""The MoE options that shape training only (balancing coefficients, the bias rate), not the weights' function."""


def moe_feed_forward(args: MoEArgs) -> MoE:
    """The MoE feed-forward of args's shape (args a model.ModelArgs; nn/moe.py)."""
    return MoE(args.dim, args.n_experts, args.experts_per_token, args.expert_hidden, args.n_shared_experts,
               args.moe_score, args.moe_renormalize, args.moe_aux_loss, args.moe_router_z_loss)
