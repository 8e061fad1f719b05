"""The tokenizer: train a byte-level BPE on the corpus (Hugging Face ``tokenizers``), or load one.

Special tokens get ids 0, 1, 2: ``[PAD]``, ``[BOT]``, ``[EOT]``. The packer puts the document
separator after every document: ``[EOT]`` for ours, or any Hugging Face tokenizer's own EOS
(``separator_ids``: ``data.eos_token``, else ``tokenizer_config.json``'s ``eos_token`` beside the
``tokenizer.json``, else ``[EOT]``), with ``data.bos_token`` before each document. Text always encodes
as plain text (``encode_plain``): ``tokenizers`` would otherwise match the literal string
"[EOT]" inside a document as the special token, even with ``add_special_tokens=False``, and
make a false document boundary.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

from data import DataError

SPECIAL_TOKENS = ("[PAD]", "[BOT]", "[EOT]")
EOT = "[EOT]"


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_chars: int):
    """Train a byte-level BPE tokenizer (HF `tokenizers`) with the special tokens [PAD] [BOT] [EOT].

    Byte-level: every string encodes, and decode(encode(s)) == s. Special tokens get ids
    0, 1, 2. Raises DataError if vocab_size is too small for the byte alphabet.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise DataError(f"data.tokenizer_vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)

    def limited() -> Iterator[str]:
        seen = 0
        for t in texts:
            if seen >= max_chars:
                return
            seen += len(t)
            yield t

    tok.train_from_iterator(limited(), trainer=trainer)
    return tok


def encode_plain(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, as plain text: special-token strings in it ("[EOT]") get ordinary ids.

    The one encoder of document text (preparation, evaluation on another source, generation
    prompts): sets tok.encode_special_tokens (the tokenizers >= 0.15 switch) and adds no
    special token. Returns one list of ints per text.
    """
    tok.encode_special_tokens = True
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def load_tokenizer(path: str):
    """Load any Hugging Face tokenizer.json; raises DataError naming the file if it is missing or unreadable."""
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        raise DataError(f"data.tokenizer: '{path}' is a folder; give the tokenizer.json file in it")
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer: file '{path}' not found; give a tokenizer.json or leave it empty to train one")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"data.tokenizer: cannot read '{path}': {e}") from e
    return tok


TOKENIZER_CONFIG = "tokenizer_config.json"
"""Hugging Face's file beside tokenizer.json that names the special tokens (eos_token, bos_token)."""


def _tokenizer_config(path: str) -> dict:
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), TOKENIZER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def configured_token(path: str, key: str) -> str:
    """tokenizer_config.json's key (eos_token or bos_token) beside the tokenizer.json at path, or ''."""
    value = _tokenizer_config(path).get(key) or ""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def eos_name(path: str, tok, eos_token: str = "") -> str:
    """The document separator's string: eos_token (data.eos_token) when given, else tokenizer_config.json's eos_token
    beside path, else [EOT] when the tokenizer has it. Raises DataError asking for --data.eos_token otherwise."""
    name = eos_token or configured_token(path, "eos_token") or (EOT if tok.token_to_id(EOT) is not None else "")
    if not name:
        raise DataError(f"data.tokenizer: '{path}' has no {EOT} and no {TOKENIZER_CONFIG} beside it naming its "
                        f"eos_token; give the document separator with --data.eos_token (e.g. '<|end_of_text|>')")
    return name


def separator_ids(path: str, eos_token: str = "", bos_token: str = "", tok=None) -> tuple[int, int | None]:
    """(EOS id put after every document, BOS id put before each or None) of the tokenizer.json at path.

    eos_token/bos_token: data.eos_token and data.bos_token (empty: the tokenizer's own EOS, and its
    bos_token where its tokenizer_config.json says add_bos_token true, as a run's own copy does
    when data.bos_token was set, else no BOS). Raises DataError naming the field when a token is
    not in the vocabulary.
    """
    tok = tok or load_tokenizer(path)
    if not bos_token and _tokenizer_config(path).get("add_bos_token") is True:  # a run's own file says it put one
        bos_token = configured_token(path, "bos_token")
    ids = []
    for field, name in (("data.eos_token", eos_name(path, tok, eos_token)), ("data.bos_token", bos_token)):
        i = tok.token_to_id(name) if name else None
        if name and i is None:
            special = [t.content for t in tok.get_added_tokens_decoder().values()][:4]
            raise DataError(f"{field}: '{path}' has no token {name!r}; give one of its special tokens "
                            f"(e.g. {', '.join(map(repr, special)) or 'none: it has none'})")
        ids.append(i)
    return ids[0], ids[1]



def same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer.json files encode alike: their canonical serialisations (vocabulary, merges,
    normalizer, pre-tokenizer, special tokens) are equal, whatever their paths or JSON formatting.

    Raises DataError naming a file that is missing or unreadable (as load_tokenizer).
    """
    return a == b or load_tokenizer(a).to_str() == load_tokenizer(b).to_str()


def write_tokenizer_config(cfg, work: str) -> None:
    """prepare.py: the run's tokenizer_config.json (Hugging Face's file) in folder work: the one beside
    data.tokenizer, with data.eos_token and data.bos_token (cfg: the DataConfig) written in when set, so
    evaluation, generation and export find the run's separator beside the run's tokenizer.json
    (separator_ids). None for a tokenizer whose defaults are the run's ([EOT], no tokenizer_config.json)."""
    # read as separator_ids reads it (unreadable: none), so the run keeps the separator it was checked with
    config = _tokenizer_config(cfg.tokenizer) if cfg.tokenizer else {}
    if not (config or cfg.eos_token or cfg.bos_token):
        return
    config.update({k: getattr(cfg, k) for k in ("eos_token", "bos_token") if getattr(cfg, k)})
    config["add_bos_token"] = bool(cfg.bos_token)  # what this run put before every document (separator_ids)
    with open(os.path.join(work, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
