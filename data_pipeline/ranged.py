"""Token files in an object store (``s3://``), read in place: listings, indexes fetched whole, byte ranges of the
token files through one bounded block cache. Nothing is downloaded whole but the indexes.

Every request goes through fsspec (s3fs, storage/fs.py's options: no listing cache, botocore's
retries; the endpoint and credentials from the AWS_* variables). s3fs is asynchronous, so a
list of reads (the indexes of 1,000 shards, the windows of a step) is one concurrent batch
(``fs.cat`` / ``fs.cat_ranges``), not 1,000 round trips in turn.

- Sizes come from the listing that found the files (one LIST per folder, not a HEAD per file).
- A window is read through CACHE: blocks of BLOCK_BYTES, the least recently used dropped past
  CACHE_BYTES in all (every source and shard of the process together). The windows of a step
  are random over the corpus, so a cache cannot save their reads; it serves the windows that
  share a block, the validation windows (consecutive), and bounds memory.
- Small scattered reads (the start-up EOS sample, a numpy file's first bytes) go straight to
  the store, uncached: a block each would fetch BLOCK_BYTES for a few bytes.

No project import but storage/, so data_pipeline/streams.py (below data.py) can use it.
"""
from __future__ import annotations

import posixpath
from collections import OrderedDict

import numpy as np

from storage.fs import filesystem

BLOCK_BYTES = 1 << 16
"""Bytes of one cached block (64 KiB: a window of 2,048 uint16 tokens is 4 KiB, so it touches one block or two, and a
GET's latency, not its bytes, dominates at that size on S3)."""
CACHE_BYTES = 1 << 28
"""Bytes of blocks kept in memory per process (256 MiB): more than one step's windows on a rank need at seq 8,192
and 128 windows (at most 2 blocks each), so a step's prefetched blocks are still there when its windows are cut."""

_SIZES: dict[str, int] = {}
"""url -> size in bytes, from the listings made by expand (and HEADs made by size): the process's view."""
_STAMPS: dict[str, str] = {}
"""url -> "ETag|LastModified" from the same listings: what changes when an object is written again (stamp)."""


def _stamp_of(info: dict) -> str:
    return f"{info.get('ETag', '')}|{info.get('LastModified', '')}"


def _fs(url: str):
    return filesystem(url)[0]


def _url(url: str, inner: str) -> str:
    return f"{url.split('://', 1)[0]}://{inner}"


def _listed(fs, url: str, folder: str) -> dict[str, dict]:
    """{name: info} of folder's entries (one LIST, paginated by s3fs), their sizes recorded; {} for no folder."""
    try:
        entries = {i["name"].rstrip("/"): i for i in fs.ls(folder, detail=True)}
    except FileNotFoundError:
        return {}
    files = {_url(url, n): i for n, i in entries.items() if i["type"] == "file"}
    _SIZES.update({u: int(i["size"]) for u, i in files.items()})
    _STAMPS.update({u: _stamp_of(i) for u, i in files.items()})
    return entries


def expand(spec: str, suffixes: tuple[str, ...]) -> list[str]:
    """The URLs of files that spec names, like pretokenized.expand_files for local paths: a file, a folder (its files
    ending in one of suffixes), a glob, or a prefix that files extend with one of suffixes. Sorted; [] when nothing
    matches. Records the sizes of every file in the folders it lists, so that size() and isfile() of the files
    (and of the indexes beside them) make no request."""
    fs = _fs(spec)
    inner = fs._strip_protocol(spec).rstrip("/")
    if any(c in inner for c in "*?["):
        found = fs.glob(inner, detail=True) or {n: i for s in suffixes  # a glob of prefixes ('dir/*_text_document')
                                                for n, i in fs.glob(inner + s, detail=True).items()}
        for folder in sorted({posixpath.dirname(n) for n in found}):
            _listed(fs, spec, folder)
    else:
        listing = _listed(fs, spec, posixpath.dirname(inner))
        here = listing.get(inner)
        if here is not None and here["type"] == "directory":
            found = {n: i for n, i in _listed(fs, spec, inner).items() if n.endswith(suffixes)}
        elif here is not None:
            found = {inner: here}
        else:  # a prefix: PREFIX.bin and PREFIX.idx
            found = {n: i for n, i in listing.items() if any(n == inner + s for s in suffixes)}
    return sorted(_url(spec, n) for n, i in found.items() if i.get("type", "file") == "file")


def size(url: str) -> int:
    """The file's size in bytes, from the last listing or one HEAD; FileNotFoundError when absent."""
    if url not in _SIZES:
        fs = _fs(url)
        _SIZES[url] = int(fs.size(fs._strip_protocol(url)))
    return _SIZES[url]


def stamp(url: str) -> str:
    """The object's "ETag|LastModified" (index_cache's content key), from the last listing or one HEAD;
    FileNotFoundError when absent."""
    if url not in _STAMPS:
        fs = _fs(url)
        info = fs.info(fs._strip_protocol(url))
        _SIZES[url], _STAMPS[url] = int(info["size"]), _stamp_of(info)
    return _STAMPS[url]


def sizes(urls: list[str]) -> list[int]:
    """Each file's size in bytes (-1 when absent): one LIST per folder of the files no listing has seen yet."""
    unseen = sorted({posixpath.dirname(u) for u in urls if u not in _SIZES})
    for folder in unseen:
        fs = _fs(folder)
        _listed(fs, folder, fs._strip_protocol(folder))
    return [_SIZES.get(u, -1) for u in urls]


def isfile(url: str) -> bool:
    """Whether an object is at url (from the last listing, else one HEAD)."""
    try:
        size(url)
        return True
    except FileNotFoundError:
        return False


def fetch(urls: list[str]) -> dict[str, bytes]:
    """{url: the whole file} for every url, read concurrently (indexes: read whole at start). Raises OSError."""
    if not urls:
        return {}
    fs = _fs(urls[0])
    inner = [fs._strip_protocol(u) for u in urls]
    got = fs.cat(inner, on_error="raise")
    return {u: got[i] for u, i in zip(urls, inner)}


MERGE_GAP = 1 << 16
"""Ranges of a file closer than this (64 KiB) are read as one: a request's latency costs more than those bytes."""


def read_ranges(requests: list[tuple[str, int, int]]) -> list[bytes]:
    """The bytes [start, stop) of each (url, start, stop), uncached (small scattered reads), in one concurrent batch
    of ranged reads, ranges of a file less than MERGE_GAP apart merged into one. Raises OSError."""
    if not requests:
        return []
    spans: list[list] = []  # [url, start, stop, [request numbers]]
    for k in sorted(range(len(requests)), key=lambda k: requests[k]):
        url, a, b = requests[k]
        if spans and spans[-1][0] == url and a - spans[-1][2] <= MERGE_GAP:
            spans[-1][2] = max(spans[-1][2], b)
            spans[-1][3].append(k)
        else:
            spans.append([url, a, b, [k]])
    fs = _fs(requests[0][0])
    got = fs.cat_ranges([fs._strip_protocol(u) for u, _, _, _ in spans], [a for _, a, _, _ in spans],
                        [b for _, _, b, _ in spans], on_error="raise")
    out: list[bytes] = [b""] * len(requests)
    for (url, a, b, ks), data in zip(spans, got):
        if len(data) != b - a:
            raise OSError(f"'{url}' returned {len(data)} bytes for [{a}, {b}): the object changed or is damaged")
        for k in ks:
            out[k] = data[requests[k][1] - a:requests[k][2] - a]
    return out


class BlockCache:
    """Blocks of block_bytes of remote files, in memory, least recently used dropped past max_bytes."""

    def __init__(self, block_bytes: int = BLOCK_BYTES, max_bytes: int = CACHE_BYTES):
        self.block, self.max_bytes = block_bytes, max_bytes
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._bytes = 0
        self.fetched = 0
        """Bytes read from the store by this cache (the benchmark's and the tests' measure of 'no full download')."""

    def load(self, requests: list[tuple[str, int, int]]) -> None:
        """Fetch the blocks that the byte ranges (url, start, stop) need and the cache lacks, in one concurrent batch
        (a run of consecutive missing blocks of a file is one ranged read)."""
        runs: list[tuple[str, int, int]] = []  # (url, first block, last block + 1)
        want = sorted({(u, k) for u, a, b in requests for k in range(a // self.block, -(-b // self.block))
                       if (u, k) not in self._blocks})
        for u, k in want:
            if runs and runs[-1][0] == u and runs[-1][2] == k:
                runs[-1] = (u, runs[-1][1], k + 1)
            else:
                runs.append((u, k, k + 1))
        spans = [(u, lo * self.block, min(hi * self.block, size(u))) for u, lo, hi in runs]
        for (u, lo, _), data in zip(runs, read_ranges(spans)):
            self.fetched += len(data)
            for j in range(0, len(data), self.block):
                self._put((u, lo + j // self.block), data[j:j + self.block])

    def _put(self, key: tuple[str, int], data: bytes) -> None:
        old = self._blocks.pop(key, None)
        self._bytes += len(data) - (len(old) if old is not None else 0)
        self._blocks[key] = data
        while self._bytes > self.max_bytes and len(self._blocks) > 1:
            _, dropped = self._blocks.popitem(last=False)
            self._bytes -= len(dropped)

    def read(self, url: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of url; a read of more than half the cache goes straight to the store."""
        if stop <= start:
            return b""
        if stop - start > self.max_bytes // 2:
            data = read_ranges([(url, start, stop)])[0]
            self.fetched += len(data)
            return data
        keys = [(url, k) for k in range(start // self.block, -(-stop // self.block))]
        for key in keys:  # most recently used first, so that loading the missing ones cannot drop them
            if key in self._blocks:
                self._blocks.move_to_end(key)
        if any(k not in self._blocks for k in keys):
            self.load([(url, start, stop)])
        if any(k not in self._blocks for k in keys):  # more blocks than the cache holds
            data = read_ranges([(url, start, stop)])[0]
            self.fetched += len(data)
            return data
        parts = [self._blocks[key] for key in keys]
        first = keys[0][1] * self.block
        return b"".join(parts)[start - first:stop - first]

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0


CACHE = BlockCache()
"""The process's one cache: its bound holds for every remote source together."""


class RemoteTokens:
    """A remote token file as a read-only 1-D array of n tokens of dtype that can be sliced (``t[a:b]``, a copy read
    through CACHE): what TokenStream maps for a local file."""

    def __init__(self, url: str, dtype: np.dtype, n: int):
        self.url, self.dtype, self.n = url, np.dtype(dtype), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, _ = key.indices(self.n)
        size = self.dtype.itemsize
        return np.frombuffer(CACHE.read(self.url, a * size, max(a, b) * size), dtype=self.dtype)
