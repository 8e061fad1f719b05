"""Several token files read as one flat stream, memory-mapped (or, for ``s3://`` files, read in ranges through
ranged.py's bounded cache): the view data.py cuts into windows.

No project import but ranged.py (itself on storage/ only), so data.py (below the rest of data_pipeline/) can use it.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from data_pipeline import ranged
from storage.fs import is_url

OPEN_MAPS = 256
"""Memory maps kept open at once (each holds a file descriptor; a source may have 10,000 shards)."""


class TokenStream:
    """Shards as one flat read-only token stream: stream[a:b] is a numpy array of the tokens a..b-1 (a slice may span
    shards; shards of different dtypes give their common type). Maps at most OPEN_MAPS files at once."""

    def __init__(self, shards: list[list]):
        """shards: [[path, dtype name, n_tokens]] (Shard.record) in stream order."""
        self.paths = [p for p, _, _ in shards]
        self.dtypes = [np.dtype(d) for _, d, _ in shards]
        self.offsets = np.concatenate([[0], np.cumsum([n for _, _, n in shards], dtype=np.int64)])
        self.size = int(self.offsets[-1])
        self.dtype = np.result_type(*self.dtypes)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()

    def _map(self, i: int) -> np.memmap | ranged.RemoteTokens:
        m = self._maps.pop(i, None)
        if m is None and is_url(self.paths[i]):
            m = ranged.RemoteTokens(self.paths[i], self.dtypes[i], int(self.offsets[i + 1] - self.offsets[i]))
        elif m is None:
            m = np.memmap(self.paths[i], dtype=self.dtypes[i], mode="r")
            if len(self._maps) >= OPEN_MAPS:
                self._maps.popitem(last=False)
        self._maps[i] = m
        return m

    @property
    def remote(self) -> bool:
        """Whether any shard is read from an object store (through ranged.CACHE) rather than mapped."""
        return any(is_url(p) for p in self.paths)

    def file_sizes(self) -> list[int]:
        """Each shard's size in bytes now (-1 for a missing local file): a listing's for a URL, os.stat's else."""
        remote = dict(zip(urls := [p for p in self.paths if is_url(p)], ranged.sizes(urls)))
        return [remote[p] if is_url(p) else os.path.getsize(p) if os.path.isfile(p) else -1 for p in self.paths]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch what the token ranges [(start, stop)] of remote shards need, in one concurrent batch, so that the
        slices that follow read from the cache (local shards: nothing to do, the page cache serves them)."""
        requests = []
        for start, stop in ranges:
            i = int(np.searchsorted(self.offsets, start, side="right")) - 1
            while start < stop and i < len(self.paths):
                lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
                if is_url(self.paths[i]):
                    size = self.dtypes[i].itemsize
                    requests.append((self.paths[i], (start - lo) * size, (min(stop, hi) - lo) * size))
                start, i = min(stop, hi), i + 1
        ranged.CACHE.load(requests)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, _ = key.indices(self.size)
        pieces = []
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        if start < stop and stop <= int(self.offsets[i + 1]):  # within one shard: a view of its map, no copy
            return self._map(i)[start - int(self.offsets[i]):stop - int(self.offsets[i])]
        while start < stop:
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            # a copy: a view would keep its map (and file descriptor) open after OPEN_MAPS evicts it, and a slice
            # over 10,000 small shards would hold 10,000 descriptors, past a usual limit of 1,024
            pieces.append(np.array(self._map(i)[start - lo:min(stop, hi) - lo]))
            start, i = min(stop, hi), i + 1
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)
