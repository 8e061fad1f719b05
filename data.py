"""The reading side of the data: the config of sources and stages, and the packed token windows.

A run's data directory (written by prepare.py) holds one flat token stream per source
(``sources/<name>-<key>.bin``, uint16 or uint32 as meta.json says): every document followed
by one ``[EOT]``. Each is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len``
(inputs ``w[:-1]``, labels ``w[1:]``), so no padding is ever trained on and every token
after the first is a target exactly once per epoch; only the stream's last partial window
is left out. The last ``val_fraction`` of each source's windows is held out.

loader.py draws the global batches from these windows; mixture.py has its sampling rule.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Literal

import numpy as np
import torch

from core.errors import ConfigError, UserError
from data_pipeline.streams import TokenStream


class DataError(UserError):
    """Bad data input: the message names the field or file and the fix."""


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
DEFAULT_SOURCE = "default"
"""The name of the one source that data.dataset describes when no [[data.sources]] are given."""
# Reading fields a [[data.sources]] table may set; unset, each takes the [data] field of that name.
READING_FIELDS = ("dataset_config", "split", "text_column", "max_documents", "decode_errors", "txt_documents")
FORMAT_FIELDS = ("format", "token_dtype", "token_column")
"""Fields of a source's format, inherited from [data] like READING_FIELDS; part of its reading settings only when
format is not 'text' (so a raw-text source keeps the settings, and the key, it had before formats existed)."""
TxtDocuments = Literal["file", "blank_line", "line"]
Format = Literal["text", "megatron", "numpy", "datatrove", "tokens"]
TokenDtype = Literal["", "uint8", "uint16", "uint32", "int32", "int64"]


@dataclasses.dataclass
class SourceConfig:
    """One [[data.sources]] table: a named document source and its weight in the mixture."""

    name: str = ""
    """Name of the source (letters, digits, '_', '-'): metrics keys val_loss/<name>, tokens/<name> and stage weights use it."""
    dataset: str = ""
    """What data.dataset accepts: 'stdlib', a local file, folder or glob (.txt, .jsonl/.json, .parquet, optionally .gz/.zst), or a hub id."""
    weight: float = 1.0
    """Share of every global batch (weights are normalised over the sources; 0: none until a stage gives it weight)."""
    text_column: str | None = None
    """Column of the text (unset: data.text_column)."""
    dataset_config: str | None = None
    """Hub configuration name (unset: data.dataset_config)."""
    split: str | None = None
    """Hub split (unset: data.split)."""
    max_documents: int | None = None
    """Read at most this many documents of this source, 0: all (unset: data.max_documents)."""
    decode_errors: Literal["strict", "replace"] | None = None
    """Undecodable bytes in .txt files (unset: data.decode_errors)."""
    txt_documents: TxtDocuments | None = None
    """How a .txt file splits into documents (unset: data.txt_documents)."""
    format: Format | None = None
    """What dataset holds: 'text' or token ids tokenized elsewhere ('megatron', 'numpy', 'datatrove', 'tokens'; unset: data.format)."""
    token_dtype: TokenDtype | None = None
    """Token dtype of numpy/datatrove files (unset: data.token_dtype)."""
    token_column: str | None = None
    """Column of the token ids of a 'tokens' source (unset: data.token_column)."""

    def __post_init__(self) -> None:
        if not SOURCE_NAME.match(self.name):
            raise ConfigError(f"data.sources: name {self.name!r} is not a name; give each [[data.sources]] table "
                              f"name = \"...\" of letters, digits, '_' or '-'")
        if not self.dataset:
            raise ConfigError(f"data.sources[{self.name}].dataset is empty; give 'stdlib', a local file, folder or "
                              f"glob, or a hub id")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ConfigError(f"data.sources[{self.name}].weight must be a finite number >= 0, got {self.weight}")
        if self.max_documents is not None and self.max_documents < 0:
            raise ConfigError(f"data.sources[{self.name}].max_documents must be >= 0, got {self.max_documents}")
        if self.text_column == "":
            raise ConfigError(f"data.sources[{self.name}].text_column is empty; name the column of the text")

    def field(self, name: str) -> str:
        """How messages name one of this source's fields: 'data.dataset' for the default source, else 'data.sources[NAME].dataset'."""
        return f"data.{name}" if self.name == DEFAULT_SOURCE else f"data.sources[{self.name}].{name}"

    def reading(self) -> dict:
        """The settings that decide the source's documents (and so its tokens, with the tokenizer); the
        FORMAT_FIELDS only for a source that is not raw text."""
        extra = {k: getattr(self, k) for k in FORMAT_FIELDS} if self.format not in (None, "text") else {}
        return {"dataset": self.dataset, **{k: getattr(self, k) for k in READING_FIELDS}, **extra}

    @property
    def pretokenized(self) -> bool:
        """Whether the source holds token ids (any format but 'text')."""
        return self.format not in (None, "text")


@dataclasses.dataclass
class StageConfig:
    """One [[data.stages]] table: from a step on, the mixture takes other weights (e.g. annealing)."""

    start_step: int = 0
    """Optimizer steps done before the stage starts: step start_step + 1 (as metrics.jsonl counts) is its first."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """{source name = weight}; a source the table leaves out gets weight 0 in this stage."""


@dataclasses.dataclass
class DataConfig:
    dataset: str = "stdlib"
    """'stdlib' (offline: this Python's standard-library sources), a local file, folder or glob (.txt, .jsonl/.json, .parquet, optionally .gz/.zst), or a Hugging Face hub id. A one-source mixture; leave it at its default when [[data.sources]] are given."""
    dataset_config: str = ""
    """Hub dataset configuration name, e.g. 'sample-10BT' for HuggingFaceFW/fineweb."""
    split: str = "train"
    """Split of a hub dataset to read."""
    text_column: str = "text"
    """Column that holds the document text (jsonl/parquet/hub sources)."""
    max_documents: int = 0
    """Read at most this many documents of each source (0: all)."""
    decode_errors: Literal["strict", "replace"] = "strict"
    """Undecodable bytes in .txt files: 'strict' stops with the file and byte offset, 'replace' substitutes U+FFFD."""
    txt_documents: TxtDocuments = "file"
    """How a .txt file splits into documents: 'file' (the whole file), 'blank_line' (paragraphs between blank lines) or 'line'."""
    format: Format = "text"
    """What data.dataset holds: 'text' (raw text, tokenized here), or token ids tokenized elsewhere and read in place: 'megatron' (PREFIX of .bin/.idx, a glob of prefixes or a folder), 'numpy' (OLMo flat token files, a file or glob, with data.token_dtype), 'datatrove' (.ds + .ds.index), 'tokens' (a dataset with data.token_column, materialised once). docs/data.md."""
    token_dtype: TokenDtype = ""
    """Token dtype of numpy and datatrove files (they do not record it): uint16 or uint32; required for numpy; empty for datatrove: uint16 when the tokenizer has at most 65,536 ids, else uint32. Megatron's index records its own (a different value here is refused)."""
    token_column: str = "input_ids"
    """Column of the token ids of a 'tokens' source."""
    eos_token: str = ""
    """The document separator put after every document (and expected at the end of every pre-tokenized one); empty: the tokenizer's own EOS (tokenizer_config.json's eos_token beside it, else [EOT])."""
    bos_token: str = ""
    """A token put before every raw-text document (Llama 3: '<|begin_of_text|>'); empty: none."""
    prepared_format: Literal["bin", "megatron"] = "bin"
    """How preparation leaves each raw source's stream RUN_DIR/data/sources/NAME-KEY.bin: 'bin' (this trainer's flat stream alone) or 'megatron' (with a Megatron-Core MMIDIDX NAME-KEY.idx beside it, so Megatron, NeMo or MaxText read the prefix RUN_DIR/data/sources/NAME-KEY). The tokens are the same either way."""
    prepared: str = ""
    """A prepared data directory to train from (tokenizer.json, meta.json, sources/), local or a URL such as s3://BUCKET/PREFIX (written by prepare.py --data.prepared URL); its meta.json must match these data settings. Each node copies the files it needs into data.cache_dir. Empty: the run prepares RUN_DIR/data itself."""
    cache_dir: str = ""
    """Node-local folder for the copy of a remote data.prepared, checked by size and checksum against its meta.json and reused across restarts (empty: RUN_DIR/data_cache)."""
    tokenizer: str = ""
    """Path to a tokenizer.json; empty: train a byte-level BPE on the corpus into the run directory."""
    tokenizer_vocab_size: int = 4096
    """Vocabulary size when a tokenizer is trained here (special tokens included)."""
    tokenizer_train_chars: int = 20_000_000
    """Characters of the corpus used to train a tokenizer (shared among the sources in proportion to their weights)."""
    seq_len: int = 512
    """Tokens per training sequence (the model sees seq_len inputs and predicts seq_len labels)."""
    val_fraction: float = 0.01
    """Fraction of each source's packed sequences held out for validation (taken from the end of its stream)."""
    sources: list[SourceConfig] = dataclasses.field(default_factory=list)
    """A mixture of named sources, each with a weight; the [data] reading fields are their defaults."""
    stages: list[StageConfig] = dataclasses.field(default_factory=list)
    """Changes of the mixture's weights at given steps, in order of start_step."""

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
        self._check_mixture()

    def _check_mixture(self) -> None:
        if self.sources and self.dataset != "stdlib":
            raise ConfigError(f"data.dataset ({self.dataset!r}) and [[data.sources]] are both set; make it one "
                              f"more [[data.sources]] table (name, dataset, weight) and drop data.dataset")
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"data.sources: two sources are named {twice[0]!r}; give each its own name")
        if self.sources and not sum(s.weight for s in self.sources) > 0:
            raise ConfigError("data.sources: every weight is 0; give at least one source a weight > 0")
        if not math.isfinite(sum(s.weight for s in self.sources)):
            raise ConfigError("data.sources: the weights sum past the largest float (inf); give smaller weights "
                              "(only their ratios matter)")
        if self.stages and not self.sources:
            raise ConfigError("data.stages needs [[data.sources]] tables: the stages' weights name the sources")
        last = -1
        for i, stage in enumerate(self.stages):
            where = f"data.stages[{i}]"
            if stage.start_step < 0:
                raise ConfigError(f"{where}.start_step must be >= 0 (optimizer steps before the stage), got "
                                  f"{stage.start_step}")
            if stage.start_step <= last:
                raise ConfigError(f"{where}.start_step ({stage.start_step}) must be after the previous stage's "
                                  f"({last}); list the stages in order of start_step")
            last = stage.start_step
            for name, w in stage.weights.items():
                if name not in names:
                    raise ConfigError(f"{where}.weights names {name!r}, which is not a source "
                                      f"(sources: {', '.join(names)}); use one of those names")
                if not (math.isfinite(w) and w >= 0):
                    raise ConfigError(f"{where}.weights.{name} must be a finite number >= 0, got {w}")
            if not sum(stage.weights.values()) > 0:
                raise ConfigError(f"{where}.weights: every weight is 0 (or none given); give a source a weight > 0")
            if not math.isfinite(sum(stage.weights.values())):
                raise ConfigError(f"{where}.weights: they sum past the largest float (inf); give smaller weights "
                                  f"(only their ratios matter)")

    def source_list(self) -> list[SourceConfig]:
        """The sources of the mixture, every reading field resolved (unset ones from [data]).

        Without [[data.sources]]: one source named DEFAULT_SOURCE from data.dataset, weight 1.
        """
        given = self.sources or [SourceConfig(name=DEFAULT_SOURCE, dataset=self.dataset)]
        return [dataclasses.replace(s, **{k: getattr(self, k) for k in READING_FIELDS + FORMAT_FIELDS
                                           if getattr(s, k) is None}) for s in given]

    def prepared_settings(self) -> dict:
        """Every setting that decides the prepared tokens, and nothing else (not weights, stages, seq_len).

        {"tokenizer": {the TOKENIZER_FIELDS, eos_token and bos_token when set}, "sources": [{"name", "dataset", the READING_FIELDS}]}
        in source_list() order: prepare.py keys and checks a data directory by these, and a
        directory prepared with equal ones holds the same tokens.
        """
        separators = {k: getattr(self, k) for k in ("eos_token", "bos_token") if getattr(self, k)}
        return {"tokenizer": {**{k: getattr(self, k) for k in TOKENIZER_FIELDS}, **separators},
                "sources": [{"name": s.name, **s.reading()} for s in self.source_list()]}

    def weight_schedule(self) -> list[tuple[int, list[float]]]:
        """[(start_step, weights in source_list() order)], the first from step 0 (the sources' own weights)."""
        names = [s.name for s in self.source_list()]
        schedule = [(0, [s.weight for s in self.source_list()])]
        for stage in self.stages:
            weights = [float(stage.weights.get(n, 0.0)) for n in names]
            schedule = [x for x in schedule if x[0] != stage.start_step] + [(stage.start_step, weights)]
        return schedule


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


TOKENIZER_FIELDS = ("tokenizer", "tokenizer_vocab_size", "tokenizer_train_chars")
"""DataConfig fields that decide the tokenizer, fixed for a data directory once it is prepared."""
LEGACY_KEYS = ("tokenizer", "vocab_size", "n_tokens", "n_documents", "config")
"""meta.json of a directory prepared before mixtures: one uint32 tokens.bin."""
META_KEYS = ("tokenizer", "vocab_size", "tokenizer_config", "sources")


def token_dtype(vocab_size: int) -> str:
    """'uint16' when every id fits (vocab_size <= 65,536: half the disk and page cache), else 'uint32'."""
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def _damaged(path: str, out_dir: str, what: str) -> DataError:
    return DataError(f"'{path}' {what}; the data directory is damaged: move '{out_dir}' away and run again to "
                     f"prepare it anew")


def read_meta(out_dir: str) -> dict:
    """A prepared data directory's meta.json, in the current layout; DataError naming the file when unreadable.

    Layout: {"tokenizer", "vocab_size", "tokenizer_config": {the TOKENIZER_FIELDS},
    "sources": {name: {"file" (relative to out_dir), "dtype", "n_tokens", "n_documents",
    "config": the source's reading settings}}}. A directory prepared before mixtures (one
    uint32 tokens.bin) reads as one source named DEFAULT_SOURCE, with "legacy": True.
    """
    path = os.path.join(out_dir, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
        raise _damaged(path, out_dir, f"cannot be read ({type(e).__name__})") from None
    if isinstance(meta, dict) and "sources" not in meta and all(k in meta for k in LEGACY_KEYS):
        old = meta["config"]
        reading = {k: old.get(k) for k in ("dataset", *READING_FIELDS)} | {"txt_documents": "file"}
        return {"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"], "legacy": True,
                "tokenizer_config": {k: old.get(k) for k in TOKENIZER_FIELDS},
                "sources": {DEFAULT_SOURCE: {"file": "tokens.bin", "dtype": "uint32", "n_tokens": meta["n_tokens"],
                                             "n_documents": meta["n_documents"], "config": reading}}}
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if missing:
        raise _damaged(path, out_dir, f"lacks {', '.join(missing)}")
    return meta


class SourceTokens:
    """One source's token stream, memory-mapped, cut into train windows and its held-out validation tail.

    A prepared source is one file in the data directory; a pre-tokenized one (its record has
    "shards", data_pipeline/pretokenized.py) is its shards read in place as one stream, and
    every window of it is checked against vocab_size (the start-up scan of a large corpus is
    sampled).
    """

    def __init__(self, out_dir: str, name: str, record: dict, seq_len: int, val_fraction: float,
                 vocab_size: int | None = None):
        """Map the file(s) of meta record; raises DataError when they do not hold the tokens the record counts."""
        self.name, self.seq_len = name, seq_len
        self.vocab_size = vocab_size if "shards" in record else None
        if "shards" in record:
            self.tokens = TokenStream(record["shards"])
            for (path, dtype, n), size in zip(record["shards"], self.tokens.file_sizes()):
                if size != np.dtype(dtype).itemsize * n:
                    raise DataError(f"source '{name}': '{path}' holds {max(size, 0):,} bytes, not the {n:,} "
                                    f"{dtype} tokens it had when the run started; the corpus changed under the run: "
                                    f"restore it, or start a new --run_dir")
        else:
            path = os.path.join(out_dir, record["file"])
            dtype = np.dtype(record["dtype"])
            size = os.path.getsize(path) if os.path.isfile(path) else -1
            if size != dtype.itemsize * record["n_tokens"] or size == 0:
                raise _damaged(path, out_dir, f"holds {max(size, 0)} bytes, not the {record['n_tokens']} "
                                              f"{record['dtype']} tokens meta.json counts")
            self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.n_tokens, self.n_documents = record["n_tokens"], record["n_documents"]
        n = num_windows(len(self.tokens), seq_len)
        self.n_val = int(n * val_fraction) if val_fraction > 0 else 0
        if val_fraction > 0 and n >= 2:
            self.n_val = max(1, self.n_val)
        self.n_train = n - self.n_val

    def prefetch(self, indices: list[int]) -> None:
        """Fetch the windows of indices in one concurrent batch when the stream is read from an object store (a
        ranged read each, through data_pipeline/ranged.py's cache); nothing for mapped files."""
        if isinstance(self.tokens, TokenStream) and self.tokens.remote:
            self.tokens.prefetch([(i * self.seq_len, i * self.seq_len + self.seq_len + 1) for i in indices])

    def sample(self, index: int) -> np.ndarray:
        """Window index of the stream (train: 0 <= index < n_train; validation after it) as int64, seq_len + 1 tokens."""
        w = window(self.tokens, index, self.seq_len).astype(np.int64)
        if self.vocab_size is not None and w.size and (int(w.max()) >= self.vocab_size or int(w.min()) < 0):
            bad = int(w.max()) if int(w.max()) >= self.vocab_size else int(w.min())
            raise DataError(f"source '{self.name}': window {index} holds token id {bad}, outside the model's "
                            f"{self.vocab_size} ids (model.vocab_size); the corpus was tokenized with another "
                            f"vocabulary: raise model.vocab_size or give the tokenizer it was made with")
        return w


class PackedCorpus:
    """The run's sources as prepared (one token file each) and the mixture's weight schedule."""

    def __init__(self, out_dir: str, cfg: DataConfig, vocab_size: int | None = None):
        """Map the token file of every source of cfg; raises DataError for a damaged or incomplete directory.

        vocab_size: model.vocab_size, against which every window of a pre-tokenized source is checked.
        """
        self.meta = read_meta(out_dir)
        self.seq_len = cfg.seq_len
        self.sources: list[SourceTokens] = []
        for src in cfg.source_list():
            record = self.meta["sources"].get(src.name)
            if record is None:
                raise DataError(f"'{out_dir}' holds no prepared source '{src.name}'; run prepare (or the training "
                                f"command) with this config to tokenize it")
            self.sources.append(SourceTokens(out_dir, src.name, record, cfg.seq_len, cfg.val_fraction, vocab_size))
        self.names = [s.name for s in self.sources]
        self.schedule = cfg.weight_schedule()
        self.n_train = sum(s.n_train for s in self.sources)
        self.n_val = sum(s.n_val for s in self.sources)
        self.n_tokens = sum(s.n_tokens for s in self.sources)
        self.n_documents = sum(max(0, s.n_documents) for s in self.sources)  # -1: not counted (numpy files)

    def describe(self) -> str:
        """The mixture for the start-up line: ' | mixture code 0.75 (400 docs), docs 0.25 (400 docs); from step
        5: ...', or '' for one source."""
        if len(self.sources) < 2:
            return ""
        docs = [f"{s.n_documents:,} docs" if s.n_documents >= 0 else "docs not counted" for s in self.sources]
        stages = [", ".join(f"{n} {w:g}" + (f" ({d})" if start == 0 else "") for n, w, d in zip(self.names, ws, docs))
                  for start, ws in self.schedule]
        return " | mixture " + "; ".join(f"after step {start}: {text}" if start else text
                                         for (start, _), text in zip(self.schedule, stages))

    def sample(self, index: int, source: int = 0) -> np.ndarray:
        """Window index of source number `source` (see SourceTokens.sample)."""
        return self.sources[source].sample(index)

    def batches(self, pairs, micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows [(source number, window index)], in order, as [(inputs, labels)] of (<= micro_batch_size, seq_len) int64 each."""
        pairs = list(pairs)
        for s, source in enumerate(self.sources):  # an object store's windows: one concurrent batch, not one by one
            source.prefetch([i for k, i in pairs if k == s])
        return [inputs_labels(torch.from_numpy(np.stack([self.sample(i, s) for s, i in pairs[k:k + micro_batch_size]])))
                for k in range(0, len(pairs), micro_batch_size)]


def mixture_note(saved: dict, cfg: DataConfig) -> str:
    """What a resume changes in the mixture, for the start-up line ('' if nothing): weights or stages.

    saved: the [data] table of the checkpoint's config.toml. Allowed: every source keeps its
    own position (DataState.source_samples); a new source starts at its beginning.
    """
    then = {s.get("name"): s.get("weight", 1.0) for s in saved.get("sources", [])} or {DEFAULT_SOURCE: 1.0}
    now = {s.name: s.weight for s in cfg.source_list()}
    stages_then = [(s.get("start_step"), s.get("weights")) for s in saved.get("stages", [])]
    stages_now = [(s.start_step, s.weights) for s in cfg.stages]
    notes = []
    if then != now:
        notes.append(f"data.sources weights {then} -> {now}")
    if stages_then != stages_now:
        notes.append(f"data.stages {stages_then} -> {stages_now}")
    return "; ".join(notes) + (" (each source continues from its own position)" if notes else "")
