"""The ``tokens`` format: a local parquet/arrow dataset's column of token ids (data.token_column), copied once.

Arrow rows are not a flat stream that can be memory-mapped, so preparation copies them into
the run's stream (RUN_DIR/data/sources/), one work unit per file over the ranks (prepare.py),
with the EOS id after each row that lacks it; the other formats are read in place
(pretokenized.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import BinaryIO, Iterator

import numpy as np

from data import DataError
from data_pipeline.pretokenized import expand_files

TOKEN_FILES = (".parquet", ".arrow")
"""Files of a 'tokens' source: parquet (any writer), or arrow IPC files/streams (datasets' save_to_disk shards)."""


def token_files(src) -> list[str]:
    """The local parquet/arrow files of a 'tokens' source (a file, a folder, a glob), sorted; DataError if none, or if
    one lacks data.token_column or holds something else than lists of integers there (read from the schema, no rows).
    """
    import pyarrow as pa
    files = [f for f in expand_files(src, TOKEN_FILES) if f.endswith(TOKEN_FILES)]
    if not files:
        raise DataError(f"{src.field('dataset')}: '{src.dataset}' holds no .parquet or .arrow file; a 'tokens' "
                        f"source is a local dataset with a token-id column (download a hub dataset first)")
    for f in files:
        schema = _schema(f)
        if src.token_column not in schema.names:
            raise DataError(f"{src.field('token_column')}: '{f}' has no column {src.token_column!r} (it has "
                            f"{', '.join(schema.names[:8])}); name the column of the token ids")
        kind = schema.field(src.token_column).type
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if not (is_list and pa.types.is_integer(kind.value_type)):  # a text column would fail mid-copy
            raise DataError(f"{src.field('token_column')}: column {src.token_column!r} of '{f}' holds {kind}, not "
                            f"lists of integer token ids; name the column of the token ids")
    return files


def _schema(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq
    if path.endswith(".parquet"):
        return pq.read_schema(path)
    try:
        return pa.ipc.open_file(path).schema
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(path).schema


def _batches(path: str, column: str):
    """The token-id column of one file, record batch by record batch (bounded memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if path.endswith(".parquet"):
        yield from (b.column(0) for b in pq.ParquetFile(path).iter_batches(columns=[column], batch_size=1024))
        return
    try:
        reader = pa.ipc.open_file(path)
        yield from (reader.get_batch(i).column(column) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        yield from (b.column(column) for b in pa.ipc.open_stream(path))


def copy_rows(path: str, column: str, out: BinaryIO, eos_id: int, dtype: str, vocab_size: int) -> tuple[int, int]:
    """Append one file's rows of token ids to out as a flat dtype stream, eos_id after each row that does not already
    end with it (rows are documents; token_files checked that they are lists of integers). Returns (n_tokens,
    n_documents); DataError for an id outside [0, vocab_size) (the tokenizer's)."""
    n_tokens = n_docs = 0
    for column_batch in _batches(path, column):
        rows: Iterator = column_batch.to_pylist()
        parts = []
        for ids in rows:
            if not ids:
                continue
            parts.append(np.asarray(ids if ids[-1] == eos_id else [*ids, eos_id], dtype=np.int64))
        if not parts:
            continue
        stream = np.concatenate(parts)
        if stream.max() >= vocab_size or stream.min() < 0:
            bad = int(stream.max()) if stream.max() >= vocab_size else int(stream.min())
            raise DataError(f"'{path}': column {column!r} holds token id {bad} outside the tokenizer's "
                            f"{vocab_size} ids; give the tokenizer it was made with")
        out.write(stream.astype(dtype).tobytes())
        n_tokens, n_docs = n_tokens + stream.size, n_docs + len(parts)
    return n_tokens, n_docs


def files_record(src) -> dict:
    """What a 'tokens' source's materialised stream was made from: {"n", "bytes", "digest"} of its files' paths and
    sizes (as sources.files_record for text)."""
    listing = [(f, os.path.getsize(f)) for f in token_files(src)]
    return {"n": len(listing), "bytes": sum(n for _, n in listing),
            "digest": hashlib.sha1(json.dumps(listing).encode()).hexdigest()}


def rank_units(src, rank: int, world: int) -> tuple[int, Iterator[tuple[int, str]]]:
    """prepare.py's work units of a 'tokens' source: (number of files, [(unit, file path)] of rank's share: the
    units u with u % world == rank)."""
    files = token_files(src)
    return len(files), ((u, files[u]) for u in range(rank, len(files), world))
