"""Corpora tokenized elsewhere, read in place: Megatron, OLMo/Dolma numpy and datatrove token files.

Each format is small enough to read with numpy, so none brings its library in (importing
Megatron-Core's indexed_dataset imports megatron.core whole, 6.5 s here, and its package
requires a torch that pip would resolve against ours; datatrove brings its pipeline stack):
only the index files are parsed at start, and the token files are mapped with
``numpy.memmap``, never copied. The ``tokens`` format (a parquet/arrow column of ids) is copied
once by prepare.py instead (token_rows.py): arrow rows are not a flat stream.

| format      | token files                  | index                                   | dtype               |
|-------------|------------------------------|-----------------------------------------|---------------------|
| ``megatron`` | ``PREFIX.bin``               | ``PREFIX.idx`` (Megatron-Core MMIDIDX)   | from the index      |
| ``numpy``    | ``*.npy`` raw memmaps (OLMo)  | none: documents end with the EOS id      | ``data.token_dtype`` |
| ``datatrove``| ``*.ds`` (DocumentTokenizer) | ``*.ds.index``: uint64 document ends    | ``data.token_dtype``/vocab |

A source is the logical concatenation of its shards in sorted path order, the same "flat
stream, every document followed by the EOS id" that prepare.py writes for raw text, so it is
cut into the same windows (data.py): a window runs across a document boundary (the EOS in it
marks the boundary for document_mask) and across a shard boundary alike (every shard ends with
a document's EOS, checked at start).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import struct
from typing import Callable

import numpy as np

from data import DataError, token_dtype
from data_pipeline import ranged
from data_pipeline.streams import TokenStream
from storage.fs import is_url

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
"""Megatron-Core's DType codes (megatron/core/datasets/indexed_dataset.py); 6 and 7 are not token ids."""

FULL_SCAN_TOKENS = 1 << 26
"""Sources of up to this many tokens are scanned whole at start (a fraction of a second from the page cache);
larger ones in SCAN_SAMPLES evenly spaced blocks, and every window is checked again when a batch is built."""
SCAN_SAMPLES, SCAN_BLOCK = 256, 1 << 16
REMOTE_SCAN_SAMPLES, REMOTE_SCAN_BLOCK = 64, 1 << 12
"""The start-up scan of a source in an object store: 64 spread blocks of 4,096 tokens (a full scan would download
it; every window is checked when a batch is built, as for a large local source)."""
EOS_SAMPLES, REMOTE_EOS_SAMPLES = 1024, 64
"""Document ends read at start to check that documents end with the tokenizer's EOS id (REMOTE_: of a source in an
object store, where each is a request: another tokenizer's EOS fails at every document end, so 64 find it)."""


class Shard:
    """One token file of a source: path, dtype, n_tokens, and doc_ends (token offsets where documents end, or None)."""

    def __init__(self, path: str, dtype: np.dtype, n_tokens: int, doc_ends: np.ndarray | None, index: str | None,
                 index_sha256: str | None = None):
        """index_sha256: the index's checksum when its bytes were fetched (an object store), else read when asked."""
        self.path, self.dtype, self.n_tokens, self.doc_ends, self.index = path, np.dtype(dtype), n_tokens, doc_ends, index
        self.index_sha256 = index_sha256

    def record(self) -> list:
        """[path, dtype name, n_tokens]: what meta.json keeps to map the shard again."""
        return [self.path, self.dtype.name, self.n_tokens]


def _field(src) -> str:
    return src.field("dataset")


def _isfile(path: str) -> bool:
    return ranged.isfile(path) if is_url(path) else os.path.isfile(path)


def _getsize(path: str) -> int:
    return ranged.size(path) if is_url(path) else os.path.getsize(path)


def expand_files(src, suffixes: tuple[str, ...]) -> list[str]:
    """The files of src.dataset: a file, a folder (its files ending in one of suffixes) or a glob; sorted, absolute.

    An ``s3://`` URL is listed through fsspec (ranged.expand), except for the tokens format, whose
    files preparation reads with pyarrow from local paths. Raises DataError naming the field when
    nothing matches, or for a URL of the tokens format.
    """
    if is_url(src.dataset) and src.format == "tokens":
        raise DataError(f"{_field(src)}: '{src.dataset}' is a URL, and a tokens source is copied by preparation from "
                        f"local files; download it first (e.g. aws s3 sync) or mount the bucket")
    if is_url(src.dataset):
        found = ranged.expand(src.dataset, suffixes)
    else:
        spec = os.path.expanduser(src.dataset)
        if os.path.isdir(spec):
            found = [f for s in suffixes for f in glob.glob(os.path.join(spec, "*" + s))]
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = glob.glob(spec) or [f for s in suffixes for f in glob.glob(spec + s)]
        found = sorted({os.path.abspath(f) for f in found if os.path.isfile(f)})  # meta.json maps them from any cwd
    if not found:
        where = " in the bucket (listed through AWS_ENDPOINT_URL)" if is_url(src.dataset) else ""
        raise DataError(f"{_field(src)}: '{src.dataset}' matches no {src.format} file ({'/'.join(suffixes)}){where}; "
                        f"give a file, a folder or a glob of them")
    return found


def megatron_prefixes(src) -> list[str]:
    """Prefixes (paths without .bin/.idx) of a megatron source: a prefix, a glob of prefixes, a folder of pairs.

    Raises DataError for nothing found, or a .bin without its .idx (and the other way round).
    """
    files = expand_files(src, (".idx", ".bin"))
    prefixes = sorted({f[:-4] for f in files if f.endswith((".bin", ".idx"))})
    if not prefixes:
        raise DataError(f"{_field(src)}: '{src.dataset}' matches no Megatron .bin/.idx pair; give the path without "
                        f".bin/.idx, as Megatron's --data-path takes it")
    for p in prefixes:
        for have, need in ((".bin", ".idx"), (".idx", ".bin")):
            if _isfile(p + have) and not _isfile(p + need):
                raise DataError(f"{_field(src)}: '{p}{have}' has no '{p}{need}' beside it; a megatron source needs "
                                f"both (Megatron-Core's IndexedDatasetBuilder writes them together)")
    return prefixes


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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _megatron_shard(prefix: str, want: str, data: bytes | None = None) -> Shard:
    dtype, lengths, pointers, docs = read_megatron_index(prefix + ".idx", data)
    digest = hashlib.sha256(data).hexdigest() if data is not None else None
    if len(lengths) == 0:
        return Shard(prefix + ".bin", dtype, 0, np.zeros(0, np.int64), prefix + ".idx", digest)  # refused as empty
    if want and np.dtype(want) != dtype:
        raise DataError(f"'{prefix}.idx' holds {dtype.name} tokens but data.token_dtype is {want}; leave "
                        f"data.token_dtype empty for megatron (the index says) or make them agree")
    n = int(lengths.astype(np.int64).sum())
    expect = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize
    if not np.array_equal(pointers, expect):
        raise DataError(f"'{prefix}.idx' has sequences that are not back to back in its .bin; rewrite it with "
                        f"Megatron-Core's IndexedDatasetBuilder")
    size = _getsize(prefix + ".bin")
    if size != n * dtype.itemsize:
        raise DataError(f"'{prefix}.bin' holds {size:,} bytes but its .idx says {n * dtype.itemsize:,} ({n:,} "
                        f"{dtype.name} tokens): {'truncated' if size < n * dtype.itemsize else 'longer'}; copy the "
                        f"pair again")
    if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
        raise DataError(f"'{prefix}.idx': its document indices do not run from 0 up to its {len(lengths)} "
                        f"sequences; the index is damaged: copy it again")
    ends = np.cumsum(lengths, dtype=np.int64)[docs[1:] - 1] if len(lengths) else np.zeros(0, np.int64)
    return Shard(prefix + ".bin", dtype, n, ends, prefix + ".idx", digest)


def _numpy_shard(path: str, dtype: np.dtype, head: bytes | None = None) -> Shard:
    """head: the file's first 6 bytes when they were fetched (an object store)."""
    size = _getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"'{path}' is {size:,} bytes, not a whole number of {dtype.name} tokens; check "
                        f"data.token_dtype (uint16 or uint32)")
    with open(path, "rb") if head is None else contextlib.nullcontext() as f:
        if (f.read(6) if head is None else head) == b"\x93NUMPY":
            raise DataError(f"'{path}' is an np.save file (with a header); data.format numpy reads raw token "
                            f"memmaps as OLMo writes them (array.tofile or np.memmap)")
    return Shard(path, dtype, size // dtype.itemsize, None, None)


def _datatrove_shard(path: str, dtype: np.dtype, data: bytes | None = None) -> Shard:
    """data: the index's bytes when they were fetched (an object store); else it is read from the file."""
    index = path + ".index"
    if data is None and not _isfile(index):
        raise DataError(f"'{path}' has no '{index}' beside it; datatrove's DocumentTokenizer writes the document "
                        f"ends there (save_index)")
    size, isize = _getsize(path), os.path.getsize(index) if data is None else len(data)
    if isize % 8:
        raise DataError(f"'{index}' is {isize} bytes, not a whole number of uint64 document ends; it is damaged")
    ends = (np.fromfile(index, dtype="<u8") if data is None else np.frombuffer(data, dtype="<u8")).astype(np.int64)
    if ends.size and (np.any(np.diff(ends) < 0) or ends[0] < 0):
        raise DataError(f"'{index}' has document ends that go backwards; it is damaged")
    n = int(ends[-1]) if ends.size else 0
    if size != n * dtype.itemsize:
        raise DataError(f"'{path}' is {size:,} bytes but '{index}' ends its last document at token {n:,} "
                        f"({n * dtype.itemsize:,} bytes of {dtype.name}): "
                        f"{'truncated' if size < n * dtype.itemsize else 'longer, or another data.token_dtype'}")
    return Shard(path, dtype, n, ends, index, hashlib.sha256(data).hexdigest() if data is not None else None)


def open_shards(src, vocab_size: int) -> list[Shard]:
    """Every shard of a pre-tokenized source src (SourceConfig of format megatron, numpy or datatrove), sorted by path.

    vocab_size: the tokenizer's, for the default dtype of datatrove files (numpy needs data.token_dtype).
    Reads only indexes and file sizes: from an object store, the sizes from one listing and the
    indexes (and numpy files' first bytes) in one concurrent batch. Raises DataError for bad input
    (the message of each check).
    """
    want, remote = src.token_dtype or "", is_url(src.dataset)
    if src.format == "megatron":
        prefixes = megatron_prefixes(src)
        indexes = _fetch(src, [p + ".idx" for p in prefixes]) if remote else {}
        shards = [_megatron_shard(p, want, indexes.get(p + ".idx")) for p in prefixes]
    elif src.format == "numpy":
        if not want:  # a wrong guess reads uint32 files as pairs of uint16 ids, refused later for the wrong reason
            raise DataError(f"{src.field('token_dtype')}: a numpy source's files do not record their dtype; give "
                            f"--data.token_dtype uint16 or uint32, the one they were written with")
        files = expand_files(src, (".npy",))
        heads = {}
        if remote:
            heads = {f: b"" for f in files}
            heads.update(zip((f for f in files if ranged.size(f) >= 6),
                             _read_ranges(src, [(f, 0, 6) for f in files if ranged.size(f) >= 6])))
        shards = [_numpy_shard(p, np.dtype(want), heads.get(p)) for p in files]
    else:
        dtype = np.dtype(want or token_dtype(vocab_size))  # DocumentTokenizer's token_size rule (datatrove 0.10)
        # DocumentTokenizer leaves FILE.ds.index, .ds.loss and .ds.metadata beside each FILE.ds: a glob of the
        # folder matches them too, and only the .ds files hold tokens
        files = [p for p in expand_files(src, (".ds",)) if p.endswith(".ds")]
        if not files:
            raise DataError(f"{_field(src)}: '{src.dataset}' matches no datatrove .ds file; give a .ds file, a "
                            f"folder or a glob of them")
        indexes = _fetch(src, [p + ".index" for p in files if ranged.isfile(p + ".index")]) if remote else {}
        shards = [_datatrove_shard(p, dtype, indexes.get(p + ".index")) for p in files]
    for s in shards:
        if s.n_tokens == 0:
            raise DataError(f"{_field(src)}: shard '{s.path}' holds no token; remove it or regenerate it")
    return shards


def _fetch(src, urls: list[str]) -> dict[str, bytes]:
    """ranged.fetch, its failures as the DataError of the source's field."""
    try:
        return ranged.fetch(urls)
    except OSError as e:
        raise DataError(f"{_field(src)}: reading the indexes of '{src.dataset}' failed ({e}); check the bucket and "
                        f"AWS_ENDPOINT_URL") from None


def _read_ranges(src, requests: list[tuple[str, int, int]]) -> list[bytes]:
    try:
        return ranged.read_ranges(requests)
    except OSError as e:
        raise DataError(f"{_field(src)}: reading '{src.dataset}' failed ({e}); check the bucket and "
                        f"AWS_ENDPOINT_URL") from None


def identity(shards: list[Shard]) -> dict:
    """What a pre-tokenized source is: {"n" shards, "bytes" of token files, "digest" of (path, size, index sha256)}.

    A resume compares it with the one recorded in meta.json and refuses a changed corpus.
    """
    listing = [(s.path, _getsize(s.path), s.index_sha256 or (_sha256(s.index) if s.index else None)) for s in shards]
    return {"n": len(listing), "bytes": sum(size for _, size, _ in listing),
            "digest": hashlib.sha256(json.dumps(listing).encode()).hexdigest()}


def _blocks(n: int, remote: bool = False) -> list[tuple[int, int]]:
    """[(start, stop)] token ranges the start-up scan reads: everything, or SCAN_SAMPLES spread blocks
    (REMOTE_SCAN_SAMPLES of REMOTE_SCAN_BLOCK for a source in an object store)."""
    samples, block = (REMOTE_SCAN_SAMPLES, REMOTE_SCAN_BLOCK) if remote else (SCAN_SAMPLES, SCAN_BLOCK)
    if n <= (samples * block if remote else FULL_SCAN_TOKENS):
        return [(a, min(n, a + FULL_SCAN_TOKENS // 16)) for a in range(0, n, FULL_SCAN_TOKENS // 16)]
    starts = np.linspace(0, n - block, samples).astype(np.int64)
    return [(int(a), int(a) + block) for a in starts]


def check_ids(stream: TokenStream, vocab_size: int, where: Callable[[int], str]) -> None:
    """DataError when a token id of stream is outside [0, vocab_size) (model.vocab_size; Megatron's int dtypes can
    hold negative ids): the whole stream up to FULL_SCAN_TOKENS, else a sample (data.SourceTokens.sample checks
    every window when a batch is built); a stream in an object store is sampled from REMOTE_SCAN_SAMPLES blocks,
    fetched in one concurrent batch."""
    blocks = _blocks(stream.size, stream.remote)
    if stream.remote:
        stream.prefetch(blocks)
    for a, b in blocks:
        block = stream[a:b]
        if block.size and (int(block.max()) >= vocab_size or int(block.min()) < 0):
            at = a + int(np.argmax((block >= vocab_size) | (block < 0)))
            raise DataError(f"{where(at)} holds token id {int(stream[at:at + 1][0])}, outside the model's "
                            f"{vocab_size} ids (model.vocab_size); it was tokenized with another vocabulary: raise "
                            f"model.vocab_size or give the tokenizer it was made with")


def check_eos(src, shards: list[Shard], eos_id: int, eos_name: str) -> None:
    """DataError when documents of src do not end with eos_id: EOS_SAMPLES document ends (from the index) spread over
    the source (REMOTE_EOS_SAMPLES in an object store), or each shard's last token for numpy (the file cannot say
    where documents end)."""
    ends = [(s, int(e) - 1) for s in shards for e in (s.doc_ends if s.doc_ends is not None else [s.n_tokens])]
    n = REMOTE_EOS_SAMPLES if any(is_url(s.path) for s in shards) else EOS_SAMPLES
    pick = ends if len(ends) <= n else [ends[int(k)] for k in np.linspace(0, len(ends) - 1, n)]
    pick = [(s, pos) for s, pos in pick if pos >= 0]
    size = {id(s): s.dtype.itemsize for s, _ in pick}
    fetched = iter(_read_ranges(src, [(s.path, pos * size[id(s)], (pos + 1) * size[id(s)])
                                      for s, pos in pick if is_url(s.path)]))  # one concurrent batch
    for shard, pos in pick:
        if is_url(shard.path):
            raw = next(fetched)
        else:
            with open(shard.path, "rb") as f:  # one token each: no map (1,024 of them would hold as many descriptors)
                f.seek(pos * shard.dtype.itemsize)
                raw = f.read(shard.dtype.itemsize)
        last = int(np.frombuffer(raw, dtype=shard.dtype)[0])
        if last != eos_id:
            raise DataError(f"{_field(src)}: a document of '{shard.path}' ends at token {pos:,} with id {last}, "
                            f"not the EOS id {eos_id} ({eos_name}) of the tokenizer; give the tokenizer it was made "
                            f"with, or --data.eos_token (documents must end with it, e.g. Megatron's --append-eod)")


def describe(src, vocab_size: int) -> dict:
    """The meta.json record of a pre-tokenized source: {"format", "dtype", "n_tokens", "n_documents" (-1 for numpy:
    the file does not count them), "shards" [[path, dtype, n_tokens]], "files" (identity)}."""
    shards = open_shards(src, vocab_size)
    dtypes = sorted({s.dtype.name for s in shards})
    docs = [len(s.doc_ends) for s in shards if s.doc_ends is not None]
    return {"format": src.format, "dtype": dtypes[0] if len(dtypes) == 1 else "+".join(dtypes),
            "n_tokens": sum(s.n_tokens for s in shards), "n_documents": sum(docs) if len(docs) == len(shards) else -1,
            "shards": [s.record() for s in shards], "files": identity(shards), "config": src.reading()}


def check_source(src, tokenizer_vocab: int, model_vocab: int, eos_id: int, eos_name: str) -> list[Shard]:
    """Every start-up check of a pre-tokenized source, reading indexes, sizes and a scan (no collective); returns
    its shards. Raises DataError for bad input (missing or damaged index, size, dtype, empty shard, ids >=
    model_vocab, another EOS)."""
    shards = open_shards(src, tokenizer_vocab)
    check_eos(src, shards, eos_id, eos_name)
    stream = TokenStream([s.record() for s in shards])

    def where(at: int) -> str:
        i = int(np.searchsorted(stream.offsets, at, side="right")) - 1
        return f"{_field(src)}: '{stream.paths[i]}' (token {at - int(stream.offsets[i]):,})"

    check_ids(stream, model_vocab, where)
    return shards


def corpus_changed(src, out_dir: str, then: dict, now: dict) -> DataError:
    """The DataError of a pre-tokenized source whose files (identity: then, now) changed since the run recorded them."""
    def files(r):
        return f"{r['n']} shard{'s' if r['n'] != 1 else ''}, {r['bytes']:,} bytes"

    return DataError(f"{_field(src)}: '{src.dataset}' changed since the run recorded it in '{out_dir}' ({files(then)} "
                     f"then, {files(now)} now, or other indexes): its windows would not be the ones the checkpoints "
                     f"were trained on; restore the files, or start a new --run_dir for the new corpus")


def record_in_place(src, meta: dict, out_dir: str) -> bool:
    """prepare.py, rank 0: meta's record of a pre-tokenized source (its shards, sizes and index checksums); True when new.

    A record made earlier must still describe the files (identity): a corpus that
    changed under a run is refused, as for raw sources.
    """
    record = meta["sources"].get(src.name)
    if record is not None:
        now = identity(open_shards(src, meta["vocab_size"]))
        if record.get("files", {}).get("digest") != now["digest"]:
            raise corpus_changed(src, out_dir, record["files"], now)
        print(f"[data] source '{src.name}' ({src.dataset}) read in place, unchanged", flush=True)
        return False
    meta["sources"][src.name] = record = describe(src, meta["vocab_size"])
    print(f"[data] source '{src.name}' ({src.dataset}) read in place: {record['format']}, "
          f"{len(record['shards']):,} shard(s), {record['n_tokens']:,} {record['dtype']} tokens", flush=True)
    return True


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
