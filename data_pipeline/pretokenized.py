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

import glob
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from data import DataError, token_dtype
from data_pipeline import index_cache, ranged
from data_pipeline.index_cache import Entry
from data_pipeline.megatron_index import read_megatron_index
from data_pipeline.streams import TokenStream
from storage.fs import is_url

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
ENDS_KEPT = EOS_SAMPLES
"""Document ends a Shard keeps (and the index cache stores) per shard, evenly spaced, the last among them: check_eos
samples from them, so neither memory nor the cache grows with a shard's documents (an index of 1B documents is 8 GB
of ends)."""
READ_WHOLE = 1 << 26
"""Local indexes up to this many bytes (64 MiB) are read into memory once (parsed and hashed from the same bytes);
larger ones are mapped and hashed in blocks."""
READ_THREADS = 16
"""Local indexes read at once: a shared file system answers each open with a round trip, so 10,000 indexes read one
after the other wait 10,000 latencies."""


class Shard:
    """One token file of a source: path, dtype, n_tokens, n_docs (its documents, -1 when the file does not count
    them), and doc_ends (token offsets where documents end: all of them up to ENDS_KEPT, else ENDS_KEPT evenly
    spaced ones with the last; None for numpy)."""

    def __init__(self, path: str, dtype: np.dtype, n_tokens: int, doc_ends: np.ndarray | None, index: str | None,
                 index_sha256: str | None = None, n_docs: int | None = None):
        """index_sha256: the index's checksum when known (read with it), else read when asked; n_docs: default the
        number of doc_ends."""
        self.path, self.dtype, self.n_tokens, self.doc_ends, self.index = path, np.dtype(dtype), n_tokens, doc_ends, index
        self.index_sha256 = index_sha256
        self.n_docs = n_docs if n_docs is not None else -1 if doc_ends is None else len(doc_ends)

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
    listed = set(files)  # a folder or glob lists both files of a pair: no stat for them (10,000 pairs: 40,000 stats)

    def there(path: str) -> bool:
        return path in listed or _isfile(path)

    for p in prefixes:
        for have, need in ((".bin", ".idx"), (".idx", ".bin")):
            if there(p + have) and not there(p + need):
                raise DataError(f"{_field(src)}: '{p}{have}' has no '{p}{need}' beside it; a megatron source needs "
                                f"both (Megatron-Core's IndexedDatasetBuilder writes them together)")
    return prefixes


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _spread(ends: np.ndarray) -> np.ndarray:
    """At most ENDS_KEPT of the document ends, evenly spaced, the first and last among them (int64)."""
    if len(ends) > ENDS_KEPT:
        ends = ends[np.linspace(0, len(ends) - 1, ENDS_KEPT).astype(np.int64)]
    return np.asarray(ends, dtype=np.int64).copy()


def _index_bytes(path: str) -> bytes | None:
    """A local index's bytes when it is at most READ_WHOLE bytes (read once, parsed and hashed), else None (mapped)."""
    if os.path.getsize(path) > READ_WHOLE:
        return None
    with open(path, "rb") as f:
        return f.read()


def _megatron_entry(path: str, data: bytes | None) -> Entry:
    """What a Megatron .idx at path says (its bytes data, or read here). Raises DataError for a damaged index."""
    data = _index_bytes(path) if data is None else data
    dtype, lengths, pointers, docs = read_megatron_index(path, data)
    digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256(path)
    if len(lengths) == 0:
        return Entry(dtype.name, 0, 0, np.zeros(0, np.int64), digest)  # refused as empty
    expect = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * dtype.itemsize
    if not np.array_equal(pointers, expect):
        raise DataError(f"'{path}' has sequences that are not back to back in its .bin; rewrite it with "
                        f"Megatron-Core's IndexedDatasetBuilder")
    if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
        raise DataError(f"'{path}': its document indices do not run from 0 up to its {len(lengths)} "
                        f"sequences; the index is damaged: copy it again")
    ends = np.cumsum(lengths, dtype=np.int64)[docs[1:] - 1]
    return Entry(dtype.name, int(lengths.astype(np.int64).sum()), len(ends), _spread(ends), digest)


def _megatron_shard(prefix: str, want: str, e: Entry) -> Shard:
    """The shard of prefix from its index's entry e, checked against data.token_dtype (want) and its .bin's size."""
    dtype, n = np.dtype(e.dtype), e.n_tokens
    if n and want and np.dtype(want) != dtype:
        raise DataError(f"'{prefix}.idx' holds {dtype.name} tokens but data.token_dtype is {want}; leave "
                        f"data.token_dtype empty for megatron (the index says) or make them agree")
    size = _getsize(prefix + ".bin")
    if n and size != n * dtype.itemsize:
        raise DataError(f"'{prefix}.bin' holds {size:,} bytes but its .idx says {n * dtype.itemsize:,} ({n:,} "
                        f"{dtype.name} tokens): {'truncated' if size < n * dtype.itemsize else 'longer'}; copy the "
                        f"pair again")
    return Shard(prefix + ".bin", dtype, n, e.ends, prefix + ".idx", e.sha256, e.n_docs)


def _numpy_entry(path: str, head: bytes | None) -> Entry:
    """A numpy token file's check (head: its first 6 bytes when fetched, else read here): DataError for an np.save
    file; the entry records that it is not one (the file records no dtype, count or documents)."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(6)
    if head == b"\x93NUMPY":
        raise DataError(f"'{path}' is an np.save file (with a header); data.format numpy reads raw token "
                        f"memmaps as OLMo writes them (array.tofile or np.memmap)")
    return Entry("", -1, -1, None, None)


def _numpy_shard(path: str, dtype: np.dtype) -> Shard:
    size = _getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"'{path}' is {size:,} bytes, not a whole number of {dtype.name} tokens; check "
                        f"data.token_dtype (uint16 or uint32)")
    return Shard(path, dtype, size // dtype.itemsize, None, None)


def _datatrove_entry(index: str, data: bytes | None) -> Entry:
    """What a datatrove .ds.index says (its bytes data, or read here). Raises DataError for a damaged index."""
    data = _index_bytes(index) if data is None else data
    isize = os.path.getsize(index) if data is None else len(data)
    if isize % 8:
        raise DataError(f"'{index}' is {isize} bytes, not a whole number of uint64 document ends; it is damaged")
    ends = (np.fromfile(index, dtype="<u8") if data is None else np.frombuffer(data, dtype="<u8")).astype(np.int64)
    if ends.size and (np.any(np.diff(ends) < 0) or ends[0] < 0):
        raise DataError(f"'{index}' has document ends that go backwards; it is damaged")
    digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256(index)
    return Entry("", int(ends[-1]) if ends.size else 0, len(ends), _spread(ends), digest)


def _datatrove_shard(path: str, dtype: np.dtype, e: Entry) -> Shard:
    size, n = _getsize(path), e.n_tokens
    if size != n * dtype.itemsize:
        raise DataError(f"'{path}' is {size:,} bytes but '{path}.index' ends its last document at token {n:,} "
                        f"({n * dtype.itemsize:,} bytes of {dtype.name}): "
                        f"{'truncated' if size < n * dtype.itemsize else 'longer, or another data.token_dtype'}")
    return Shard(path, dtype, n, e.ends, path + ".index", e.sha256, e.n_docs)


def _entries(src, paths: list[str], parse: Callable[[str, bytes | None], Entry], head: int = 0) -> list[Entry]:
    """The index_cache entries of the files at paths: from the cache by content key, the rest parsed (and cached):
    fetched in one concurrent batch from an object store (their first head bytes only, when head), read by
    READ_THREADS threads locally. Raises DataError (parse's, or a failed fetch's)."""
    keys = [index_cache.key(p) for p in paths]  # before the reads: a file changed after it gets a new key next time
    got = {k: index_cache.get(k) for k in keys}
    missing = [k for k in keys if got[k] is None]
    if missing and is_url(src.dataset):
        if head:
            fetched = dict(zip((k[0] for k in missing if k[1] >= head),
                               _read_ranges(src, [(k[0], 0, head) for k in missing if k[1] >= head])))
        else:
            fetched = _fetch(src, [k[0] for k in missing])
        parsed = [parse(k[0], fetched.get(k[0], b"")) for k in missing]
    elif missing:
        # a run of files per thread, not a task per file: a task costs more than reading a small index from the
        # page cache; results (and the first bad file's error) come back in path order
        step = -(-len(missing) // READ_THREADS)
        with ThreadPoolExecutor(READ_THREADS) as pool:
            runs = pool.map(lambda run: [parse(k[0], None) for k in run],
                            [missing[a:a + step] for a in range(0, len(missing), step)])
            parsed = [e for run in runs for e in run]
    for k, e in zip(missing, parsed if missing else []):
        index_cache.put(k, e)
        got[k] = e
    return [got[k] for k in keys]


def open_shards(src, vocab_size: int) -> list[Shard]:
    """Every shard of a pre-tokenized source src (SourceConfig of format megatron, numpy or datatrove), sorted by path.

    vocab_size: the tokenizer's, for the default dtype of datatrove files (numpy needs data.token_dtype).
    Reads only indexes and file sizes, and each index only when index_cache has no entry for its
    content key: from an object store, the sizes from one listing and the indexes (and numpy files'
    first bytes) in one concurrent batch; locally, READ_THREADS at once. Raises DataError for bad
    input (the message of each check).
    """
    want = src.token_dtype or ""
    if src.format == "megatron":
        prefixes = megatron_prefixes(src)
        entries = _entries(src, [p + ".idx" for p in prefixes], _megatron_entry)
        shards = [_megatron_shard(p, want, e) for p, e in zip(prefixes, entries)]
    elif src.format == "numpy":
        if not want:  # a wrong guess reads uint32 files as pairs of uint16 ids, refused later for the wrong reason
            raise DataError(f"{src.field('token_dtype')}: a numpy source's files do not record their dtype; give "
                            f"--data.token_dtype uint16 or uint32, the one they were written with")
        files = expand_files(src, (".npy",))
        shards = [_numpy_shard(p, np.dtype(want)) for p in files]
        _entries(src, files, _numpy_entry, head=6)
    else:
        dtype = np.dtype(want or token_dtype(vocab_size))  # DocumentTokenizer's token_size rule (datatrove 0.10)
        # DocumentTokenizer leaves FILE.ds.index, .ds.loss and .ds.metadata beside each FILE.ds: a glob of the
        # folder matches them too, and only the .ds files hold tokens
        files = [p for p in expand_files(src, (".ds",)) if p.endswith(".ds")]
        if not files:
            raise DataError(f"{_field(src)}: '{src.dataset}' matches no datatrove .ds file; give a .ds file, a "
                            f"folder or a glob of them")
        for p in files:
            if not _isfile(p + ".index"):
                raise DataError(f"'{p}' has no '{p}.index' beside it; datatrove's DocumentTokenizer writes the "
                                f"document ends there (save_index)")
        entries = _entries(src, [p + ".index" for p in files], _datatrove_entry)
        shards = [_datatrove_shard(p, dtype, e) for p, e in zip(files, entries)]
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
    """DataError when documents of src do not end with eos_id: EOS_SAMPLES document ends (of those each shard keeps
    from its index, Shard.doc_ends) spread over the source (REMOTE_EOS_SAMPLES in an object store), or each shard's
    last token for numpy (the file cannot say where documents end)."""
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
    docs = [s.n_docs for s in shards if s.doc_ends is not None]
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
    index_cache.load(out_dir)  # a resume reads the entries, not the indexes (usually loaded already by the checks)
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


def index_paths(record: dict) -> list[str]:
    """The files index_cache keys for a source's meta.json record: each shard's index (the file itself for numpy)."""
    fmt = record["format"]
    return [p[:-4] + ".idx" if fmt == "megatron" else p + ".index" if fmt == "datatrove" else p
            for p, _, _ in record["shards"]]
