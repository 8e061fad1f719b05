"""Documents from a source, in order, split into work units that any number of processes can share.

A source is one ``[[data.sources]]`` table (or ``data.dataset``): ``stdlib`` (offline: this
interpreter's standard-library sources), local .txt/.md files (one document each, or split
at blank lines or lines: ``txt_documents``), .jsonl/.json or .parquet files (one document
per row, column ``text_column``), any of these text and json files compressed (.gz, .zst,
.bz2, .xz), or a Hugging Face hub id read as a stream. One big local file is cut into
several units by filesplit.py; other files and hub datasets are read through ``datasets``.
Every function takes a resolved ``data.SourceConfig`` (``DataConfig.source_list()``).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import json
import os
import sysconfig
from typing import Callable, Iterator

from core.errors import require
from data import DEFAULT_SOURCE, DataConfig, DataError, SourceConfig
from data_pipeline.filesplit import (
    COMPRESSED,
    KINDS,
    check_column,
    file_kind,
    first_byte,
    guarded,
    jsonl_units,
    parquet_units,
    text_units,
    text_value,
)


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
        if src.pretokenized:  # token files: data_pipeline/pretokenized.py checks them
            continue
        if src.dataset != "stdlib" and _looks_local(src.dataset):
            files = _local_files(os.path.expanduser(src.dataset), src.field("dataset"))
            _check_compression(src, files)
            _check_not_blank(src, files)


BLANK_CHECK_BYTES = 1 << 20
"""Plain files up to this size in all are read by check_source to refuse a source of blank text before any work."""


def _check_not_blank(src: SourceConfig, files: list[str]) -> None:
    """DataError when every file of src is plain (uncompressed) text and holds only whitespace (empty files too).

    Larger sources are left to the preparation, which refuses a source without a document too,
    after the tokenizer: a tokenizer trained on nothing is minutes wasted and a confusing error.
    """
    if any(file_kind(f)[1] or KINDS.get(file_kind(f)[0]) != "text" for f in files) or \
            sum(os.path.getsize(f) for f in files) > BLANK_CHECK_BYTES:
        return
    for f in files:
        with open(f, "rb") as fh:
            if fh.read().strip():
                return
    what = f"'{files[0]}' is" if len(files) == 1 else f"its {len(files)} files are"
    raise DataError(f"{src.field('dataset')}: '{src.dataset}' holds no non-empty document ({what} empty or "
                    f"whitespace); point it at real text" + ("" if src.name == DEFAULT_SOURCE else " or remove the source"))


def source_files(src: SourceConfig) -> list[tuple[str, int, int]] | None:
    """(path, size in bytes, mtime in ns) of each local file of src, sorted; None for stdlib and hub datasets.

    What a prepared source's tokens were made from (prepare records it), so that a file that
    grew or changed afterwards is noticed instead of its stale tokens being reused.
    """
    if src.dataset == "stdlib" or not _looks_local(src.dataset):
        return None
    try:
        files = _local_files(os.path.expanduser(src.dataset), src.field("dataset"))
    except DataError:
        return None
    return [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def _check_compression(src: SourceConfig, files: list[str]) -> None:
    for f in files:
        module = COMPRESSED.get(file_kind(f)[1])
        if module is not None:
            require(module, None, f"{src.field('dataset')}: '{f}' ({module}-compressed)", "decompress the file")


def _looks_local(spec: str) -> bool:
    # A file name ("notes.jsonl") is local even when missing: it must fail as a missing file,
    # not after minutes of retries against a hub dataset of that name.
    return (os.path.exists(spec) or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~"))
            or file_kind(spec)[0] in KINDS)


FILES_PER_UNIT = 64
"""Text files (one document each) per work unit: enough to amortise a task, few enough to spread."""


def source_units(cfg: SourceConfig) -> list[Callable[[], Iterator[str]]]:
    """The source split into ordered work units, each a function that yields its documents (str).

    Reading the units in order yields exactly the source's documents in order. A unit is a
    group of FILES_PER_UNIT text files (txt_documents "file"), about UNIT_BYTES of one
    uncompressed .txt file (cut between lines, or between paragraphs for "blank_line"), one
    compressed text file, about UNIT_BYTES of one .jsonl file (cut between lines), a run of
    row groups of one .parquet file, or one file of a hub dataset or of compressed or
    array-style json (``IterableDataset.shard``). So the split depends on the source alone,
    never on how many processes read it, and a process reads only the units it is given.
    max_documents is not applied here. Raises DataError for a missing path, mixed or unknown
    file types, a missing text column or an unreadable source.
    """
    if cfg.dataset == "stdlib":
        # A few of CPython's own test files are deliberately not UTF-8; they are noise, not errors.
        return _file_groups(stdlib_files(), "replace")
    import datasets  # deferred: importing it costs a second

    if _looks_local(cfg.dataset):
        files = _local_files(os.path.expanduser(cfg.dataset), cfg.field("dataset"))
        exts = {file_kind(f)[0] for f in files}
        unknown = sorted(e for e in exts if e not in KINDS)
        if unknown or len({KINDS[e] for e in exts}) != 1:
            raise DataError(f"{cfg.field('dataset')}: files of types {sorted(exts)} in '{cfg.dataset}'; use one of "
                            f".txt, .jsonl, .parquet (optionally .gz or .zst)")
        _check_compression(cfg, files)
        kind = KINDS[exts.pop()]
        compressed = any(file_kind(f)[1] for f in files)
        if kind == "text" and cfg.txt_documents == "file" and not compressed:  # one file is one document
            return _file_groups(files, cfg.decode_errors)
        if kind == "text":
            return [unit for f in files for unit in text_units(cfg, f)]
        if kind == "parquet" and not compressed:
            return [unit for f in files for unit in parquet_units(cfg, f)]
        if not compressed and all(file_kind(f)[0] == ".jsonl" and first_byte(cfg, f) == b"{" for f in files):
            return [unit for i, f in enumerate(files) for unit in jsonl_units(cfg, f, first_file=i == 0)]
        args, kwargs = (kind,), dict(data_files=files, split="train")
    else:
        args, kwargs = (cfg.dataset, cfg.dataset_config or None), dict(split=cfg.split)
    rows = guarded(cfg, lambda: datasets.load_dataset(*args, **kwargs, streaming=True))
    n = rows.num_shards
    return [functools.partial(_texts, cfg, lambda i=i: rows.shard(n, i)) for i in range(n)]


def txt_notice(cfg: SourceConfig) -> str:
    """One line for rank 0 saying how a local text source read with txt_documents "file" splits, else ''.

    Every such .txt file (any size, compressed or not) is one document, which is rarely what a
    single file means (e.g. WikiText's one file, or a small test file); the line names the
    file(s), the field and its other values. Sources read otherwise, stdlib, hub datasets and
    files that cannot be listed give ''.
    """
    if cfg.txt_documents != "file" or cfg.dataset == "stdlib" or not _looks_local(cfg.dataset):
        return ""
    try:
        files = _local_files(os.path.expanduser(cfg.dataset), cfg.field("dataset"))
    except DataError:
        return ""
    texts = [f for f in files if KINDS.get(file_kind(f)[0]) == "text"]
    if not texts:
        return ""
    what = (f"'{texts[0]}' ({_size(os.path.getsize(texts[0]))}) as one document" if len(texts) == 1 else
            f"each of its {len(texts):,} text files as one document")
    field = cfg.field("txt_documents")
    return (f"source '{cfg.name}' reads {what} ({field} = \"file\"); set {field} = \"blank_line\" (paragraphs) "
            f"or \"line\" to split {'it' if len(texts) == 1 else 'them'} into documents")


def _size(n: int) -> str:
    """A file size for a message: bytes under 1 KiB, KiB under 1 MiB, else MiB (one decimal)."""
    if n < 1 << 10:
        return f"{n:,} bytes"
    return f"{n / 2 ** 10:,.1f} KiB" if n < 1 << 20 else f"{n / 2 ** 20:,.1f} MiB"


def _file_groups(files: list[str], errors: str) -> list[Callable[[], Iterator[str]]]:
    def read(group):
        for path in group:
            yield _read_text(path, errors)

    return [functools.partial(read, files[i:i + FILES_PER_UNIT]) for i in range(0, len(files), FILES_PER_UNIT)]


def _texts(cfg: SourceConfig, open_rows) -> Iterator[str]:
    it = guarded(cfg, lambda: iter(open_rows()))
    first = True
    while True:
        row = guarded(cfg, lambda: next(it, None))
        if row is None:
            return
        if first:
            check_column(cfg, row)
        first = False
        text = text_value(cfg, row[cfg.text_column])
        if text:
            yield text


def iter_documents(cfg: SourceConfig) -> Iterator[str]:
    """Yield the source's document texts (str) in order, at most max_documents of them (0: all).

    Raises DataError for a missing path, an unknown file type or a missing text column.
    """
    docs = (text for unit in source_units(cfg) for text in unit())
    yield from itertools.islice(docs, cfg.max_documents or None)


def files_record(src: SourceConfig) -> dict | None:
    """What a local source's tokens are made from: {"n", "bytes", "digest" of the paths and sizes}; None for stdlib
    and hub datasets. Sizes, not modification times: a copy or a sync that keeps the text must not read as a change."""
    found = source_files(src)
    if found is None:
        return None
    listing = [(path, size) for path, size, _ in found]
    return {"n": len(listing), "bytes": sum(size for _, size in listing),
            "digest": hashlib.sha1(json.dumps(listing).encode()).hexdigest()}


def source_changed(src: SourceConfig, out_dir: str, then: dict, now: dict) -> DataError:
    """The DataError of a local source whose files (files_record: then, now) changed after it was tokenized into out_dir."""
    def files(r):
        return f"{r['n']} file{'s' if r['n'] != 1 else ''}, {r['bytes']:,} bytes"

    return DataError(f"{src.field('dataset')}: '{src.dataset}' changed since it was tokenized into '{out_dir}' "
                     f"({files(then)} then, {files(now)} now), so its prepared tokens are stale; move '{out_dir}' away "
                     f"and run again to tokenize it anew (a run with checkpoints: a new --run_dir with --data.tokenizer "
                     f"{os.path.join(out_dir, 'tokenizer.json')} keeps their tokenizer)")
