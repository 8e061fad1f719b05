"""The one adapter between this project's model and Hugging Face's: ``LlamaForCausalLM``, and for a mixture of
experts ``MixtralForCausalLM`` (softmax routing) or ``Glm4MoeForCausalLM`` (sigmoid routing, the default).

    python hf.py export --run_dir DIR --out HF_DIR [--checkpoint CKPT] [--dtype bfloat16] [--max_shard_size 5GB]

Export reads a DCP checkpoint (saved at any world size or layout) without a process group
and writes a folder that ``transformers`` loads offline: config.json, model.safetensors
(or shards + model.safetensors.index.json), generation_config.json, tokenizer.json,
tokenizer_config.json and special_tokens_map.json. Import (``load_hf_into``) fills a model,
whole or FSDP/TP/EP-sharded, from such a folder or any such checkpoint in safetensors.

The math needs no conversion, only names (an export must never silently change the math):
- RoPE: model.py already uses Hugging Face's "rotate half" layout, so q/k rows are copied
  as they are (Meta's original checkpoints need a permutation; these do not).
- RMSNorm: both normalise in fp32, cast back, then multiply by the weight; eps is copied.
- Embeddings are untied (tie_word_embeddings false); no biases anywhere.
- mup/completep multipliers (query, residual branches, logits) are folded into wq, wo/w2 (the
  experts' and shared experts' w2 too) and output on export and divided back out on import
  (nn/parametrization.fold).
- MoE: our 3-D experts parameters are written one 2-D tensor per expert, as the models on the
  Hub are; the router is the gate, the aux-loss-free balancing bias GLM-4.5's
  e_score_correction_bias (a choice that no class expresses exactly is refused: hf_model_type).
- Special tokens: the training stream puts [EOT] after every document and never uses
  [BOT], so [EOT] is what precedes a document. As in GPT-2, it is both bos and eos;
  [PAD] is pad. No token is added automatically when encoding (same ids as prepare.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
from typing import Callable, Iterator

import torch
from torch import Tensor

from checkpoint import read_model_weights
from config import load_run
from core.cli import ArgumentParser
from core.errors import UserError, one_line, report, require
from data_pipeline.tokenizer import EOT, load_tokenizer
from model import ModelArgs, Transformer
from nn import parametrization

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
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


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


def hf_model_type(args: ModelArgs) -> str:
    """The architecture (a key of ARCHITECTURES) that computes exactly a model of shape args.

    Raises HFError, naming what that class cannot express and the settings that export, for softmax routing
    with shared experts, dense first layers or raw (not renormalised) weights (Mixtral has none of these), and
    for sigmoid routing over a single expert (GLM-4.5's router takes the top 2 scores of its group).
    """
    if not args.n_experts:
        return "llama"
    if args.moe_score == "softmax":
        bad = [f"model.{k} {getattr(args, k)}" for k in ("n_shared_experts", "moe_first_dense") if getattr(args, k)]
        if not args.moe_renormalize:
            bad.append("model.moe_renormalize false")
        if bad:
            raise HFError(f"an export of model.moe_score softmax is a MixtralForCausalLM, which cannot express "
                          f"{', '.join(bad)}; export a run trained without them, or with --model.moe_score sigmoid "
                          f"(a Glm4MoeForCausalLM)")
        return "mixtral"
    if args.n_experts < 2:
        raise HFError("an export of model.moe_score sigmoid is a Glm4MoeForCausalLM, which cannot express "
                      "model.n_experts 1 (its router ranks pairs of experts); train with 2 or more experts")
    return "glm4_moe"


def check_no_bias(state: dict[str, Tensor]) -> None:
    """Raise HFError when a softmax MoE's routing bias (the aux-loss-free balancing) is nonzero: Mixtral has none."""
    moved = [k.split(".")[1] for k, v in state.items() if k.endswith("expert_bias") and bool(v.any())]
    if moved:
        raise HFError(f"an export of model.moe_score softmax is a MixtralForCausalLM, which cannot express a routing "
                      f"bias, and the balancing bias (model.moe_bias_update_rate) moved in layer(s) "
                      f"{', '.join(moved[:4])}; train with --model.moe_bias_update_rate 0 (balance by "
                      f"--model.moe_aux_loss), or with --model.moe_score sigmoid (a Glm4MoeForCausalLM)")


def to_hf_tensors(state: dict[str, Tensor], kind: str) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of every tensor of state (our names) in architecture kind: a 3-D experts parameter
    becomes one 2-D tensor per expert; Mixtral's zero routing bias (see check_no_bias) is left out. GLM-4.5
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


# ---------------------------------------------------------------- export

def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000; raises HFError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise HFError(f"--max_shard_size: cannot read '{text}'; use e.g. 5GB, 500MB or a byte count")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise HFError(f"--max_shard_size: '{text}' is less than one byte; use e.g. 5GB")
    return size


def _shards(tensors: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > max_bytes:  # a tensor larger than the limit gets a shard of its own
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    return shards + [current] if current else shards


def save_hf(state: dict[str, Tensor], args: ModelArgs, tokenizer_path: str, out_dir: str,
            dtype: torch.dtype = torch.float32, max_shard_size: int = 5 * 10**9) -> None:
    """Write state (our names -> full tensors, with the MoE's expert_bias buffers) as a Hugging Face folder out_dir.

    The class is hf_model_type(args): LlamaForCausalLM, or for a mixture of experts MixtralForCausalLM (softmax
    routing) or Glm4MoeForCausalLM (sigmoid routing). Under args.parametrization mup/completep the multipliers
    are folded into the weights (nn/parametrization.fold), so the plain class computes the model's logits.
    Tensors are cast to dtype (float32 or bfloat16; the routing bias stays float32) and sharded above
    max_shard_size bytes. The folder is written beside out_dir and renamed into place, so a crash leaves no
    half folder. Raises HFError if out_dir holds files, state has another shape than args, the class cannot
    express the model (hf_model_type, check_no_bias), or the tokenizer lacks [EOT] or does not fit
    args.vocab_size; MissingPackageError without safetensors (the hf extra).
    """
    require("safetensors", "hf", "writing a Hugging Face folder")
    from safetensors.torch import save_file

    check_out(out_dir)
    with torch.device("meta"):  # shapes only, no memory
        want = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise HFError("weights do not match the model config: "
                      + "; ".join(f"{k}: {got.get(k)} vs config {want.get(k)}" for k in bad[:6]))
    kind = hf_model_type(args)
    if kind == "mixtral":
        check_no_bias(state)
    tok = load_tokenizer(tokenizer_path)
    eot, pad = tok.token_to_id(EOT), tok.token_to_id("[PAD]")
    if tok.get_vocab_size() > args.vocab_size:
        raise HFError(f"tokenizer '{tokenizer_path}' has {tok.get_vocab_size()} tokens > vocab_size {args.vocab_size}")

    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    except OSError as e:
        raise HFError(f"--out '{out_dir}': cannot create a folder in '{parent}' ({e.strerror}); "
                      f"choose a writable location") from e
    try:
        folded = parametrization.fold(args, state)  # the HF classes have no multipliers: the same function
        tensors = {k: v.detach().to("cpu", torch.float32 if k.endswith("correction_bias") else dtype).contiguous()
                   for k, v in to_hf_tensors(folded, kind)}
        shards = _shards(tensors, max_shard_size)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            _write_json(tmp, "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                              "weight_map": weight_map})
        _write_json(tmp, "config.json", to_hf_config(args, eot, eot, pad, dtype))
        _write_json(tmp, "generation_config.json", {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": pad})
        # Byte-identical tokenizer: AutoTokenizer gives the ids prepare.py packed.
        shutil.copyfile(tokenizer_path, os.path.join(tmp, "tokenizer.json"))
        special = {"bos_token": "[EOT]", "eos_token": "[EOT]"}
        if pad is not None:
            special["pad_token"] = "[PAD]"
        _write_json(tmp, "special_tokens_map.json", special)
        _write_json(tmp, "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": args.max_seq_len,
            # No automatic specials and no space clean-up: decode(encode(s)) == s, as in prepare.py.
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False})
        _publish_permissions(tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_out(out_dir: str) -> None:
    """Raise HFError unless out_dir is free for an export: a local path, absent or an empty folder (nothing is
    overwritten)."""
    if "://" in out_dir or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", out_dir):  # else a local folder 's3:' is made
        raise HFError(f"--out '{out_dir}' is a URL; export to a local folder, then copy it to the store")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise HFError(f"--out '{out_dir}' is a file, not a folder; choose a folder path that does not exist")
    try:
        taken = os.path.isdir(out_dir) and bool(os.listdir(out_dir))
    except OSError as e:
        raise HFError(f"--out '{out_dir}': cannot list it ({e.strerror}); choose another folder") from e
    if taken:
        raise HFError(f"--out '{out_dir}' exists and is not empty; remove it or choose another folder")


def _publish_permissions(folder: str) -> None:
    """mkdtemp makes a private folder and safetensors private files; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _write_json(folder: str, name: str, obj: dict) -> None:
    with open(os.path.join(folder, name), "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def export_checkpoint(run_dir: str, out_dir: str, checkpoint: str = "", dtype: torch.dtype = torch.float32,
                      max_shard_size: int = 5 * 10**9) -> str:
    """Export a run's checkpoint (newest complete one unless given) to out_dir; returns the checkpoint used.

    Holds the full model in fp32 in CPU memory. Raises CheckpointError or HFError (see load_run, save_hf;
    a mixture of experts that no transformers class computes exactly is named before the weights are read),
    MissingPackageError without safetensors (the hf extra).
    """
    require("safetensors", "hf", "hf.py export")  # before reading a large checkpoint
    check_out(out_dir)
    cfg, path, tokenizer = load_run(run_dir, checkpoint)
    try:
        kind = hf_model_type(cfg.model)
        with torch.device("meta"):
            shapes = Transformer(cfg.model).state_dict()
        state = {k: torch.empty(v.shape) for k, v in shapes.items()}
        read_model_weights(path, state)
        if kind == "mixtral":
            check_no_bias(state)
    except HFError as e:
        raise HFError(f"'{run_dir}': {e}") from None
    save_hf(state, cfg.model, tokenizer, out_dir, dtype, max_shard_size)
    return path


# ---------------------------------------------------------------- import

def read_hf_folder(folder: str) -> tuple[ModelArgs, dict[str, str]]:
    """(ModelArgs, {HF tensor name: safetensors file}) of a Hugging Face Llama folder.

    Raises HFError if folder is missing, has no config.json, is not a supported Llama, or
    has no safetensors weights; MissingPackageError without safetensors (the hf extra).
    """
    require("safetensors", "hf", "reading a Hugging Face folder")
    if not os.path.isdir(folder):
        raise HFError(f"'{folder}' is not a directory; give a Hugging Face Llama model folder")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFError(f"'{folder}' is not a Hugging Face model folder (no config.json)")
    args = args_from_hf_config(_read_json(cfg_path), cfg_path)
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(f"'{index}' has no weight_map of tensor name -> file name")
        files = {k: os.path.join(folder, v) for k, v in weight_map.items()}
    elif os.path.isfile(single):
        with _open_safetensors(single) as f:
            files = dict.fromkeys(f.keys(), single)
    else:
        raise HFError(f"'{folder}' has no model.safetensors or model.safetensors.index.json "
                      f"(only safetensors weights are read)")
    return args, files


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise HFError(f"cannot read '{path}': {one_line(e)}") from e
    if not isinstance(obj, dict):
        raise HFError(f"'{path}' holds a JSON {type(obj).__name__}, not an object")
    return obj


def _open_safetensors(path: str):
    """safe_open(path) for reading tensors; HFError for a missing, truncated or corrupt file."""
    safetensors = require("safetensors", "hf", "reading a Hugging Face folder")
    SafetensorError, safe_open = safetensors.SafetensorError, safetensors.safe_open

    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError) as e:
        raise HFError(f"cannot read weights '{path}': {one_line(e)}; export or download the folder again") from e


_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta")
_MOE_FIELDS = ("n_experts", "experts_per_token", "expert_hidden", "n_shared_experts", "moe_score", "moe_renormalize",
               "moe_first_dense")


def check_args(folder: str, args: ModelArgs) -> None:
    """Raise HFError naming every field of args that differs from folder's config.json.

    max_seq_len may differ: it only sets the RoPE table length, not a weight; so may the MoE's
    training options (balancing coefficients and bias rate). ffn_dim counts only where a layer is dense.
    """
    hf_args, _ = read_hf_folder(folder)
    moe = bool(hf_args.n_experts)
    fields = _SHAPE_FIELDS + (_MOE_FIELDS if moe else ())
    if not moe or args.moe_first_dense or hf_args.moe_first_dense:
        fields += ("ffn_dim",)

    def differs(k):
        a, b = getattr(hf_args, k), getattr(args, k)
        return a != b if isinstance(a, (str, bool)) else not math.isclose(a, b, rel_tol=1e-9)

    def flag(value):
        return str(value).lower() if isinstance(value, bool) else value

    diff = [f"--model.{'expert_ffn_dim' if k == 'expert_hidden' else k} {flag(getattr(hf_args, k))} (config has "
            f"{flag(getattr(args, k))})" for k in fields if differs(k)]
    if args.n_experts and not moe:
        raise HFError(f"'{folder}' is a dense Llama, and this run's model.n_experts is {args.n_experts}; drop "
                      f"--model.n_experts and the other expert options" + (f", and set {', '.join(diff)}" if diff else ""))
    if diff:
        raise HFError(f"'{folder}' is another model shape; set {', '.join(diff)}")


def iter_hf_tensors(folder: str) -> Iterator[tuple[str, Tensor]]:
    """(our name, tensor) for every weight of an HF Llama, Mixtral or GLM-4.5 MoE folder.

    One tensor in memory at a time, except a layer's per-expert tensors, which are stacked into
    our 3-D experts parameter (n_experts, ...) once all have been read. A folder without
    lm_head.weight (tied embeddings) yields the embedding again as output.weight: this model
    keeps them untied. A Mixtral's MoE layers yield a zero expert_bias (it routes without one);
    GLM-4.5's multi-token-prediction layers (past num_hidden_layers) are left out. Raises HFError
    for a tensor outside the mapping, or an experts parameter that lacks some expert.
    """
    args, files = read_hf_folder(folder)
    kind = hf_model_type(args)
    pending: dict[str, dict[int, Tensor]] = {}
    for path in sorted(set(files.values())):
        with _open_safetensors(path) as f:
            for name in f.keys():
                if _IGNORED.match(name):
                    continue
                m = re.match(r"model\.layers\.(\d+)\.", name)
                if kind == "glm4_moe" and m and int(m.group(1)) >= args.n_layers:
                    continue
                ours, expert = from_hf_name(name, kind)
                if ".shared_experts." in ours and not args.n_shared_experts and 0 in f.get_slice(name).get_shape():
                    continue  # GLM-4.5's shared experts of width 0 (to_hf_tensors)
                if expert is None:
                    yield ours, f.get_tensor(name)
                else:
                    rows = pending.setdefault(ours, {})
                    rows[expert] = f.get_tensor(name)
                    if len(rows) == args.n_experts and set(rows) == set(range(args.n_experts)):
                        yield ours, torch.stack([rows[e] for e in range(args.n_experts)])
                        del pending[ours]
                if ours == "tok_embeddings.weight" and "lm_head.weight" not in files:
                    yield "output.weight", f.get_tensor(name)
    if pending:
        ours, rows = next(iter(pending.items()))
        missing = sorted(set(range(args.n_experts)) - set(rows))
        raise HFError(f"'{folder}' lacks expert(s) {', '.join(map(str, missing[:4]))} of "
                      f"{to_hf_name(ours, kind)} (model.n_experts {args.n_experts})")
    if kind == "mixtral":
        for i in range(args.n_layers):
            yield f"layers.{i}.feed_forward.expert_bias", torch.zeros(args.n_experts)


@torch.no_grad()
def load_hf_into(model: Transformer, folder: str, copy_: Callable[[Tensor, Tensor], None] = Tensor.copy_) -> None:
    """Overwrite every parameter of model, and an MoE's routing bias, with the weights of the HF folder
    (continued pretraining).

    model may be whole or sharded (FSDP2/TP/EP DTensors): copy_(param, full) writes a full
    tensor into a parameter, e.g. parallelize.copy_sharded, which keeps only the local shard
    without communication. Weights are cast to each parameter's dtype; under mup/completep the
    multipliers are divided out of them (fold's inverse). Raises HFError if the
    config differs from model.args (see check_args), or a tensor is unknown, has another
    shape (naming the key) or is missing.
    """
    check_args(folder, model.args)
    kind = hf_model_type(model.args)
    params = {**dict(model.named_parameters()),
              **{k: v for k, v in model.named_buffers() if k.endswith("expert_bias")}}
    seen = set()
    for name, tensor in iter_hf_tensors(folder):
        if name not in params:
            raise HFError(f"'{folder}': tensor for '{name}' has no parameter in the model")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise HFError(f"'{folder}': {to_hf_name(name, kind)} has shape {tuple(tensor.shape)}, "
                          f"the model's {name} has {tuple(params[name].shape)}")
        # An HF model has no multipliers: under mup/completep they come back out of the weights, so the
        # model computes the folder's function (and a folded export gets its own weights back).
        tensor = parametrization.fold(model.args, {name: tensor}, inverse=True)[name]
        copy_(params[name], tensor.to(params[name].dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise HFError(f"'{folder}' lacks {len(missing)} weights, e.g. "
                      f"{', '.join(to_hf_name(k, kind) for k in missing[:3])}")


def tokenizer_path(folder: str) -> str:
    """The folder's tokenizer.json, for data.tokenizer when continuing pretraining; HFError if absent."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise HFError(f"'{folder}' has no tokenizer.json (a fast tokenizer is needed for data.tokenizer)")
    return path


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    """`python hf.py export ...`; bad input exits with status 2 and a one-line message."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a run's checkpoint -> a Hugging Face folder (Llama; an MoE as Mixtral or GLM-4.5 MoE)")
    e.add_argument("--run_dir", required=True, help="training run directory (config.toml, data/, checkpoints/)")
    e.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    e.add_argument("--checkpoint", default="",
                   help="checkpoint directory or URL (default: the run's newest complete one, in its checkpoint.dir)")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the saved weights")
    e.add_argument("--max_shard_size", default="5GB", help="split model.safetensors above this size (e.g. 2GB)")
    a = p.parse_args(argv)
    try:
        path = export_checkpoint(a.run_dir, a.out, a.checkpoint, getattr(torch, a.dtype), parse_size(a.max_shard_size))
    except UserError as err:
        report(err)
        return 2
    print(f"exported {path} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
