"""What each parameter and buffer of the model is for: the role vocabulary, and roles(model), which reads it.

Each module class of the model declares its own tensors' roles once, in a class attribute
``ROLES``: {local name: Role}, where a local name may reach into a plain torch child
(``"wq.weight"`` for an ``nn.Linear``, which declares nothing itself). Everything that treats
parameters differently reads the role instead of matching names: the initial std and the
mup/completep LR multipliers (nn/parametrization.py), Muon's groups (optimization/), float8's
high-precision readout and routers (parallel/float8.py), the multipliers folded into an export (hf.py).
A tensor that no module declares, or that two declare, is an error (roles raises), so a new
parameter cannot silently fall back to some default; tests/test_roles.py builds every kind of
model and checks it.

Layer 1, with model.py: imports torch only; full names are the model's own (state-dict) names.
"""
from __future__ import annotations

import enum

from torch import nn


class Role(enum.Enum):
    """The part a tensor plays; the properties group the roles as the parametrization and Muon see them."""

    EMBEDDING = "embedding"  # the token embedding: a lookup, its width grows, its rows (the vocabulary) do not
    QUERY = "query"  # attention.wq: a hidden matrix whose output carries mup's attention-score factor
    HIDDEN = "hidden"  # a block's other hidden matrices that read the residual stream (wk, wv, w1, w3)
    RESIDUAL = "residual"  # a hidden matrix that writes into the residual stream (attention.wo, w2)
    EXPERTS = "experts"  # routed experts stacked in 3-D (n_experts, out, in): w1, w3
    EXPERTS_RESIDUAL = "experts_residual"  # the routed experts' w2, stacked, writing into the residual stream
    ROUTER = "router"  # an MoE's router: output-like (its fan-out, n_experts, does not grow with the width)
    READOUT = "readout"  # the output projection to the vocabulary
    NORM = "norm"  # RMSNorm weights: start at one, not decayed
    BUFFER = "buffer"  # not trained; the declaring module's reset_buffers() fills it (RoPE tables, MoE bias)

    @property
    def hidden(self) -> bool:
        """Both dimensions grow with the width (mup's hidden init and LR; Muon updates exactly these)."""
        return self in _HIDDEN

    @property
    def writes_residual(self) -> bool:
        """Writes into the residual stream: GPT-2's 1/sqrt(2 n_layers) init, completep's branch multiplier."""
        return self in (Role.RESIDUAL, Role.EXPERTS_RESIDUAL)


_HIDDEN = frozenset({Role.QUERY, Role.HIDDEN, Role.RESIDUAL, Role.EXPERTS, Role.EXPERTS_RESIDUAL})


def declarations(model: nn.Module) -> list[tuple[str, Role]]:
    """(full name, role) of every ROLES entry of model's modules that names a tensor model holds, in module order.

    Entries naming a tensor that is absent are skipped: a pipeline stage (parallel/pipeline_stages.py)
    holds only some of the modules a class declares (no embedding, no output).
    """
    held = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    found = []
    for prefix, module in model.named_modules():
        for local, role in getattr(type(module), "ROLES", {}).items():
            name = f"{prefix}.{local}" if prefix else local
            if name in held:
                found.append((name, role))
    return found


def roles(model: nn.Module, strict: bool = True) -> dict[str, Role]:
    """{full name: Role} of every parameter and buffer of model (names as model.named_parameters gives them).

    Raises ValueError naming the tensors that two modules declare, and, when strict, those that no
    module declares (the fix: an entry in the ROLES of the module that owns them). strict=False
    returns what is declared (a model that is not this project's, e.g. a bare nn.Linear, gets {}).
    """
    table: dict[str, Role] = {}
    twice = []
    for name, role in declarations(model):
        if name in table:
            twice.append(name)
        table[name] = role
    held = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    missing = [n for n in held if n not in table] if strict else []
    if twice or missing:
        problems = ([f"declared twice: {', '.join(twice)}"] if twice else []) + (
            [f"no role: {', '.join(missing)}"] if missing else [])
        raise ValueError(f"{'; '.join(problems)}; each tensor needs exactly one entry in the ROLES of the module "
                         f"that owns it (nn/roles.py)")
    return table
