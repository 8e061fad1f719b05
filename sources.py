"""Documents from a source, in order, split into work units that any number of processes can share.

A source is one ``[[data.sources]]`` table (or ``data.dataset``): ``stdlib`` (offline: this
interpreter's standard-library sources), local .txt/.md files (one document each, or split
at blank lines or lines: ``txt_documents``), .jsonl/.json or .parquet files (one document
per row, column ``text_column``), any of these text and json files compressed (.gz, .zst,
.bz2, .xz; read through ``datasets``), or a Hugging Face hub id read as a stream. Every
function takes a resolved ``data.SourceConfig`` (``DataConfig.source_list()``).
"""
from __future__ import annotations

import bz2
import codecs
import functools
import glob
import gzip
import io
import itertools
import json
import lzma
import os
import sysconfig
from typing import BinaryIO, Callable, Iterator

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
UNIT_BYTES = 32 << 20
"""Bytes of one uncompressed .jsonl or split .txt file per work unit, and of parquet row groups (uncompressed size)."""
CHUNK_BYTES = 8 << 20
"""Bytes read at a time inside a unit (then up to the end of the line): memory stays bounded."""


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
        if kind == "text":
            return [unit for f in files for unit in _text_units(cfg, f)]
        if kind == "parquet" and not compressed:
            return [unit for f in files for unit in _parquet_units(cfg, f)]
        if not compressed and all(_kind(f)[0] == ".jsonl" and _first_byte(cfg, f) == b"{" for f in files):
            return [unit for i, f in enumerate(files) for unit in _jsonl_units(cfg, f, check_column=i == 0)]
        args, kwargs = (kind,), dict(data_files=files, split="train")
    else:
        args, kwargs = (cfg.dataset, cfg.dataset_config or None), dict(split=cfg.split)
    rows = _guarded(cfg, lambda: datasets.load_dataset(*args, **kwargs, streaming=True))
    n = rows.num_shards
    return [functools.partial(_texts, cfg, lambda i=i: rows.shard(n, i)) for i in range(n)]


BIG_DOCUMENT_BYTES = 1 << 20
"""A .txt file this large read whole as one document (txt_documents "file") earns a notice, when the source has few."""
FEW_FILES = 8


def txt_notice(cfg: SourceConfig) -> str:
    """One line for rank 0 when txt_documents "file" makes a few big .txt files a few documents, else ''.

    Several MiB of text as one document is rarely meant (e.g. WikiText's one file); the line
    names the file and the fields that split it. Files that cannot be listed give ''.
    """
    if cfg.txt_documents != "file" or cfg.dataset == "stdlib" or not _looks_local(cfg.dataset):
        return ""
    try:
        files = _local_files(os.path.expanduser(cfg.dataset), cfg.field("dataset"))
    except DataError:
        return ""
    big = [f for f in files if KINDS.get(_kind(f)[0]) == "text" and os.path.getsize(f) >= BIG_DOCUMENT_BYTES]
    if not big or len(files) > FEW_FILES:
        return ""
    what = (f"'{big[0]}' ({os.path.getsize(big[0]) / 2 ** 20:,.1f} MiB) as one document" if len(big) == 1 else
            f"{len(big)} text files of {BIG_DOCUMENT_BYTES >> 20} MiB or more as one document each")
    return (f"source '{cfg.name}' reads {what} ({cfg.field('txt_documents')} = \"file\"); set "
            f"{cfg.field('txt_documents')} = \"blank_line\" (paragraphs) or \"line\" to split it into documents")


def _file_groups(files: list[str], errors: str) -> list[Callable[[], Iterator[str]]]:
    def read(group):
        for path in group:
            yield _read_text(path, errors)

    return [functools.partial(read, files[i:i + FILES_PER_UNIT]) for i in range(0, len(files), FILES_PER_UNIT)]


def _first_byte(cfg: SourceConfig, path: str) -> bytes:
    """The first byte of path after a UTF-8 BOM and whitespace (b'' when none in its first 64 KiB)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    return head.removeprefix(codecs.BOM_UTF8).lstrip()[:1]


def _line_start(f: BinaryIO, pos: int) -> int:
    """The first line start at or after byte pos of binary file f (pos itself when it follows a b'\\n')."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    f.readline()
    return f.tell()


def _universal(text: str) -> str:
    """text with '\\r\\n' and '\\r' as '\\n': what reading it in text mode (universal newlines) gives."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _paragraph_cut(f: BinaryIO, pos: int) -> int:
    """A byte offset >= pos of f where splitting the text at blank lines can cut it in two.

    Paragraphs are the pieces of the text (universal newlines, whitespace-only lines emptied)
    between occurrences of '\\n\\n', matched left to right, so a cut must fall where a match
    ends: after an even number of the newlines that follow a non-blank line Z. The first such
    run after the first non-blank line at or after pos gives the cut (the end of f if none).
    A line holding a lone '\\r' (several lines in text mode) starts the search over.
    """
    f.seek(_line_start(f, pos))
    seen_text, blanks, last_blank = False, 0, 0
    while True:
        start, line = f.tell(), f.readline()
        if not line:
            return start
        text = _universal(line.decode("utf-8", errors="replace"))
        if text.count("\n") > 1 or (not text.endswith("\n") and "\n" in text):
            seen_text, blanks = False, 0
        elif not text.strip():
            blanks, last_blank = blanks + 1, start
        elif seen_text and blanks:
            return start if blanks % 2 else last_blank
        else:
            seen_text, blanks = True, 0


def _open_binary(path: str) -> BinaryIO:
    """path opened for reading bytes, decompressed by its suffix (.gz, .bz2, .xz, .zst)."""
    suffix = _kind(path)[1]
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        import zstandard  # checked by _check_compression

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _chunks(f: BinaryIO, begin: int, end: int | None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of f from byte begin to end (None: its end), CHUNK_BYTES at a time, each ending a line."""
    if f.tell() != begin:
        f.seek(begin)
    pos = begin
    while end is None or pos < end:
        chunk = f.read(CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - pos))
        if not chunk:
            return
        if not chunk.endswith(b"\n"):
            chunk += f.readline()  # never past end: end is a line start or the end of f
        yield pos, chunk
        pos += len(chunk)


def _decode(cfg: SourceConfig, path: str, offset: int, raw: bytes) -> str:
    try:
        return _universal(raw.decode("utf-8", errors=cfg.decode_errors))
    except UnicodeDecodeError as e:
        raise DataError(
            f"{cfg.field('dataset')}: '{path}' is not valid UTF-8 (byte {offset + e.start}: "
            f"{raw[e.start:e.start + 1]!r}); convert it, or pass --data.decode_errors replace"
        ) from None


def _text_units(cfg: SourceConfig, path: str) -> list[Callable[[], Iterator[str]]]:
    """The units of one text file read by txt_documents: one when compressed or for "file", else byte ranges."""
    if _kind(path)[1] or cfg.txt_documents == "file":
        return [functools.partial(_text_docs, cfg, path, 0, 1)]
    n = max(1, -(-os.path.getsize(path) // UNIT_BYTES))
    return [functools.partial(_text_docs, cfg, path, i, n) for i in range(n)]


def _byte_range(f: BinaryIO, path: str, i: int, n: int, cut) -> tuple[int, int | None]:
    """Bytes [begin, end) of unit i of n of f: from cut(f, i * UNIT_BYTES) to the next unit's begin."""
    if n == 1:
        return 0, None
    size = os.path.getsize(path)
    begin = 0 if i == 0 else min(size, cut(f, i * UNIT_BYTES))
    return begin, size if i == n - 1 else min(size, cut(f, (i + 1) * UNIT_BYTES))


def _text_docs(cfg: SourceConfig, path: str, i: int, n: int) -> Iterator[str]:
    """Documents of unit i of n of a text file: the whole file, its lines, or its paragraphs.

    Text mode's universal newlines, as datasets' text builder read it; a whitespace-only
    line is a blank line.
    """
    with _open_binary(path) as f:
        begin, end = _byte_range(f, path, i, n, _line_start if cfg.txt_documents == "line" else _paragraph_cut)
        texts = (_decode(cfg, path, offset, raw) for offset, raw in _chunks(f, begin, end))
        if cfg.txt_documents == "file":
            text = "".join(texts)
            if text:
                yield text
        elif cfg.txt_documents == "line":
            for text in texts:
                yield from (line for line in text.split("\n") if line)
        else:
            carry = ""
            for text in texts:
                text = "\n".join(line if line.strip() else "" for line in text.split("\n"))
                pieces = (carry + text).split("\n\n")
                carry = pieces.pop()
                yield from (p for p in pieces if p)
            if carry:
                yield carry


def _jsonl_units(cfg: SourceConfig, path: str, check_column: bool) -> list[Callable[[], Iterator[str]]]:
    """Byte ranges of one uncompressed .jsonl file, cut between lines; check_column: the source's first file."""
    n = max(1, -(-os.path.getsize(path) // UNIT_BYTES))
    return [functools.partial(_jsonl_docs, cfg, path, i, n, check_column and i == 0) for i in range(n)]


def _jsonl_docs(cfg: SourceConfig, path: str, i: int, n: int, check_column: bool) -> Iterator[str]:
    """Texts of unit i of n of a .jsonl file (one JSON object per line; blank lines skipped).

    check_column: the first row must hold the text column (as datasets' reader requires of
    the source's first row); elsewhere a row without it is no document.
    """
    with open(path, "rb") as f:
        begin, end = _byte_range(f, path, i, n, _line_start)
        for offset, chunk in _chunks(f, begin, end):
            if offset == 0 and chunk.startswith(codecs.BOM_UTF8):
                chunk, offset = chunk[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
            for line in chunk.split(b"\n"):
                at, offset = offset, offset + len(line) + 1
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.decode("utf-8"))
                except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
                    raise DataError(f"{cfg.field('dataset')}: '{path}' byte {at}: not a JSON object "
                                    f"({type(e).__name__}: {str(e)[:120]}); fix the line or remove it") from None
                if not isinstance(row, dict):
                    raise DataError(f"{cfg.field('dataset')}: '{path}' byte {at}: a JSON {type(row).__name__}, "
                                    f"not an object; give one object per line, text in {cfg.field('text_column')}")
                if check_column:
                    _check_column(cfg, row)
                    check_column = False
                text = _text_value(cfg, row.get(cfg.text_column))
                if text:
                    yield text


def _parquet_units(cfg: SourceConfig, path: str) -> list[Callable[[], Iterator[str]]]:
    """One .parquet file's row groups, in runs of about UNIT_BYTES (their uncompressed size)."""
    import pyarrow.parquet as pq

    meta = _guarded(cfg, lambda: pq.ParquetFile(path).metadata)
    runs, size = [], UNIT_BYTES
    for g in range(meta.num_row_groups):
        if size >= UNIT_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(g)
        size += meta.row_group(g).total_byte_size
    return [functools.partial(_parquet_docs, cfg, path, tuple(groups)) for groups in runs]


def _parquet_docs(cfg: SourceConfig, path: str, groups: tuple[int, ...]) -> Iterator[str]:
    """Texts of the row groups `groups` of a .parquet file, the text column only, 1,024 rows at a time."""
    import pyarrow.parquet as pq

    pf = _guarded(cfg, lambda: pq.ParquetFile(path))
    _check_column(cfg, dict.fromkeys(pf.schema_arrow.names))
    batches = pf.iter_batches(batch_size=1024, row_groups=list(groups), columns=[cfg.text_column])
    for batch in _guarded(cfg, lambda: iter(batches)):
        for value in batch.column(0).to_pylist():
            text = _text_value(cfg, value)
            if text:
                yield text


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


def _check_column(cfg: SourceConfig, row: dict) -> None:
    if cfg.text_column not in row:
        raise DataError(
            f"{cfg.field('text_column')}: column '{cfg.text_column}' not in {cfg.dataset} (columns: "
            f"{sorted(row)}); set {cfg.field('text_column')}"
        )


def _text_value(cfg: SourceConfig, text) -> str | None:
    if text is not None and not isinstance(text, str):
        raise DataError(f"{cfg.field('text_column')}: column '{cfg.text_column}' of {cfg.dataset} holds "
                        f"{type(text).__name__}, not text; name a string column")
    return text


def _texts(cfg: SourceConfig, open_rows) -> Iterator[str]:
    it = _guarded(cfg, lambda: iter(open_rows()))
    first = True
    while True:
        row = _guarded(cfg, lambda: next(it, None))
        if row is None:
            return
        if first:
            _check_column(cfg, row)
        first = False
        text = _text_value(cfg, row[cfg.text_column])
        if text:
            yield text


def iter_documents(cfg: SourceConfig) -> Iterator[str]:
    """Yield the source's document texts (str) in order, at most max_documents of them (0: all).

    Raises DataError for a missing path, an unknown file type or a missing text column.
    """
    docs = (text for unit in source_units(cfg) for text in unit())
    yield from itertools.islice(docs, cfg.max_documents or None)

