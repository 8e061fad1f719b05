"""The tokenizer: train a byte-level BPE on the corpus (Hugging Face ``tokenizers``), or load one.

Special tokens get ids 0, 1, 2: ``[PAD]``, ``[BOT]``, ``[EOT]``. The packer puts ``[EOT]``
after every document, so every tokenizer this project reads must have it. Text always encodes
as plain text (``encode_plain``): ``tokenizers`` would otherwise match the literal string
"[EOT]" inside a document as the special token, even with ``add_special_tokens=False``, and
make a false document boundary.
"""
from __future__ import annotations

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
    """Load a tokenizer.json; raises DataError naming the file if it is missing or lacks [EOT]."""
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        raise DataError(f"data.tokenizer: '{path}' is a folder; give the tokenizer.json file in it")
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer: file '{path}' not found; give a tokenizer.json or leave it empty to train one")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"data.tokenizer: cannot read '{path}': {e}") from e
    if tok.token_to_id(EOT) is None:
        raise DataError(f"data.tokenizer: '{path}' has no {EOT} token; the packer needs it as document separator")
    return tok



def same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer.json files encode alike: their canonical serialisations (vocabulary, merges,
    normalizer, pre-tokenizer, special tokens) are equal, whatever their paths or JSON formatting.

    Raises DataError naming a file that is missing or unreadable (as load_tokenizer).
    """
    return a == b or load_tokenizer(a).to_str() == load_tokenizer(b).to_str()
