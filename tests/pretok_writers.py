"""Writers of the formats others tokenize into, for the tests' fixtures (reference first: the reader must give back
what these were given, document by document).

- numpy: as OLMo/Dolma write them: the documents, each ended by the EOS id, concatenated and written with
  ``ndarray.tofile`` (a raw memmap, no .npy header), as OLMo-core's tests do with ``np.memmap``.
- megatron: following Megatron-Core's ``IndexedDatasetBuilder`` (megatron/core/datasets/indexed_dataset.py,
  ``_IndexWriter.write``): the tokens back to back in PREFIX.bin; PREFIX.idx holds the magic ``MMIDIDX\\x00\\x00``,
  version <Q 1, the dtype code <B, the sequence count <Q, the document count <Q (sequences + 1), int32 lengths,
  int64 byte pointers, int64 document indices. tests/test_pretokenized.py checks it against the real builder
  when ``megatron-core`` is importable (``pip install --no-deps megatron-core``: its dependencies would pull
  another torch).
- datatrove: following datatrove's ``TokenizedFile`` (src/datatrove/pipeline/tokens/tokenizer.py: ``write``
  packs ``<H`` tokens, ``close`` writes the document ends in tokens as ``<Q`` into FILE.ds.index).
"""
from __future__ import annotations

import struct

import numpy as np

MEGATRON_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
                  np.dtype(np.int64): 5, np.dtype(np.uint16): 8}


def write_numpy(path: str, docs: list, dtype=np.uint16) -> None:
    """docs (each already ended by its EOS id) as one flat raw token file."""
    np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tofile(path)


def write_megatron(prefix: str, docs: list, dtype=np.uint16, version: int = 1, magic: bytes = b"MMIDIDX\x00\x00"
                   ) -> None:
    """docs as PREFIX.bin + PREFIX.idx, one sequence per document (Megatron-Core's add_document of one item)."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64) * dtype.itemsize
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes(order="C"))


def write_datatrove(path: str, docs: list) -> None:
    """docs (each already ended by its EOS, as DocumentTokenizer's post-processor adds it) as FILE.ds + FILE.ds.index."""
    ends, n = [], 0
    with open(path, "wb") as f:
        for d in docs:
            f.write(struct.pack("<%sH" % len(d), *[int(t) for t in d]))
            n += len(d)
            ends.append(n)
    with open(path + ".index", "wb") as f:
        f.write(struct.pack("<%sQ" % len(ends), *ends))
