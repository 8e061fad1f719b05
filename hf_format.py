"""Hugging Face's side of our model: which transformers class an export is, the tensor names and config.json.

A dense model is a ``LlamaForCausalLM``; a mixture of experts a ``MixtralForCausalLM`` (softmax routing) or a
``Glm4MoeForCausalLM`` (sigmoid routing, the default). hf.py writes and reads folders with these maps; why
the math needs no conversion is in its docstring.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import Tensor

from core.errors import UserError
from model import ModelArgs

# ---------------------------------------------------------------- the name mapping

# Which transformers class an export is, by our routing (hf_model_type): a dense model is a Llama; softmax top-k
# routing renormalised, without shared experts or dense layers, is Mixtral's; sigmoid routing with a bias on the
# choice, optional shared experts and first dense layers is GLM-4.5's (Glm4MoeForCausalLM, with group-limited
# routing off: n_group 1, and routed_scaling_factor 1), whose attention is Llama's at partial_rotary_factor 1.
# (DeepseekV3ForCausalLM routes the same way, but its attention is MLA, which cannot express ours.)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {  # inside layers.{i} / model.layers.{i}, every architecture
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",  # silu branch (a dense layer)
    "feed_forward.w3.weight": "mlp.up_proj.weight",  # linear branch
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# An MoE layer, in the layout of the models on the Hub (the one every transformers version loads): one 2-D tensor
# per expert, '*' its index, which our 3-D experts parameters hold along dim 0.
_MOE_LAYER = {
    "llama": {},
    "mixtral": {"feed_forward.router.weight": "block_sparse_moe.gate.weight",
                "feed_forward.experts.w1": "block_sparse_moe.experts.*.w1.weight",
                "feed_forward.experts.w3": "block_sparse_moe.experts.*.w3.weight",
                "feed_forward.experts.w2": "block_sparse_moe.experts.*.w2.weight"},
    "glm4_moe": {"feed_forward.router.weight": "mlp.gate.weight",
                 "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
                 "feed_forward.experts.w1": "mlp.experts.*.gate_proj.weight",
                 "feed_forward.experts.w3": "mlp.experts.*.up_proj.weight",
                 "feed_forward.experts.w2": "mlp.experts.*.down_proj.weight",
                 "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
                 "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
                 "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight"},
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
# Buffers some older exports saved; recomputed from the config, never weights.
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class HFError(UserError):
    """A folder that is not a usable Hugging Face model, or bad export input; one-line message."""


def _layer_map(kind: str) -> dict[str, str]:
    return {**_LAYER, **_MOE_LAYER[kind]}


def to_hf_name(name: str, kind: str = "llama") -> str:
    """Our parameter name (e.g. 'layers.3.attention.wq.weight') -> HF's ('model.layers.3.self_attn.q_proj.weight')
    in the architecture kind (a key of ARCHITECTURES); a 3-D experts parameter's has '*' for the expert index.

    Raises HFError for a name outside the mapping.
    """
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    layer = _layer_map(kind)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    raise HFError(f"parameter '{name}' has no Hugging Face {ARCHITECTURES[kind]} name")


def from_hf_name(name: str, kind: str = "llama") -> tuple[str, int | None]:
    """HF tensor name of architecture kind -> (our name, expert index or None); HFError outside the mapping.

    A per-expert tensor (e.g. 'model.layers.0.block_sparse_moe.experts.5.w1.weight') gives the 3-D parameter it
    is row 5 of ('layers.0.feed_forward.experts.w1', 5).
    """
    if name in _TOP_BACK:
        return _TOP_BACK[name], None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for ours, theirs in _layer_map(kind).items():
            e = re.fullmatch(re.escape(theirs).replace(r"\*", r"(\d+)"), m.group(2))
            if e:
                return f"layers.{m.group(1)}.{ours}", int(e.group(1)) if e.groups() else None
    raise HFError(f"tensor '{name}' is not a {ARCHITECTURES[kind]} weight this model has (biases, or another "
                  f"architecture?)")


def hf_model_type(args: ModelArgs, state: dict[str, Tensor] | None = None) -> str:
    """The architecture (a key of ARCHITECTURES) that computes exactly a model of shape args.

    Raises HFError, naming what that class cannot express and the settings that export, for softmax routing
    with shared experts, dense first layers, raw (not renormalised) weights or, when state (our names ->
    tensors, the routing bias at least) is given, a balancing bias that moved (Mixtral has none of these): every
    one of them in one refusal, so that the fix of one is not followed by a refusal of the next. Also for sigmoid
    routing over a single expert (GLM-4.5's router takes the top 2 scores of its group).
    """
    if not args.n_experts:
        return "llama"
    if args.moe_score == "softmax":
        bad = [f"model.{k} {getattr(args, k)}" for k in ("n_shared_experts", "moe_first_dense") if getattr(args, k)]
        if not args.moe_renormalize:
            bad.append("model.moe_renormalize false")
        _refuse_mixtral(bad, _moved_bias(state or {}))
        return "mixtral"
    if args.n_experts < 2:
        raise HFError("an export of model.moe_score sigmoid is a Glm4MoeForCausalLM, which cannot express "
                      "model.n_experts 1 (its router ranks pairs of experts); train with 2 or more experts")
    return "glm4_moe"


def _moved_bias(state: dict[str, Tensor]) -> list[str]:
    """The layers (as '3') whose routing bias in state is nonzero."""
    return [k.split(".")[1] for k, v in state.items() if k.endswith("expert_bias") and bool(v.any())]


def _refuse_mixtral(settings: list[str], moved: list[str]) -> None:
    """Raise one HFError naming every setting (as 'model.moe_first_dense 1') and the moved bias (layers) that
    MixtralForCausalLM cannot express, with the remedy of each; nothing if both are empty."""
    if not settings and not moved:
        return
    bias = ("a routing bias, and the balancing bias (model.moe_bias_update_rate) moved in layer(s) "
            f"{', '.join(moved[:4])}") if moved else ""
    bias_fix = "--model.moe_bias_update_rate 0 (balance by --model.moe_aux_loss)"
    if settings and moved:
        what, fix = f"{', '.join(settings)}, or {bias}", f"export a run trained without them and with {bias_fix}"
    elif settings:
        what, fix = ", ".join(settings), "export a run trained without them"
    else:
        what, fix = bias, f"train with {bias_fix}"
    raise HFError(f"an export of model.moe_score softmax is a MixtralForCausalLM, which cannot express {what}; {fix}, "
                  f"or with --model.moe_score sigmoid (a Glm4MoeForCausalLM)")


def to_hf_tensors(state: dict[str, Tensor], kind: str) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of every tensor of state (our names) in architecture kind: a 3-D experts parameter
    becomes one 2-D tensor per expert; Mixtral's zero routing bias (see hf_model_type) is left out. GLM-4.5
    always has shared experts: without ours, its MoE layers get them of width 0 (empty tensors, output 0)."""
    for k, v in state.items():
        if kind == "mixtral" and k.endswith("expert_bias"):
            continue
        name = to_hf_name(k, kind)
        if "*" in name:
            yield from ((name.replace("*", str(e)), v[e]) for e in range(v.shape[0]))
        else:
            yield name, v
        shared = k.replace("router.weight", "shared_experts.w1.weight")
        if kind == "glm4_moe" and k.endswith("feed_forward.router.weight") and shared not in state:
            dim = v.shape[1]
            for ours, shape in (("w1", (0, dim)), ("w3", (0, dim)), ("w2", (dim, 0))):
                yield to_hf_name(shared.replace("w1", ours), kind), v.new_zeros(shape)


def to_hf_config(args: ModelArgs, bos_id: int, eos_id: int, pad_id: int | None, dtype: torch.dtype) -> dict:
    """config.json of the class hf_model_type(args) names, for a model of shape args.

    rope_theta is written both at top level (transformers 4.x) and in rope_parameters (5.x).
    """
    kind = hf_model_type(args)
    dtype_name = str(dtype).removeprefix("torch.")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    cfg = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": rope,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "torch_dtype": dtype_name, "dtype": dtype_name,
    }
    if kind == "mixtral":
        del cfg["mlp_bias"]
        cfg.update(intermediate_size=args.expert_hidden, num_local_experts=args.n_experts,
                   num_experts_per_tok=args.experts_per_token, sliding_window=None, router_jitter_noise=0.0,
                   output_router_logits=False)
    elif kind == "glm4_moe":
        del cfg["mlp_bias"]
        rope["partial_rotary_factor"] = 1.0  # GLM-4.5 rotates half of each head; ours all of it
        cfg.update(partial_rotary_factor=1.0, moe_intermediate_size=args.expert_hidden,
                   n_routed_experts=args.n_experts, num_experts_per_tok=args.experts_per_token,
                   n_shared_experts=args.n_shared_experts, first_k_dense_replace=args.moe_first_dense,
                   norm_topk_prob=args.moe_renormalize, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                   use_qk_norm=False, num_nextn_predict_layers=0, output_router_logits=False)
    return cfg


_MOE_INTS = {"llama": (), "mixtral": ("num_local_experts", "num_experts_per_tok"),
             "glm4_moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")}


def args_from_hf_config(cfg: dict, where: str) -> ModelArgs:
    """ModelArgs from a parsed config.json of a Llama, a Mixtral or a GLM-4.5 MoE (see ARCHITECTURES); raises
    HFError if it is another model, or uses a setting model.py does not compute exactly."""
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise HFError(f"'{where}' describes a '{kind}' model, not 'llama' (or the MoE 'mixtral' or 'glm4_moe')")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    ints = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
            "max_position_embeddings", *_MOE_INTS[kind])
    bad = [f"{k}={cfg[k]!r}" for k in (*ints, "num_key_value_heads") if k in cfg and cfg[k] is not None
           and (not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] <= 0)]
    if bad or not isinstance(rope, dict):
        raise HFError(f"'{where}': {', '.join(bad) or 'rope_parameters is not an object'}; "
                      f"sizes must be positive integers")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    same = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "sliding_window": None,
            "use_qk_norm": False, "routed_scaling_factor": 1.0}
    unsupported = [f"{k}={cfg.get(k)!r}" for k, ok in same.items() if cfg.get(k, ok) != ok]
    if rope_type != "default":
        unsupported.append(f"rope_type={rope_type!r}")
    if kind == "glm4_moe":  # transformers' default when absent is 0.5
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        if partial != 1.0:
            unsupported.append(f"partial_rotary_factor={partial!r}")
        if cfg.get("topk_group", 1) < cfg.get("n_group", 1):
            unsupported.append(f"topk_group={cfg.get('topk_group')!r} < n_group={cfg.get('n_group')!r}")
    if unsupported:
        raise HFError(f"'{where}' uses {', '.join(unsupported)}, which model.py does not implement")
    try:
        heads = cfg["num_attention_heads"]
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
            raise HFError(f"'{where}': head_dim {cfg['head_dim']} != hidden_size / num_attention_heads; not supported")
        moe = {}
        if kind == "mixtral":
            moe = dict(n_experts=cfg["num_local_experts"], experts_per_token=cfg["num_experts_per_tok"],
                       expert_ffn_dim=cfg["intermediate_size"], moe_score="softmax")
        elif kind == "glm4_moe":
            moe = dict(n_experts=cfg["n_routed_experts"], experts_per_token=cfg["num_experts_per_tok"],
                       expert_ffn_dim=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts", 1),
                       moe_score="sigmoid", moe_renormalize=bool(cfg.get("norm_topk_prob", True)),
                       moe_first_dense=cfg.get("first_k_dense_replace", 1))
        return ModelArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
                         n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                         ffn_dim=cfg["intermediate_size"], max_seq_len=cfg["max_position_embeddings"],
                         norm_eps=cfg["rms_norm_eps"],
                         rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)), **moe)
    except KeyError as e:
        raise HFError(f"'{where}' lacks the field {e}") from e
    except HFError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise HFError(f"'{where}': {e}") from e
