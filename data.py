"""The reading side of the data: packed token windows and the global-cursor batch loader.

A run's data directory (written by prepare.py) holds one flat token stream, ``tokens.bin``:
every document followed by one ``[EOT]``. It is cut into windows of ``seq_len + 1`` tokens
at stride ``seq_len`` (inputs ``w[:-1]``, labels ``w[1:]``), so no padding is ever trained
on and every token after the first is a target exactly once per epoch; only the stream's
last partial window is left out. The last ``val_fraction`` of the windows is held out.

Determinism across world sizes: the loader keeps one global sample cursor. The global
batch of step k is samples ``[k*B, (k+1)*B)`` of the epoch's seeded permutation, whatever
the world size; data-parallel rank r takes the r-th contiguous slice. The cursor is the
only state a checkpoint needs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Literal

import numpy as np
import torch

from errors import ConfigError, UserError


class DataError(UserError):
    """Bad data input: the message names the field or file and the fix."""


@dataclasses.dataclass
class DataConfig:
    dataset: str = "stdlib"
    """'stdlib' (offline: this Python's standard-library sources), a local file, folder or glob (.txt, .jsonl/.json, .parquet), or a Hugging Face hub id."""
    dataset_config: str = ""
    """Hub dataset configuration name, e.g. 'sample-10BT' for HuggingFaceFW/fineweb."""
    split: str = "train"
    """Split of a hub dataset to read."""
    text_column: str = "text"
    """Column that holds the document text (jsonl/parquet/hub sources)."""
    max_documents: int = 0
    """Read at most this many documents (0: all)."""
    decode_errors: Literal["strict", "replace"] = "strict"
    """Undecodable bytes in .txt files: 'strict' stops with the file and byte offset, 'replace' substitutes U+FFFD."""
    tokenizer: str = ""
    """Path to a tokenizer.json; empty: train a byte-level BPE on the corpus into the run directory."""
    tokenizer_vocab_size: int = 4096
    """Vocabulary size when a tokenizer is trained here (special tokens included)."""
    tokenizer_train_chars: int = 20_000_000
    """Characters of the corpus used to train a tokenizer."""
    seq_len: int = 512
    """Tokens per training sequence (the model sees seq_len inputs and predicts seq_len labels)."""
    val_fraction: float = 0.01
    """Fraction of the packed sequences held out for validation (taken from the end of the stream)."""


    def __post_init__(self) -> None:
        if not self.dataset:
            raise ConfigError("data.dataset is empty; give 'stdlib', a local file, folder or glob, or a hub id")
        if self.tokenizer_vocab_size < 259:  # the 256 byte-level symbols and the 3 special tokens
            raise ConfigError(f"data.tokenizer_vocab_size must be >= 259, got {self.tokenizer_vocab_size}")
        if self.tokenizer_train_chars <= 0:
            raise ConfigError(f"data.tokenizer_train_chars must be > 0, got {self.tokenizer_train_chars}")
        if not self.text_column:
            raise ConfigError("data.text_column is empty; name the column that holds the text (e.g. 'text')")
        if self.max_documents < 0:
            raise ConfigError(f"data.max_documents must be >= 0, got {self.max_documents}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len that fit in n_tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    """Window index of the stream: tokens[index*seq_len : index*seq_len + seq_len + 1]."""
    start = index * seq_len
    return tokens[start:start + seq_len + 1]



def inputs_labels(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of windows (batch, seq_len + 1): w[:, :-1] and w[:, 1:], each (batch, seq_len), contiguous."""
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


META_KEYS = ("tokenizer", "vocab_size", "n_tokens", "n_documents", "config")


def read_meta(out_dir: str) -> dict:
    """A prepared data directory's meta.json; raises DataError naming the file when it is unreadable or incomplete."""
    path = os.path.join(out_dir, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
        raise DataError(f"'{path}' cannot be read ({type(e).__name__}); the data directory is damaged: move "
                        f"'{out_dir}' away and run again to prepare it anew") from None
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if missing:
        raise DataError(f"'{path}' lacks {', '.join(missing)}; the data directory is damaged: move '{out_dir}' away "
                        f"and run again to prepare it anew")
    return meta


class PackedCorpus:
    """The prepared token stream, memory-mapped, split into train and validation windows."""

    def __init__(self, out_dir: str, cfg: DataConfig):
        """Map out_dir's tokens.bin; raises DataError when it does not hold the tokens meta.json counts."""
        self.meta = read_meta(out_dir)
        self.seq_len = cfg.seq_len
        path = os.path.join(out_dir, "tokens.bin")
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        if size != 4 * self.meta["n_tokens"] or size == 0:
            raise DataError(f"'{path}' holds {max(size, 0)} bytes, not the {self.meta['n_tokens']} uint32 tokens "
                            f"meta.json counts; the data directory is damaged: move '{out_dir}' away and run again "
                            f"to prepare it anew")
        self.tokens = np.memmap(path, dtype=np.uint32, mode="r")
        n = num_windows(self.tokens.size, cfg.seq_len)
        self.n_val = int(n * cfg.val_fraction) if cfg.val_fraction > 0 else 0
        if cfg.val_fraction > 0 and n >= 2:
            self.n_val = max(1, self.n_val)
        self.n_train = n - self.n_val

    def sample(self, index: int) -> np.ndarray:
        """Window index of the stream (train: 0 <= index < n_train; validation after it) as int64, seq_len + 1 tokens."""
        return window(self.tokens, index, self.seq_len).astype(np.int64)

    def batches(self, indices, micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows at stream indices, in order, as [(inputs, labels)] of (<= micro_batch_size, seq_len) int64 each."""
        indices = list(indices)
        return [inputs_labels(torch.from_numpy(np.stack([self.sample(i) for i in indices[k:k + micro_batch_size]])))
                for k in range(0, len(indices), micro_batch_size)]


# ---------------------------------------------------------------- the loader

@dataclasses.dataclass
class DataState:
    """Loader position, global and world-size independent: samples consumed since the start."""

    consumed_samples: int = 0


class GlobalBatchLoader:
    """Yields this rank's micro-batches of each global step from a global sample cursor.

    Global batch k = samples [k*B, (k+1)*B) of the concatenated per-epoch permutations
    (epoch e's permutation is torch.randperm(n_train) seeded with seed + e). Rank r of
    dp_size takes the contiguous slice [r*B/dp, (r+1)*B/dp) and splits it into
    micro-batches of micro_batch_size.
    """

    def __init__(self, corpus: PackedCorpus, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, state: DataState | None = None):
        if global_batch_size % (dp_size * micro_batch_size):
            raise DataError(
                f"train.global_batch_size ({global_batch_size}) must be divisible by data-parallel size "
                f"({dp_size}) x train.micro_batch_size ({micro_batch_size})"
            )
        if corpus.n_train < global_batch_size:
            raise DataError(
                f"data.dataset: only {corpus.n_train} training sequences of {corpus.seq_len} tokens, fewer than "
                f"train.global_batch_size ({global_batch_size}); use more text, a shorter data.seq_len or a smaller batch"
            )
        self.corpus = corpus
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.state = state or DataState()
        self._perm_epoch, self._perm = -1, None

    def _index(self, g: int) -> int:
        epoch, i = divmod(g, self.corpus.n_train)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.corpus.n_train, generator=gen).numpy()
            self._perm_epoch = epoch
        return int(self._perm[i])

    def rank_indices(self) -> list[int]:
        """Corpus indices of this rank's slice of the next global batch (the cursor does not move)."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.state.consumed_samples + self.dp_rank * per_rank
        return [self._index(g) for g in range(start, start + per_rank)]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches [(inputs, labels)] of the next global step, each (mb, seq_len) int64.

        Advances the global cursor by global_batch_size.
        """
        idx = self.rank_indices()
        self.state.consumed_samples += self.global_batch_size
        return self.corpus.batches(idx, self.micro_batch_size)

    @property
    def epoch(self) -> int:
        return self.state.consumed_samples // self.corpus.n_train


def val_batches(corpus: PackedCorpus, max_sequences: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """This rank's share of the first validation windows, as [(inputs, labels)] of (mb, seq_len) int64.

    Uses the largest multiple of dp_size * micro_batch_size windows that is <= both
    max_sequences and the held-out count, so every rank runs the same number of forward
    passes (FSDP gathers parameters collectively in each). Empty when there are too few.
    """
    per_round = dp_size * micro_batch_size
    total = min(corpus.n_val, max_sequences) // per_round * per_round
    per_rank = total // dp_size
    start = corpus.n_train + dp_rank * per_rank
    return corpus.batches(range(start, start + per_rank), micro_batch_size)
