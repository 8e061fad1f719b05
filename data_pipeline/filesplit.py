"""One local data file read as several work units, and the reading rules they share with sources.py.

A big uncompressed .jsonl is cut into byte ranges of about UNIT_BYTES between lines, a .txt
(txt_documents "line" or "blank_line") between lines or between paragraphs, a .parquet into
runs of row groups. A cut depends on the file alone, and the units read in order give exactly
the documents of the whole file as `datasets` reads it, so the token stream is the same
whatever number of processes share the units (tests/test_data.py checks both against
`datasets`). Text is read in universal-newline mode, as `datasets`' text builder does; a
whitespace-only line is a blank line.
"""
from __future__ import annotations

import bz2
import codecs
import functools
import gzip
import io
import json
import lzma
import os
from typing import BinaryIO, Callable, Iterator

from data import DataError, SourceConfig

COMPRESSED = {".gz": "gzip", ".zst": "zstandard", ".bz2": "bz2", ".xz": "lzma"}
"""Compression suffixes `datasets` reads, and the module each needs."""
KINDS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File extensions read, and the kind of reader each takes."""


def file_kind(path: str) -> tuple[str, str]:
    """(file extension without a compression suffix, compression suffix or '') of path, lower case."""
    stem, ext = os.path.splitext(path.lower())
    if ext in COMPRESSED:
        return os.path.splitext(stem)[1], ext
    return ext, ""


UNIT_BYTES = 32 << 20
"""Bytes of one uncompressed .jsonl or split .txt file per work unit, and of parquet row groups (uncompressed size)."""
CHUNK_BYTES = 8 << 20
"""Bytes read at a time inside a unit (then up to the end of the line): memory stays bounded."""


def first_byte(cfg: SourceConfig, path: str) -> bytes:
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
    suffix = file_kind(path)[1]
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".zst":
        import zstandard  # checked by sources.check_source

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


def text_units(cfg: SourceConfig, path: str) -> list[Callable[[], Iterator[str]]]:
    """The units of one text file read by txt_documents: one when compressed or for "file", else byte ranges."""
    if file_kind(path)[1] or cfg.txt_documents == "file":
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


def jsonl_units(cfg: SourceConfig, path: str, first_file: bool) -> list[Callable[[], Iterator[str]]]:
    """Byte ranges of one uncompressed .jsonl file, cut between lines; first_file: the source's first file."""
    n = max(1, -(-os.path.getsize(path) // UNIT_BYTES))
    return [functools.partial(_jsonl_docs, cfg, path, i, n, first_file and i == 0) for i in range(n)]


def _jsonl_docs(cfg: SourceConfig, path: str, i: int, n: int, check_first: bool) -> Iterator[str]:
    """Texts of unit i of n of a .jsonl file (one JSON object per line; blank lines skipped).

    check_first: the first row must hold the text column (as datasets' reader requires of
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
                if check_first:
                    check_column(cfg, row)
                    check_first = False
                text = text_value(cfg, row.get(cfg.text_column))
                if text:
                    yield text


def parquet_units(cfg: SourceConfig, path: str) -> list[Callable[[], Iterator[str]]]:
    """One .parquet file's row groups, in runs of about UNIT_BYTES (their uncompressed size)."""
    import pyarrow.parquet as pq

    meta = guarded(cfg, lambda: pq.ParquetFile(path).metadata)
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

    pf = guarded(cfg, lambda: pq.ParquetFile(path))
    check_column(cfg, dict.fromkeys(pf.schema_arrow.names))
    batches = pf.iter_batches(batch_size=1024, row_groups=list(groups), columns=[cfg.text_column])
    for batch in guarded(cfg, lambda: iter(batches)):
        for value in batch.column(0).to_pylist():
            text = text_value(cfg, value)
            if text:
                yield text


def guarded(cfg: SourceConfig, fn):
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


def check_column(cfg: SourceConfig, row: dict) -> None:
    """Raise DataError naming data.text_column when row (a dict, or the column names as keys) lacks it."""
    if cfg.text_column not in row:
        raise DataError(
            f"{cfg.field('text_column')}: column '{cfg.text_column}' not in {cfg.dataset} (columns: "
            f"{sorted(row)}); set {cfg.field('text_column')}"
        )


def text_value(cfg: SourceConfig, text) -> str | None:
    """text (a row's text column) itself; DataError naming the column when it is neither a str nor None."""
    if text is not None and not isinstance(text, str):
        raise DataError(f"{cfg.field('text_column')}: column '{cfg.text_column}' of {cfg.dataset} holds "
                        f"{type(text).__name__}, not text; name a string column")
    return text
