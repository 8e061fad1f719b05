"""How the model and its optimizer scale with width and depth: sp (standard), mup, completep.

Hyperparameters tuned on a proxy of width model.base_dim (and depth model.base_n_layers) carry
over to model.dim (and model.n_layers) when every parameter's init, learning rate and forward
multiplier follow these rules. With m_N = dim / base_dim and m_L = n_layers / base_n_layers:

| parameter                          | sp               | mup                     | completep (alpha = 1)     |
|------------------------------------|------------------|-------------------------|---------------------------|
| tok_embeddings: init std, Adam LR  | 0.02, lr         | 0.02, lr                | 0.02, lr                  |
| hidden wq wk wv w1 w3: init std    | 0.02             | 0.02 / sqrt(m_N)        | 0.02 / sqrt(m_N)          |
| hidden wo w2: init std             | 0.02/sqrt(2 L)   | 0.02/sqrt(2 L m_N)      | 0.02 / sqrt(m_N)          |
| hidden matrices: Adam LR, decay    | lr, wd           | lr / m_N, wd * m_N      | lr / m_N, wd * m_N        |
| hidden matrices: Muon LR, decay    | lr (Moonlight), wd | lr / sqrt(m_N), wd*sqrt(m_N) | lr / sqrt(m_N), wd*sqrt(m_N) |
| output: init std, Adam LR          | 0.02, lr         | 0.02 m_N, lr            | 0.02 m_N, lr              |
| norm weights: Adam LR              | lr               | lr                      | lr                        |
| embedding multiplier               | 1                | a_in                    | a_in                      |
| logits multiplier                  | 1                | a_out / m_N             | a_out / m_N               |
| attention scores q.k times         | 1/sqrt(head_dim) | a_attn sqrt(d_0) / head_dim | a_attn sqrt(d_0) / head_dim |
| residual branch multiplier         | 1                | 1                       | 1 / m_L                   |
| Adam epsilon                       | eps              | eps / m_N               | eps / (m_N m_L)           |

a_in, a_out, a_attn are the base multipliers (model.mup_input_mult, mup_output_mult, mup_attn_mult; 1 by
default), constants of the proxy that are tuned there and carry over unchanged (Cerebras-GPT, u-muP tune them
beside the LR: benchmarks/lr_transfer.py --tune). d_0 is the proxy's head_dim (model.base_head_dim; by default
head_dim itself: a wider model has more heads of the same size). At a_attn = 1 the scores are sp's at the proxy's
head_dim and fall as 1/head_dim as it grows (microsoft/mup's attn_mult / d with attn_mult = sqrt(d_0)); with
head_dim kept they are sp's at every width.

Sources: mup is Tensor Programs V (Yang et al. 2022), Table 3's Adam column in the form of
its Table 8 (the output multiplier 1/m_N with a width-independent readout init and LR, as
microsoft/mup's MuReadout and MuAdam do), and the attention scale of its section 4; the init
and LR multipliers are those of EleutherAI's nanoGPT-mup (untied here: the output keeps
sp's init and LR, and carries the 1/m_N). completep is Dey et al. 2025 ("Don't be lazy:
CompleteP enables compute-efficient deep transformers"), Table 1 at alpha = 1: the residual multiplier m_L^-alpha, hidden LR
times m_L^(alpha-1) = 1, Adam epsilon times 1/(m_N m_L^alpha), and weight decay that keeps
lr * wd at the proxy's (nanoGPT-mup's completep branch; mup takes the same eps and decay rules at
m_L = 1: every gradient shrinks as 1/m_N, Everett et al. 2024, and lr * wd is what sets AdamW's
equilibrium, Wang & Aitchison 2024); the branch multiplier replaces
GPT-2's 1/sqrt(2 L) on wo and w2. Muon: its orthogonalised update has every singular value
near 1, so Moonlight's 0.2 sqrt(max(fan_out, fan_in)) LR makes the update's spectral norm grow
as sqrt(width); the spectral condition (Bernstein & Yang 2023, sqrt(fan_out / fan_in) at a
fixed aspect ratio) keeps it at the proxy's, which is Moonlight's factor frozen at the proxy
shape: lr / sqrt(m_N) (docs/optimizers.md; benchmarks/lr_transfer.py measures it).

The readout's init: its weights W enter the logits as a_out W / m_N, so W drawn at 0.02 m_N gives the effective
readout the proxy's init, entry by entry, while its Adam updates (lr on W, lr a_out / m_N on the effective weights)
keep Table 8's width-independent logit updates. Table 8 keeps W at 0.02 instead, which shrinks the effective readout
as 1/m_N (microsoft/mup's MuReadout; zero in its readout_zero_init): measured on 2 CPU cores over 150 steps
(benchmarks/results/cpu-2core_2026-12-06_mup_webtext.md), that left mup at 4x the proxy's width, at the proxy's LR,
0.08 .. 0.45 above sp tuned at that width (on web text, the stdlib and prose; on the first two above the proxy
itself), where the proxy's readout init puts it 0.05 .. 0.30 below sp (web text at one seed of three: 0.02 above;
docs/transfer.md); the attention scale, lower LRs for the embedding or the norms, and a lower LR did not.

At base_dim = dim and base_n_layers = n_layers with the base multipliers at 1, mup is sp, bit for bit, and
completep differs from it only in wo/w2's init (tests/test_parametrization.py). Measured on 2 CPU cores
(benchmarks/results/cpu-2core_2026-12-04_mup_fix.md): the former scores q.k / head_dim put mup's proxy
1/sqrt(head_dim) below sp's attention and made the transferred model worse than sp tuned at its width.
Everything here is a plain constant of the model's shape; no distributed code. `args` is a model.ModelArgs (duck-typed: this module
sits below model.py). Which row of the table a parameter follows is the role its module declares (nn/roles.py):
"hidden" is Role.hidden (the blocks' matrices and routed experts), "wo w2" Role.writes_residual, "output" Role.READOUT;
an MoE's router (Role.ROUTER, output-like: its fan-out n_experts does not grow) keeps 0.02, lr and no multiplier.
"""
from __future__ import annotations

import dataclasses
import math

from nn.roles import Role

PARAMETRIZATIONS = ("sp", "mup", "completep")
INIT_STD = 0.02
"""GPT-2's and Hugging Face Llama's initializer_range: the proxy's init std of every matrix."""
MULTS = ("mup_input_mult", "mup_output_mult", "mup_attn_mult")
"""The base multipliers: constants of the proxy, tuned there (benchmarks/lr_transfer.py --tune), that carry over."""


def check(args) -> None:
    """Raise ValueError naming the model field when the parametrization settings cannot apply to args's shape.

    Accepted: parametrization in PARAMETRIZATIONS; under mup/completep a base_dim that divides
    dim (a whole width multiplier: 64, 128, 256 ... below dim); under completep a base_n_layers
    in 1..n_layers; under sp neither base field set (they would do nothing).
    """
    p = args.parametrization
    if p not in PARAMETRIZATIONS:
        raise ValueError(f"model.parametrization must be one of {', '.join(PARAMETRIZATIONS)}, got {p!r}")
    for name in MULTS:
        if not 0 < getattr(args, name) < math.inf:
            raise ValueError(f"model.{name} must be a finite number > 0 (1: the default), got {getattr(args, name)}")
    if p == "sp":
        if args.base_dim or args.base_n_layers:
            raise ValueError("model.base_dim and model.base_n_layers apply only under model.parametrization mup or "
                             "completep; set --model.parametrization mup (or completep), or drop them")
        given = [f"model.{f}" for f in ("base_head_dim",) if args.base_head_dim]
        given += [f"model.{f}" for f in MULTS if getattr(args, f) != 1.0]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only under "
                             f"model.parametrization mup or completep; set --model.parametrization mup (or "
                             f"completep) with --model.base_dim, the proxy's width, or drop "
                             f"{'it' if len(given) == 1 else 'them'}")
        return
    if not 0 <= args.base_head_dim <= args.head_dim or args.base_head_dim % 2:
        raise ValueError(f"model.base_head_dim is the proxy's head_dim: an even number in 2..head_dim "
                         f"({args.head_dim}), or 0 for head_dim itself, got {args.base_head_dim}")
    if not 0 < args.base_dim <= args.dim or args.dim % args.base_dim:
        examples = [d for d in range(args.dim // 8, args.dim + 1) if d > 0 and args.dim % d == 0][:3]
        raise ValueError(f"model.parametrization {p} needs model.base_dim, the proxy width the hyperparameters were "
                         f"tuned at: a divisor of model.dim ({args.dim}) in 1..{args.dim} (e.g. "
                         f"{', '.join(map(str, examples))}), got {args.base_dim}")
    if p == "completep" and not 0 < args.base_n_layers <= args.n_layers:
        raise ValueError(f"model.parametrization completep needs model.base_n_layers, the proxy depth the "
                         f"hyperparameters were tuned at, in 1..model.n_layers ({args.n_layers}), got "
                         f"{args.base_n_layers}")
    if p == "mup" and args.base_n_layers:
        raise ValueError("model.base_n_layers applies only under model.parametrization completep (mup transfers "
                         "across width alone); set --model.parametrization completep, or drop it")


@dataclasses.dataclass(frozen=True)
class Multipliers:
    """The forward multipliers of a shape (all 1.0 under sp, so sp's graph has no extra op)."""

    width: float
    """m_N = dim / base_dim (1 under sp)."""
    depth: float
    """m_L = n_layers / base_n_layers (1 unless completep)."""
    query: float
    """Factor on the queries before attention's own 1/sqrt(head_dim): attn_mult sqrt(base_head_dim / head_dim) makes
    the scores attn_mult q.k sqrt(base_head_dim) / head_dim (sp's q.k / sqrt(head_dim) at the proxy's head_dim)."""
    residual: float
    """Factor on every residual branch's output (attention and feed-forward): 1/m_L."""
    logits: float
    """Factor on the final norm's output before the output projection: output_mult / m_N."""
    input: float = 1.0
    """Factor on the embedding's output: input_mult."""


def predated(saved: dict) -> dict:
    """The parametrization fields that a checkpoint's saved [model] table (its config.toml) lacks, at the values its
    code trained with: sp before model.parametrization existed; and before the base multipliers, mup/completep's
    scores q.k / head_dim, which mup_attn_mult 1/sqrt(head_dim) gives at base_head_dim 0 (so a resume that would
    change them is refused, naming the field and the checkpoint's value, which resumes it as it was)."""
    out = {"parametrization": "sp", "base_dim": 0, "base_n_layers": 0, "base_head_dim": 0, "mup_input_mult": 1.0,
           "mup_output_mult": 1.0, "mup_attn_mult": 1.0}
    if saved.get("parametrization", "sp") != "sp" and "mup_attn_mult" not in saved:
        out["mup_attn_mult"] = 1.0 / math.sqrt(saved["dim"] // saved["n_heads"])
    return {k: v for k, v in out.items() if k not in saved}


def multipliers(args) -> Multipliers:
    """The Multipliers of args (model.ModelArgs)."""
    if args.parametrization == "sp":
        return Multipliers(1.0, 1.0, 1.0, 1.0, 1.0)
    width = args.dim / args.base_dim
    depth = args.n_layers / args.base_n_layers if args.parametrization == "completep" else 1.0
    query = args.mup_attn_mult * math.sqrt(base_head_dim(args) / args.head_dim)
    return Multipliers(width, depth, query, 1.0 / depth, args.mup_output_mult / width, args.mup_input_mult)


def base_head_dim(args) -> int:
    """The proxy's head_dim: model.base_head_dim, or model.head_dim when 0 (the heads, not their size, grow)."""
    return args.base_head_dim or args.head_dim


def init_std(args, role: Role) -> float | None:
    """Initial std of a parameter of this role (nn/roles.py; see the table); None for norm weights, which start at one.

    The embedding and an MoE's router (output-like: its fan-out, n_experts, does not grow with the
    width, Tensor Programs V's rule for a readout) keep 0.02. Raises ValueError for Role.BUFFER.
    """
    if role is Role.BUFFER:
        raise ValueError("a buffer has no initial std: its module's reset_buffers fills it")
    if role is Role.NORM:
        return None
    m = multipliers(args)
    if role is Role.READOUT:
        return INIT_STD * m.width  # the readout a_out W / m_N starts as the proxy's, entry by entry (1 under sp)
    if not role.hidden:
        return INIT_STD
    if args.parametrization == "completep":
        return INIT_STD / math.sqrt(m.width)
    if role.writes_residual:
        return INIT_STD / math.sqrt(2 * args.n_layers * m.width)
    return INIT_STD / math.sqrt(m.width)


def optimizer_settings(args, role: Role | None, muon: bool, weight_decay: float, eps: float) -> dict:
    """{"lr_mult", "weight_decay", "eps"} of a parameter of this role (see the table); args None is sp.

    role None: a parameter of a model that declares no roles (not this project's), treated as not hidden.
    weight_decay: optim.weight_decay, or 0 for a parameter that is not decayed (norm weights).
    lr_mult multiplies optim.lr. muon: the parameter is in a Muon group (its LR then also
    carries Moonlight's 0.2 sqrt(max(m, n)), applied by the optimizer).
    """
    if args is None or args.parametrization == "sp":
        return {"lr_mult": 1.0, "weight_decay": weight_decay, "eps": eps}
    m = multipliers(args)
    decay, mult = weight_decay, 1.0
    if role is not None and role.hidden:
        mult = 1.0 / math.sqrt(m.width) if muon else 1.0 / m.width
        decay /= mult  # lr * wd stays the proxy's (independent weight decay)
    # Every gradient shrinks as 1/m_N (the logits carry 1/m_N): eps keeps its place beside them.
    return {"lr_mult": mult, "weight_decay": decay, "eps": eps / (m.width * m.depth)}


def fold(args, state: dict, roles: dict[str, Role], inverse: bool = False) -> dict:
    """The state dict (our names -> full tensors) with every forward multiplier folded into the weights.

    The folded weights compute the same function in a model without multipliers (sp, or Hugging
    Face's LlamaForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM): wq times the query factor (RoPE is
    linear), wo and w2 (dense, routed experts' and shared experts') times the residual factor, output times
    the logits factor; the router has no multiplier. roles: nn/roles.roles of the model (a name of state
    without a role raises KeyError). inverse=True divides instead: a folded
    state (an export) back into this parametrization's weights. Returns new tensors; state is
    not modified. Under sp it returns state's tensors as they are.
    """
    m = multipliers(args)
    # An MoE's residual branch is the weighted sum of its experts' and shared experts' w2 outputs: linear in each.
    factors = {Role.QUERY: m.query, Role.EMBEDDING: m.input, Role.READOUT: m.logits, Role.RESIDUAL: m.residual,
               Role.EXPERTS_RESIDUAL: m.residual}
    out = {}
    for k, v in state.items():
        f = factors.get(roles[k], 1.0)
        out[k] = v if f == 1.0 else (v / f if inverse else v * f)
    return out
