"""Text in, packed token sequences out: tokenizer, sources, packing, rank slicing, resume state.

Pipeline: documents (Hugging Face ``datasets``, read as a stream: a hub id, local
txt/jsonl/parquet files or globs, or the offline default ``stdlib``, the running
interpreter's standard-library sources) -> byte-level BPE ids (Hugging Face ``tokenizers``) -> one ``[EOT]`` after every
document -> one flat token stream -> windows of ``seq_len + 1`` tokens with stride
``seq_len`` (inputs ``w[:-1]``, labels ``w[1:]``), so no padding is ever trained on and
every token after the first is a target exactly once per epoch. Only the stream's last
partial window (fewer than ``seq_len`` tokens) is left out.

Determinism across world sizes: the loader keeps one global sample cursor. The global
batch of step k is samples ``[k*B, (k+1)*B)`` of the epoch's seeded permutation, whatever
the world size; data-parallel rank r takes the r-th contiguous slice. The cursor is the
only state a checkpoint needs.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import json
import os
import shutil
import sysconfig
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np
import torch

SPECIAL_TOKENS = ("[PAD]", "[BOT]", "[EOT]")  # the source document's special tokens
EOT = "[EOT]"


class DataError(ValueError):
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
    decode_errors: str = "strict"
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


# ---------------------------------------------------------------- sources

def stdlib_files() -> list[str]:
    """Sorted paths of this interpreter's standard-library .py files (no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def _local_files(spec: str) -> list[str]:
    if os.path.isdir(spec):
        files = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = sorted(glob.glob(spec, recursive=True))
    if not files:
        raise DataError(f"data.dataset: no file matches '{spec}'; give an existing file, folder or glob")
    return files


def _read_text(path: str, errors: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(
            f"data.dataset: '{path}' is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
            f"convert it, or pass --data.decode_errors replace"
        ) from None


def check_source(cfg: DataConfig) -> None:
    """Cheap checks of the data config that need no reading of documents (run on every rank, early).

    Raises DataError for a local path or glob that matches nothing, an unknown decode_errors,
    or an empty text column name. Hub ids are checked when first read.
    """
    if cfg.decode_errors not in ("strict", "replace"):
        raise DataError(f"data.decode_errors must be 'strict' or 'replace', got '{cfg.decode_errors}'")
    if not cfg.text_column:
        raise DataError("data.text_column is empty; name the column that holds the text (e.g. 'text')")
    if cfg.max_documents < 0:
        raise DataError(f"data.max_documents must be >= 0, got {cfg.max_documents}")
    if cfg.dataset != "stdlib" and _looks_local(cfg.dataset):
        _local_files(os.path.expanduser(cfg.dataset))


def _looks_local(spec: str) -> bool:
    # A file name ("notes.jsonl") is local even when missing: it must fail as a missing file,
    # not after minutes of retries against a hub dataset of that name.
    return (os.path.exists(spec) or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~"))
            or spec.lower().endswith((".txt", ".md", ".jsonl", ".json", ".parquet")))


FILES_PER_UNIT = 64
"""Text files (one document each) per work unit: enough to amortise a task, few enough to spread."""


def source_units(cfg: DataConfig) -> list[Callable[[], Iterator[str]]]:
    """The source split into ordered work units, each a function that yields its documents (str).

    Reading the units in order yields exactly the source's documents in order. A unit is a
    group of FILES_PER_UNIT text files, one jsonl/parquet file, or one file of a hub dataset
    (``IterableDataset.shard``), so the split depends on the source alone, never on how many
    processes read it, and a process reads only the units it is given. max_documents is not
    applied here. Raises DataError for a missing path, mixed or unknown file types, a missing
    text column or an unreadable source.
    """
    if cfg.dataset == "stdlib":
        # A few of CPython's own test files are deliberately not UTF-8; they are noise, not errors.
        return _file_groups(stdlib_files(), "replace")
    import datasets  # deferred: importing it costs a second

    if _looks_local(cfg.dataset):
        files = _local_files(os.path.expanduser(cfg.dataset))
        exts = {os.path.splitext(f)[1].lower() for f in files}
        kinds = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
        unknown = sorted(e for e in exts if e not in kinds)
        if unknown or len({kinds[e] for e in exts}) != 1:
            raise DataError(
                f"data.dataset: files of types {sorted(exts)} in '{cfg.dataset}'; use one of .txt, .jsonl, .parquet"
            )
        kind = kinds[exts.pop()]
        if kind == "text":  # one file is one document
            return _file_groups(files, cfg.decode_errors)
        open_rows = lambda: datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
    else:
        open_rows = lambda: datasets.load_dataset(cfg.dataset, cfg.dataset_config or None, split=cfg.split,
                                                  streaming=True)
    rows = _guarded(cfg, open_rows)
    n = rows.num_shards
    return [functools.partial(_texts, cfg, lambda i=i: rows.shard(n, i)) for i in range(n)]


def _file_groups(files: list[str], errors: str) -> list[Callable[[], Iterator[str]]]:
    def read(group):
        for path in group:
            yield _read_text(path, errors)

    return [functools.partial(read, files[i:i + FILES_PER_UNIT]) for i in range(0, len(files), FILES_PER_UNIT)]


def _guarded(cfg: DataConfig, fn):
    """fn(), with datasets/pyarrow/hub errors (many types) turned into a DataError naming the source."""
    try:
        return fn()
    except DataError:
        raise
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"data.dataset: cannot read '{cfg.dataset}': {type(e).__name__}: {first_line}") from e


def _texts(cfg: DataConfig, open_rows) -> Iterator[str]:
    it = _guarded(cfg, lambda: iter(open_rows()))
    first = True
    while True:
        row = _guarded(cfg, lambda: next(it, None))
        if row is None:
            return
        if first and cfg.text_column not in row:
            raise DataError(
                f"data.text_column: column '{cfg.text_column}' not in {cfg.dataset} (columns: {sorted(row)}); "
                f"set --data.text_column"
            )
        first = False
        text = row[cfg.text_column]
        if text is not None and not isinstance(text, str):
            raise DataError(f"data.text_column: column '{cfg.text_column}' of {cfg.dataset} holds "
                            f"{type(text).__name__}, not text; name a string column")
        if text:
            yield text


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Yield the source's document texts (str) in order, at most max_documents of them (0: all).

    Raises DataError for a missing path, an unknown file type or a missing text column.
    """
    docs = (text for unit in source_units(cfg) for text in unit())
    yield from itertools.islice(docs, cfg.max_documents or None)


# ---------------------------------------------------------------- tokenizer

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


def load_tokenizer(path: str):
    """Load a tokenizer.json; raises DataError naming the file if it is missing or lacks [EOT]."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer: file '{path}' not found; give a tokenizer.json or leave it empty to train one")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"data.tokenizer: cannot read '{path}': {e}") from e
    if tok.token_to_id(EOT) is None:
        raise DataError(f"data.tokenizer: '{path}' has no {EOT} token; the packer needs it as document separator")
    return tok


# ---------------------------------------------------------------- packing

def pack_documents(docs: Iterable[list[int]], eot_id: int) -> np.ndarray:
    """Concatenate token-id lists into one stream with eot_id after every document.

    Returns a 1-D uint32 array of sum(len(d) + 1) tokens: nothing is padded or cut.
    """
    parts = []
    for ids in docs:
        parts.append(np.asarray(ids, dtype=np.uint32))
        parts.append(np.asarray([eot_id], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


DOCS_PER_UNIT = 256
"""Documents per work unit when max_documents bounds the source (the first N documents in order)."""


def _rank_units(cfg: DataConfig, rank: int, world: int) -> Iterator[tuple[int, Iterator[str]]]:
    """Yield (unit index, documents) for the units rank tokenizes: unit u goes to rank u % world.

    With max_documents the units are blocks of DOCS_PER_UNIT documents of the first N; every
    rank reads those N (a bounded read) and keeps its blocks. Otherwise the units are the
    source's own (source_units) and a rank reads only its own.
    """
    if not cfg.max_documents:
        units = source_units(cfg)
        for u in range(rank, len(units), world):
            yield u, units[u]()
        return
    for u, block in itertools.groupby(enumerate(iter_documents(cfg)), key=lambda item: item[0] // DOCS_PER_UNIT):
        if u % world == rank:
            yield u, (text for _, text in block)
        else:
            for _ in block:  # groupby needs the block consumed before it moves on
                pass


def tokenize_documents(texts: Iterable[str], tokenizer, out: BinaryIO, batch: int = 256) -> tuple[int, int]:
    """Tokenize and pack documents (blank ones skipped), appending the uint32 stream to out.

    Writes batch by batch, so memory stays bounded however large the unit. Returns
    (n_tokens written, n_documents).
    """
    eot = tokenizer.token_to_id(EOT)
    n_tokens, n_docs, pending = 0, 0, []

    def flush():
        nonlocal n_tokens, n_docs
        encs = tokenizer.encode_batch(pending, add_special_tokens=False)
        stream = pack_documents((e.ids for e in encs), eot)
        out.write(stream.tobytes())
        n_tokens += int(stream.size)
        n_docs += len(pending)
        pending.clear()

    for text in texts:
        if text.strip():
            pending.append(text)
            if len(pending) >= batch:
                flush()
    if pending:
        flush()
    return n_tokens, n_docs


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len that fit in n_tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def window(tokens: np.ndarray, index: int, seq_len: int) -> np.ndarray:
    """Window index of the stream: tokens[index*seq_len : index*seq_len + seq_len + 1]."""
    start = index * seq_len
    return tokens[start:start + seq_len + 1]


# ---------------------------------------------------------------- the prepared corpus on disk

def share_cores_between_local_ranks() -> None:
    """Give this process's tokenizer threads its share of the node's cores (call before tokenizing).

    HF tokenizers' thread pool takes every core by default; with torchrun's LOCAL_WORLD_SIZE
    processes per node that oversubscribes the node that many times. An explicit
    RAYON_NUM_THREADS is left alone.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local > 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local)))


def _gather_single(obj):
    return [obj]


def prepare(cfg: DataConfig, out_dir: str, rank: int = 0, world: int = 1, all_gather=_gather_single) -> dict:
    """Tokenize the corpus once into out_dir: tokenizer.json, tokens.bin (uint32 stream), meta.json.

    Collective when world > 1: every rank calls it, and all_gather(obj) must return the list
    of every rank's obj (e.g. torch.distributed.all_gather_object on a gloo group). Rank 0
    trains or loads the tokenizer; then rank r tokenizes the work units u with u % world == r
    (see _rank_units) into parts/ of out_dir + '.tmp' (a directory every rank can reach), and
    rank 0 joins them in unit order. The stream is therefore the same at every world size.

    Reuses what an earlier call left there, so a resumed run reads the same tokens. Writes
    into out_dir + '.tmp' and renames it at the end: bad input or a crash leaves no out_dir.
    Returns the meta dict on every rank. Raises DataError, on every rank, for bad input found
    on any rank, or if out_dir was prepared with other data settings.
    """
    tmp = out_dir + ".tmp"
    parts = os.path.join(tmp, "parts")

    def agree(fn):
        """fn() on this rank; the results of all ranks, or the first rank's DataError on every rank."""
        try:
            result, error = fn(), None
        except DataError as e:
            result, error = None, str(e)
        gathered = all_gather((result, error))
        errors = [e for _, e in gathered if e is not None]
        if errors:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise DataError(errors[0])
        return [r for r, _ in gathered]

    done = agree(lambda: _start_prepare(cfg, out_dir, tmp) if rank == 0 else None)[0]
    if done is not None:
        return done
    tokenizer = None

    def tokenize_mine():
        nonlocal tokenizer
        if not os.path.isfile(os.path.join(tmp, "tokenizer.json")):
            raise DataError(f"rank {rank} cannot see '{tmp}', which rank 0 wrote: the run directory must be on "
                            f"a filesystem that every node shares")
        tokenizer = load_tokenizer(os.path.join(tmp, "tokenizer.json"))
        counts = []
        for u, texts in _rank_units(cfg, rank, world):
            with open(os.path.join(parts, f"{u:07d}.bin"), "wb") as out:
                counts.append((u, *tokenize_documents(texts, tokenizer, out)))
        return counts

    counts = sorted(c for rank_counts in agree(tokenize_mine) for c in rank_counts)
    return agree(lambda: _finish_prepare(cfg, out_dir, tmp, tokenizer, counts) if rank == 0 else None)[0]


# Fields that decide the token stream; seq_len, val_fraction and the shuffle apply when it is read.
_PREPARED_FROM = ("dataset", "dataset_config", "split", "text_column", "max_documents", "decode_errors",
                  "tokenizer", "tokenizer_vocab_size", "tokenizer_train_chars")


def _prepared_from(cfg: DataConfig) -> dict:
    """The data settings a prepared directory records and a later run must repeat."""
    return {k: getattr(cfg, k) for k in _PREPARED_FROM}


def _start_prepare(cfg: DataConfig, out_dir: str, tmp: str) -> dict | None:
    """Rank 0: the meta of an earlier, matching preparation; or None after writing tmp/tokenizer.json."""
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        wanted = _prepared_from(cfg)
        changed = [f"data.{k}: {meta['config'].get(k)!r} -> {v!r}" for k, v in wanted.items()
                   if meta.get("config", {}).get(k) != v]
        if changed:
            raise DataError(
                f"'{out_dir}' was prepared with other data settings ({'; '.join(changed)}); "
                f"use a new --run_dir, or the settings the run started with"
            )
        return meta
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):  # ours has meta.json (tmp is renamed whole): this is someone's files
        raise DataError(f"'{out_dir}' exists but was not prepared by this tool (no meta.json); move it away, "
                        f"or use another --run_dir")
    shutil.rmtree(out_dir, ignore_errors=True)  # an empty folder
    os.makedirs(os.path.join(tmp, "parts"))
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        tokenizer = train_tokenizer(iter_documents(cfg), cfg.tokenizer_vocab_size, cfg.tokenizer_train_chars)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    return None


def _finish_prepare(cfg: DataConfig, out_dir: str, tmp: str, tokenizer, counts: list[tuple[int, int, int]]) -> dict:
    """Rank 0: join the parts in unit order into tokens.bin, write meta.json, rename tmp to out_dir."""
    if [u for u, _, _ in counts] != list(range(len(counts))):
        raise DataError(f"data.dataset: '{cfg.dataset}' changed while it was read (work units {counts[:5]}...)")
    n_docs = sum(n for _, _, n in counts)
    if n_docs == 0:
        raise DataError(f"data.dataset: '{cfg.dataset}' holds no non-empty document; point it at real text")
    with open(os.path.join(tmp, "tokens.bin"), "wb") as out:
        for u, _, _ in counts:
            part = os.path.join(tmp, "parts", f"{u:07d}.bin")
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            os.remove(part)
    os.rmdir(os.path.join(tmp, "parts"))
    meta = {"tokenizer": os.path.join(out_dir, "tokenizer.json"), "vocab_size": tokenizer.get_vocab_size(),
            "n_tokens": sum(n for _, n, _ in counts), "n_documents": n_docs, "work_units": len(counts),
            "config": _prepared_from(cfg)}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, out_dir)
    return meta


class PackedCorpus:
    """The prepared token stream, memory-mapped, split into train and validation windows."""

    def __init__(self, out_dir: str, cfg: DataConfig):
        with open(os.path.join(out_dir, "meta.json")) as f:
            self.meta = json.load(f)
        self.seq_len = cfg.seq_len
        self.tokens = np.memmap(os.path.join(out_dir, "tokens.bin"), dtype=np.uint32, mode="r")
        n = num_windows(self.tokens.size, cfg.seq_len)
        self.n_val = int(n * cfg.val_fraction) if cfg.val_fraction > 0 else 0
        if cfg.val_fraction > 0 and n >= 2:
            self.n_val = max(1, self.n_val)
        self.n_train = n - self.n_val

    def sample(self, index: int) -> np.ndarray:
        """Train window index (0 <= index < n_train) as an int64 array of seq_len + 1 tokens."""
        return window(self.tokens, index, self.seq_len).astype(np.int64)

    def val_sample(self, index: int) -> np.ndarray:
        """Validation window index (0 <= index < n_val)."""
        return window(self.tokens, self.n_train + index, self.seq_len).astype(np.int64)


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
        windows = torch.from_numpy(np.stack([self.corpus.sample(i) for i in idx]))
        out = []
        for mb in windows.split(self.micro_batch_size):
            out.append((mb[:, :-1].contiguous(), mb[:, 1:].contiguous()))
        return out

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
    idx = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    out = []
    for i in range(0, per_rank, micro_batch_size):
        w = torch.from_numpy(np.stack([corpus.val_sample(j) for j in idx[i:i + micro_batch_size]]))
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: prepare a run's data ahead of training, or train a tokenizer alone.

        python data.py prepare --config FILE.toml --run_dir DIR [--data.field value ...]
        torchrun --standalone --nproc_per_node=N data.py prepare ...   (N processes tokenize)
        python data.py tokenizer --config FILE.toml --out tokenizer.json [--data.field value ...]

    `prepare` writes what a training run would write into DIR/data (tokenizer.json,
    tokens.bin, meta.json), so a long tokenization need not happen inside the process
    group's timeout. Exit status 2 with one line on bad input.
    """
    import sys

    import train_fsdp  # the root config lives there; imported here only, to keep data.py model-free

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("prepare", "tokenizer"):
        print(main.__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    out = None
    if command == "tokenizer":
        if "--out" not in rest or rest.index("--out") + 1 >= len(rest):
            print("error: tokenizer needs --out PATH", file=sys.stderr)
            return 2
        i = rest.index("--out")
        out = rest[i + 1]
        del rest[i:i + 2]
    try:
        cfg = train_fsdp.parse_config(rest)
        check_source(cfg.data)
        if command == "prepare":
            meta = _prepare_command(cfg)
            if meta is not None:
                print(json.dumps({k: v for k, v in meta.items() if k != "config"}))
        else:
            tok = train_tokenizer(iter_documents(cfg.data), cfg.data.tokenizer_vocab_size,
                                  cfg.data.tokenizer_train_chars)
            tok.save(out)
            print(f"wrote {out}: {tok.get_vocab_size()} tokens")
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _prepare_command(cfg) -> dict | None:
    """prepare() for the CLI: alone, or on every process of a torchrun launch (meta on rank 0, else None)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return prepare(cfg.data, os.path.join(cfg.run_dir, "data"))
    share_cores_between_local_ranks()
    import datetime

    import torch.distributed as dist

    # No collective but the gathers of prepare(); its tokenization may take hours.
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    try:
        out = [None] * world

        def all_gather(obj):
            dist.all_gather_object(out, obj)
            return list(out)

        meta = prepare(cfg.data, os.path.join(cfg.run_dir, "data"), dist.get_rank(), world, all_gather)
        dist.barrier()
        return meta if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
