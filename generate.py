"""Sample text from a checkpoint (or an exported/imported Hugging Face Llama folder) with a KV cache.

    python generate.py --run_dir DIR [--checkpoint CKPT] --prompt "def main(" --max_new_tokens 200 \\
        --temperature 0.8 --top_k 50 --top_p 0.95 --seed 0 --num_samples 2
    python generate.py --hf HF_DIR --prompt "..."            # a folder written by `hf.py export`

Decoding runs the model's own forward (model.py's Transformer, the code training runs) with
a KV cache per layer and the position of the new tokens; the cached path is causal attention
over one document.
Prompts are prefixed with [EOT], the token that precedes every document in training.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import Tensor

import hf
from checkpoint import read_model_weights
from config import load_run
from core.cli import ArgumentParser, exit_command, number
from core.errors import UserError, report
from data_pipeline.tokenizer import encode_plain, load_tokenizer, separator_ids
from model import Transformer


def _last_logits(output: torch.nn.Module, h: Tensor) -> Tensor:
    """Transformer.forward's head for decoding: fp32 logits (batch, vocab) of the last position only."""
    return output(h[:, -1]).float()


def warp_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Sampling filters on fp32 logits (batch, vocab): divide by temperature (> 0), keep the top_k
    most likely tokens (0: all), then the smallest set whose probability reaches top_p (nucleus
    sampling, Holtzman et al. 2020; 1.0: all). Removed tokens get -inf; at least one stays.

    The same order and rules as transformers' Temperature, TopK and TopP logits warpers.
    """
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        # Ascending: drop the unlikely tail whose total probability stays within 1 - top_p.
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Tensor:
    """Next token ids (batch,) int64 from fp32 logits (batch, vocab); temperature 0 is greedy (argmax).

    Otherwise draws from softmax(warp_logits(...)) with generator. Raises ValueError for
    temperature < 0, top_k < 0 or top_p outside (0, 1].
    """
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = 0, stop_ids=()) -> list[int]:
    """Continue one prompt: prompt_ids (a non-empty sequence of ints) -> the new token ids (list of int).

    Decodes one token per step with a KV cache, stopping after max_new_tokens tokens or
    after a token in stop_ids (which is included). temperature 0 is greedy decoding; seed
    seeds the sampling generator (None: torch's global generator). Runs on the model's
    device and parameter dtype. Raises ValueError for an empty prompt, a token outside the
    vocabulary, or prompt + max_new_tokens longer than model.max_seq_len.
    """
    device = model.tok_embeddings.weight.device
    prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device).view(1, -1)
    vocab, limit = model.args.vocab_size, model.args.max_seq_len
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty; start from at least one token (e.g. [EOT])")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt_ids must be in [0, {vocab}), got {int(prompt.min())}..{int(prompt.max())}")
    if prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"model.max_seq_len {limit}; shorten one of them")
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    cache = model.kv_cache(1, prompt.shape[1] + max_new_tokens)
    stop = set(stop_ids)
    out: list[int] = []
    logits = model(prompt, _last_logits, cache)
    pos = prompt.shape[1]
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out.append(int(nxt))
        if out[-1] in stop or len(out) == max_new_tokens:
            break
        logits = model(nxt.view(1, 1), _last_logits, cache, pos)
        pos += 1
    return out


def load_model(run_dir: str, checkpoint: str = "") -> tuple[Transformer, str]:
    """The run's model in fp32 on CPU with the checkpoint's weights (newest unless given), and its tokenizer.json.

    Raises CheckpointError or ConfigError for a run directory or checkpoint that cannot be read.
    """
    cfg, path, tokenizer = load_run(run_dir, checkpoint)
    model = Transformer(cfg.model)
    sd = model.state_dict()
    read_model_weights(path, sd)
    model.load_state_dict(sd)
    return model.eval(), tokenizer


def _cast_parameters(model: Transformer, dtype: torch.dtype) -> None:
    # Parameters only: Module.to(dtype) would also round the fp32 RoPE tables.
    for p in model.parameters():
        p.data = p.data.to(dtype)


def device_arg(text: str) -> torch.device:
    """--device: a torch device string this machine has (cpu, cuda, cuda:N, mps); argparse errors otherwise."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"'{text}': no CUDA device is visible; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"'{text}': only {count} CUDA device(s) visible; "
                                             f"use cuda:0..cuda:{count - 1}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"'{text}': MPS is not available here; use --device cpu")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"'{text}': generation runs on cpu, cuda or mps")
    return device


def main(argv: list[str] | None = None) -> int:
    """Command line; bad input exits with status 2 and a one-line message."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="training run directory (its newest complete checkpoint unless --checkpoint)")
    src.add_argument("--hf", help="a Hugging Face Llama folder (safetensors + tokenizer.json with [EOT])")
    p.add_argument("--checkpoint", default="",
                   help="checkpoint directory or URL of the run (default: newest complete, in its checkpoint.dir)")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max_new_tokens", type=number(int, lambda v: v >= 1, "an int >= 1"), default=200)
    p.add_argument("--temperature", type=number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
                   default=0.8, help="0: greedy decoding")
    p.add_argument("--top_k", type=number(int, lambda v: v >= 0, "an int >= 0 (0: all)"), default=50,
                   help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=number(float, lambda v: 0 < v <= 1, "a number in (0, 1]"), default=0.95,
                   help="nucleus sampling threshold (1: off)")
    # torch.Generator takes seeds in [-2**63, 2**64); sample i uses seed + i.
    p.add_argument("--seed", type=number(int, lambda v: -2**63 <= v < 2**63, "a 64-bit int"), default=0)
    p.add_argument("--num_samples", type=number(int, lambda v: 1 <= v <= 2**20, "an int in 1..2**20"), default=1)
    p.add_argument("--device", type=device_arg, default="cpu", help="e.g. cpu, cuda or cuda:1")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = p.parse_args(argv)
    if a.hf and a.checkpoint:
        p.error("--checkpoint picks a checkpoint of --run_dir; with --hf leave it out")
    try:
        if a.hf:
            args, _ = hf.read_hf_folder(a.hf)
            model, tok_path = Transformer(args), hf.tokenizer_path(a.hf)
            hf.load_hf_into(model, a.hf)
        else:
            model, tok_path = load_model(a.run_dir, a.checkpoint)
        model.eval().to(a.device)
        _cast_parameters(model, getattr(torch, a.dtype))
        tok = load_tokenizer(tok_path)
        eot, bos = separator_ids(tok_path, tok=tok)  # the run's separator ([EOT] for ours; tokenizer_config.json)
        # A prompt from the command line may hold undecodable bytes (as lone surrogates): replace them.
        text = a.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        prompt = [eot if bos is None else bos] + encode_plain(tok, [text])[0]  # "[EOT]" typed in a prompt is text
        for i in range(a.num_samples):
            new = generate(model, prompt, a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed + i, (eot,))
            print(f"--- sample {i} (seed {a.seed + i})")
            # Decode prompt and continuation together: a character may span both (byte-level BPE).
            print(tok.decode(prompt + new, skip_special_tokens=True), flush=True)
    except UserError as e:
        report(e)
        return 2
    except ValueError as e:  # a prompt longer than the model takes
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_command(main())
