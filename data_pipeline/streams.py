"""Several token files read as one flat stream, memory-mapped: the view data.py cuts into windows.

Pure numpy and no project import, so data.py (below the rest of data_pipeline/) can use it.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

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

    def _map(self, i: int) -> np.memmap:
        m = self._maps.pop(i, None)
        if m is None:
            m = np.memmap(self.paths[i], dtype=self.dtypes[i], mode="r")
            if len(self._maps) >= OPEN_MAPS:
                self._maps.popitem(last=False)
        self._maps[i] = m
        return m

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
