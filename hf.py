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
- mup/completep multipliers (embedding, query, residual branches, logits) are folded into
  tok_embeddings, wq, wo/w2 (the experts' and shared experts' w2 too) and output on export and
  divided back out on import (nn/parametrization.fold).
- MoE: our 3-D experts parameters are written one 2-D tensor per expert, as the models on the
  Hub are; the router is the gate, the aux-loss-free balancing bias GLM-4.5's
  e_score_correction_bias (a choice that no class expresses exactly is refused: hf_model_type).
- Special tokens: the training stream puts [EOT] after every document and never uses
  [BOT], so [EOT] is what precedes a document. As in GPT-2, it is both bos and eos;
  [PAD] is pad. Another tokenizer's run (data.eos_token / data.bos_token, or its own
  tokenizer_config.json) exports its EOS as eos and its BOS, where it has one, as bos.
  No token is added automatically when encoding (same ids as prepare.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator

import torch
from torch import Tensor

from checkpoint import read_model_weights
from config import load_run
from core.cli import ArgumentParser, exit_command
from core.errors import UserError, one_line, report, require
from data_pipeline.tokenizer import configured_token, eos_name, load_tokenizer, separator_ids
from hf_format import (
    IGNORED,
    HFError,
    args_from_hf_config,
    from_hf_name,
    hf_model_type,
    to_hf_config,
    to_hf_name,
    to_hf_tensors,
)
from model import ModelArgs, Transformer
from nn import parametrization
from nn.moe_args import MOE_FIELDS, MOE_TRAINING_FIELDS
from nn.roles import roles

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
    express the model (hf_model_type), or the tokenizer has no separator (separator_ids) or does not fit
    args.vocab_size; MissingPackageError without safetensors (the hf extra).
    """
    require("safetensors", "hf", "writing a Hugging Face folder")
    from safetensors.torch import save_file

    check_out(out_dir)
    with torch.device("meta"):  # shapes only, no memory
        whole = Transformer(args)
    want = {k: tuple(v.shape) for k, v in whole.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise HFError("weights do not match the model config: "
                      + "; ".join(f"{k}: {got.get(k)} vs config {want.get(k)}" for k in bad[:6]))
    kind = hf_model_type(args, state)
    tok = load_tokenizer(tokenizer_path)
    try:  # the run's separator: [EOT] for ours, else its tokenizer_config.json's (data.eos_token, data.bos_token)
        eot, bos = separator_ids(tokenizer_path, tok=tok)
        eos_text = eos_name(tokenizer_path, tok)
    except UserError as e:
        raise HFError(str(e)) from None
    bos_text = configured_token(tokenizer_path, "bos_token") if bos is not None else eos_text
    bos = eot if bos is None else bos
    pad = tok.token_to_id("[PAD]")
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
        folded = parametrization.fold(args, state, roles(whole))  # the HF classes have no multipliers: the same function
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
        _write_json(tmp, "config.json", to_hf_config(args, bos, eot, pad, dtype))
        _write_json(tmp, "generation_config.json", {"bos_token_id": bos, "eos_token_id": eot, "pad_token_id": pad})
        # Byte-identical tokenizer: AutoTokenizer gives the ids prepare.py packed.
        shutil.copyfile(tokenizer_path, os.path.join(tmp, "tokenizer.json"))
        special = {"bos_token": bos_text, "eos_token": eos_text}
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
        with torch.device("meta"):
            shapes = Transformer(cfg.model).state_dict()
        # Whether Mixtral can express a softmax MoE depends on its routing bias as well as its config: read the bias
        # (a few floats a layer) first, so that one refusal names every reason before the weights are read.
        bias = {k: torch.empty(v.shape) for k, v in shapes.items()
                if k.endswith("expert_bias") and cfg.model.moe_score == "softmax"}
        if bias:
            read_model_weights(path, bias, model_shapes={k: v.shape for k, v in shapes.items()})
        hf_model_type(cfg.model, bias)
        state = {k: torch.empty(v.shape) for k, v in shapes.items()}
        read_model_weights(path, state)
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
# The MoE fields that shape the weights' function (training options may differ), expert_ffn_dim as the width it gives.
_MOE_FIELDS = ("n_experts",) + tuple("expert_hidden" if k == "expert_ffn_dim" else k for k in MOE_FIELDS
                                     if k not in MOE_TRAINING_FIELDS)


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
                if IGNORED.match(name):
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
    without communication. It may also be a pipeline rank's part (parallel/pipeline_stages.prune):
    then only its own stages' tensors are copied. Weights are cast to each parameter's dtype; under
    mup/completep the multipliers are divided out of them (fold's inverse). Raises HFError if the
    config differs from model.args (see check_args), or a tensor is unknown to the whole model, has
    another shape (naming the key) or is missing, whichever part of the model this rank holds.
    """
    check_args(folder, model.args)
    kind = hf_model_type(model.args)

    def weights(m: Transformer) -> dict[str, Tensor]:  # what a folder fills: the parameters and the routing bias
        return {**dict(m.named_parameters()), **{k: v for k, v in m.named_buffers() if k.endswith("expert_bias")}}

    # The folder is checked against the whole model's names and shapes, not this rank's: a pipeline stage lacks the
    # other stages' weights, which the folder must still hold (and nothing more), as at pp 1.
    with torch.device("meta"):
        whole = Transformer(model.args)
    want, role = {k: tuple(v.shape) for k, v in weights(whole).items()}, roles(whole)
    params = weights(model)
    seen = set()
    for name, tensor in iter_hf_tensors(folder):
        if name not in want:
            raise HFError(f"'{folder}': tensor for '{name}' has no parameter in the model")
        if tuple(tensor.shape) != want[name]:
            raise HFError(f"'{folder}': {to_hf_name(name, kind)} has shape {tuple(tensor.shape)}, "
                          f"the model's {name} has {want[name]}")
        seen.add(name)
        if name not in params:  # another pipeline stage's weight
            continue
        # An HF model has no multipliers: under mup/completep they come back out of the weights, so the
        # model computes the folder's function (and a folded export gets its own weights back).
        tensor = parametrization.fold(model.args, {name: tensor}, role, inverse=True)[name]
        copy_(params[name], tensor.to(params[name].dtype))
    missing = sorted(set(want) - seen)
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
    # No prefix matching (allow_abbrev): '--dtyp bfloat16' is a misspelling to name, not --dtype to guess.
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a run's checkpoint -> a Hugging Face folder (Llama; an MoE as Mixtral or GLM-4.5 MoE)",
                       allow_abbrev=False)
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
    exit_command(main())
