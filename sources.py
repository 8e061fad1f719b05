"""Documents from a source, in order, split into work units that any number of processes can share.

A source is one ``[[data.sources]]`` table (or ``data.dataset``): ``stdlib`` (offline: this
interpreter's standard-library sources), local .txt/.md files (one document each, or split
at blank lines or lines: ``txt_documents``), .jsonl/.json or .parquet files (one document
per row, column ``text_column``), any of these text and json files compressed (.gz, .zst,
.bz2, .xz; read through ``datasets``), or a Hugging Face hub id read as a stream. Every
function takes a resolved ``data.SourceConfig`` (``DataConfig.source_list()``).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import os
import sysconfig
from typing import Callable, Iterator

from data import DataConfig, DataError, SourceConfig
from errors import require


def stdlib_files() -> list[str]:
    """Sorted paths of this interpreter's standard-library .py files (no site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def _local_files(spec: str, field: str = "data.dataset") -> list[str]:
    if os.path.isdir(spec):
        files = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = sorted(glob.glob(spec, recursive=True))
    if not files:
        raise DataError(f"{field}: no file matches '{spec}'; give an existing file, folder or glob")
    return files


COMPRESSED = {".gz": "gzip", ".zst": "zstandard", ".bz2": "bz2", ".xz": "lzma"}
"""Compression suffixes `datasets` reads, and the module each needs."""
KINDS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _kind(path: str) -> tuple[str, str]:
    """(file extension without a compression suffix, compression suffix or '') of path, lower case."""
    stem, ext = os.path.splitext(path.lower())
    if ext in COMPRESSED:
        return os.path.splitext(stem)[1], ext
    return ext, ""


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
    """The cheap check of every source of cfg that needs no reading of documents (run on every rank, early).

    Raises DataError for a local path or glob that matches nothing, MissingPackageError for
    compressed files whose module is not installed. Hub ids are checked when first read.
    """
    for src in cfg.source_list():
        if src.dataset != "stdlib" and _looks_local(src.dataset):
            _check_compression(src, _local_files(os.path.expanduser(src.dataset), src.field("dataset")))


def _check_compression(src: SourceConfig, files: list[str]) -> None:
    for f in files:
        module = COMPRESSED.get(_kind(f)[1])
        if module is not None:
            require(module, None, f"{src.field('dataset')}: '{f}' ({module}-compressed)", "decompress the file")


def _looks_local(spec: str) -> bool:
    # A file name ("notes.jsonl") is local even when missing: it must fail as a missing file,
    # not after minutes of retries against a hub dataset of that name.
    return (os.path.exists(spec) or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~"))
            or _kind(spec)[0] in KINDS)


FILES_PER_UNIT = 64
"""Text files (one document each) per work unit: enough to amortise a task, few enough to spread."""


def source_units(cfg: SourceConfig) -> list[Callable[[], Iterator[str]]]:
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
        files = _local_files(os.path.expanduser(cfg.dataset), cfg.field("dataset"))
        exts = {_kind(f)[0] for f in files}
        unknown = sorted(e for e in exts if e not in KINDS)
        if unknown or len({KINDS[e] for e in exts}) != 1:
            raise DataError(f"{cfg.field('dataset')}: files of types {sorted(exts)} in '{cfg.dataset}'; use one of "
                            f".txt, .jsonl, .parquet (optionally .gz or .zst)")
        _check_compression(cfg, files)
        kind = KINDS[exts.pop()]
        compressed = any(_kind(f)[1] for f in files)
        if kind == "text" and cfg.txt_documents == "file" and not compressed:  # one file is one document
            return _file_groups(files, cfg.decode_errors)
        args, kwargs = (kind,), dict(data_files=files, split="train")
        if kind == "text":  # datasets' text builder: whole files, paragraphs or lines
            sample_by = {"file": "document", "blank_line": "paragraph", "line": "line"}[cfg.txt_documents]
            kwargs.update(sample_by=sample_by, encoding_errors=cfg.decode_errors)
            cfg = dataclasses.replace(cfg, text_column="text")  # the builder's column, whatever the source's
    else:
        args, kwargs = (cfg.dataset, cfg.dataset_config or None), dict(split=cfg.split)
    rows = _guarded(cfg, lambda: datasets.load_dataset(*args, **kwargs, streaming=True))
    n = rows.num_shards
    return [functools.partial(_texts, cfg, lambda i=i: rows.shard(n, i)) for i in range(n)]


def _file_groups(files: list[str], errors: str) -> list[Callable[[], Iterator[str]]]:
    def read(group):
        for path in group:
            yield _read_text(path, errors)

    return [functools.partial(read, files[i:i + FILES_PER_UNIT]) for i in range(0, len(files), FILES_PER_UNIT)]


def _guarded(cfg: SourceConfig, fn):
    """fn(), with datasets/pyarrow/hub errors (many types) turned into a DataError naming the source."""
    try:
        return fn()
    except DataError:
        raise
    except StopIteration:  # what datasets' json reader raises on an empty file
        raise DataError(f"{cfg.field('dataset')}: '{cfg.dataset}' holds no rows; point it at real data or remove "
                        f"the source") from None
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"{cfg.field('dataset')}: cannot read '{cfg.dataset}': {type(e).__name__}: {first_line}") from e


def _texts(cfg: SourceConfig, open_rows) -> Iterator[str]:
    it = _guarded(cfg, lambda: iter(open_rows()))
    first = True
    while True:
        row = _guarded(cfg, lambda: next(it, None))
        if row is None:
            return
        if first and cfg.text_column not in row:
            raise DataError(
                f"{cfg.field('text_column')}: column '{cfg.text_column}' not in {cfg.dataset} (columns: "
                f"{sorted(row)}); set {cfg.field('text_column')}"
            )
        first = False
        text = row[cfg.text_column]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{cfg.field('text_column')}: column '{cfg.text_column}' of {cfg.dataset} holds "
                            f"{type(text).__name__}, not text; name a string column")
        if text:
            yield text


def iter_documents(cfg: SourceConfig) -> Iterator[str]:
    """Yield the source's document texts (str) in order, at most max_documents of them (0: all).

    Raises DataError for a missing path, an unknown file type or a missing text column.
    """
    docs = (text for unit in source_units(cfg) for text in unit())
    yield from itertools.islice(docs, cfg.max_documents or None)

