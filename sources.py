"""Documents from a source, in order, split into work units that any number of processes can share.

A source is ``data.dataset``: ``stdlib`` (offline: this interpreter's standard-library
sources), local .txt/.md files (one document each), .jsonl/.json or .parquet files (one
document per row, column ``data.text_column``), or a Hugging Face hub id read as a stream.
"""
from __future__ import annotations

import functools
import glob
import itertools
import os
import sysconfig
from typing import Callable, Iterator

from data import DataConfig, DataError


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
    """The cheap check of a source that needs no reading of documents (run on every rank, early).

    Raises DataError for a local path or glob that matches nothing. Hub ids are checked
    when first read.
    """
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
        args, kwargs = (kind,), dict(data_files=files, split="train")
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

