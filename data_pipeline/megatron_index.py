"""Megatron-Core's MMIDIDX index (``PREFIX.idx`` beside ``PREFIX.bin``), read and written with numpy.

Its layout is Megatron-Core's (megatron/core/datasets/indexed_dataset.py, _IndexWriter), version 1.
Reading it is pretokenized.py's (the ``megatron`` format); writing it is prepare.py's with
``data.prepared_format megatron``, so what we tokenize other tools read.
"""
from __future__ import annotations

import contextlib
import os
import struct

import numpy as np

from data import DataError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
"""Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py); 6 and 7 are not token ids."""

def read_megatron_index(path: str, data: bytes | None = None) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths int32, sequence byte pointers int64, document indices int64) of a Megatron .idx.

    data: the file's bytes when they were fetched (an index in an object store); else the file is mapped.

    Layout (Megatron-Core, megatron/core/datasets/indexed_dataset.py, _IndexWriter): the magic
    b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count <Q, document count <Q, then
    int32 lengths[sequence count], int64 pointers[sequence count] (bytes into .bin), int64
    document indices[document count] (the first sequence of each document, then the count).
    Raises DataError for another magic or version, an unknown or non-integer dtype, or a
    file shorter than its counts say.
    """
    with open(path, "rb") if data is None else contextlib.nullcontext() as f:
        head = f.read(34) if data is None else data[:34]
        if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
            raise DataError(f"'{path}' is not a Megatron MMIDIDX index (magic {head[:9]!r}); write it with "
                            f"Megatron-Core's IndexedDatasetBuilder or give the right --data.format")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != MEGATRON_VERSION:
            raise DataError(f"'{path}' is a Megatron index of version {version}; this reader knows version "
                            f"{MEGATRON_VERSION} (Megatron-Core's): write it again with its IndexedDatasetBuilder")
        if code not in MEGATRON_DTYPES or code in (6, 7):
            raise DataError(f"'{path}' holds dtype code {code}, not integer token ids (1-5, 8 of Megatron-Core's "
                            f"DType); tokenize into an integer dtype, as preprocess_data.py does")
    size, need = os.path.getsize(path) if data is None else len(data), 34 + n_seq * 12 + n_doc * 8
    if size < need:
        raise DataError(f"'{path}' is {size} bytes, shorter than the {need} its {n_seq} sequences and "
                        f"{n_doc} document indices need; the index is damaged: copy it again")

    def part(dtype, offset: int, count: int) -> np.ndarray:  # mapped, as Megatron-Core maps it: an index is GBs
        if not count:
            return np.zeros(0, dtype)
        if data is not None:
            return np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    lengths, pointers = part(np.int32, 34, n_seq), part(np.int64, 34 + n_seq * 4, n_seq)
    docs = part(np.int64, 34 + n_seq * 12, n_doc)
    return np.dtype(MEGATRON_DTYPES[code]), lengths, pointers, docs


MEGATRON_CODES = {"uint16": 8, "uint32": 4}
"""The Megatron dtype codes of prepared streams: uint16, or int32 for uint32 files (the same bytes for ids below
2**31; Megatron-Core has no uint32 code)."""


def write_megatron_index(path: str, lengths: np.ndarray, dtype: str) -> None:
    """A Megatron-Core MMIDIDX index (version 1, one sequence per document) for the flat token file whose documents
    have these lengths, written to path (through a .tmp file, renamed into place). Layout: read_megatron_index."""
    lengths = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64) * itemsize
    with open(path + ".tmp", "wb") as f:
        f.write(MEGATRON_MAGIC + struct.pack("<QBQQ", MEGATRON_VERSION, MEGATRON_CODES[dtype], len(lengths),
                                             len(lengths) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    os.replace(path + ".tmp", path)


def index_streams(work: str, meta: dict, eos_id: int, block: int = 1 << 26) -> None:
    """prepare.py with data.prepared_format megatron: sources/NAME-KEY.idx beside every prepared stream that has
    none, its documents ended by eos_id (one pass over the stream, block tokens at a time), so NAME-KEY is a
    Megatron prefix of the same tokens."""
    for record in meta["sources"].values():
        if "file" not in record or os.path.exists(os.path.join(work, record["file"])[:-4] + ".idx"):
            continue
        path = os.path.join(work, record["file"])
        tokens = np.memmap(path, dtype=record["dtype"], mode="r")
        ends = [np.flatnonzero(tokens[a:a + block] == eos_id) + a + 1 for a in range(0, tokens.size, block)]
        ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        if ends.size == 0 or ends[-1] != tokens.size:  # a stream always ends with EOS; guard a legacy one
            ends = np.append(ends, tokens.size)
        write_megatron_index(path[:-4] + ".idx", np.diff(ends, prepend=0), record["dtype"])
