"""What start-up derives from each shard's index, kept by the index's content key, so that a resume (and the second
reader of one start: every rank's checks, then rank 0's record) reads no index at all.

A key is (path or URL, size in bytes, stamp): a local file's stamp is its mtime and ctime in nanoseconds (a file
rewritten in place, or its mtime set back by ``touch -d``/``rsync -t``, changes its ctime), an object's is its ETag and
LastModified from the listing that found it (ranged.stamp). A shard whose key changed is read again, so a corpus
changed under a run still gets a new identity and is refused (pretokenized.corpus_changed).

The process keeps every entry it read or loaded (a memo); rank 0 writes the entries of the run's sources into the
prepared-data folder (RUN_DIR/data/index_cache.npz, FILE) at the end of preparation: whole into a .tmp file, then
renamed, so a kill leaves the old file or the new one, never a part. A file that cannot be read (damaged, another
VERSION) is ignored: it is a cache, and the indexes are read instead.

No project import but ranged.py (for object stamps), so pretokenized.py can use it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from data_pipeline import ranged
from storage.fs import is_url

FILE = "index_cache.npz"
VERSION = 1


@dataclass(frozen=True)
class Entry:
    """One index's facts: dtype name ("" when the file does not record it: numpy), n_tokens (-1: not recorded),
    n_docs (-1: not counted), ends (int64 token offsets of a sample of document ends, or None), sha256 of the index
    (None for numpy, which has none)."""
    dtype: str
    n_tokens: int
    n_docs: int
    ends: np.ndarray | None
    sha256: str | None


Key = tuple[str, int, str]

_ENTRIES: dict[Key, Entry] = {}
_LOADED: dict[str, tuple] = {}
"""folder -> the (size, mtime) of the FILE this process merged from it, so a second load of the same file is free."""
stats = {"read": 0, "hit": 0}
"""Indexes this process parsed from their files, and ones it took from the cache (the tests' and bench's count)."""


def key(path: str) -> Key:
    """The content key of the file at path (a local path or a URL). Raises FileNotFoundError when it is absent."""
    if is_url(path):
        return (path, ranged.size(path), ranged.stamp(path))
    st = os.stat(path)
    return (path, st.st_size, f"{st.st_mtime_ns}.{st.st_ctime_ns}")


def get(k: Key) -> Entry | None:
    """The entry of key k, or None when neither this process nor a loaded cache file has it."""
    entry = _ENTRIES.get(k)
    stats["hit" if entry is not None else "read"] += 1
    return entry


def put(k: Key, entry: Entry) -> None:
    _ENTRIES[k] = entry


def load(folder: str) -> None:
    """Merge folder/FILE (when there is one, readable and of this VERSION) into the process's entries."""
    path = os.path.join(folder, FILE)
    try:
        st = os.stat(path)
    except OSError:
        return
    if _LOADED.get(folder) == (st.st_size, st.st_mtime_ns):
        return
    try:
        with np.load(path, allow_pickle=False) as z:
            header, ends = json.loads(z["header"].tobytes()), z["ends"]
        if header.get("version") != VERSION:
            return
        for p, size, stamp, dtype, n_tokens, n_docs, lo, hi, sha in header["entries"]:
            _ENTRIES[(p, size, stamp)] = Entry(dtype, n_tokens, n_docs, None if lo < 0 else ends[lo:hi].copy(), sha)
    except Exception:  # noqa: BLE001 - damaged or foreign: read the indexes instead, as with no cache
        return
    _LOADED[folder] = (st.st_size, st.st_mtime_ns)


def save(folder: str, paths: list[str]) -> bool:
    """Rank 0: write the entries of the index files at paths (by their keys now) to folder/FILE, atomically (a .tmp
    file renamed, so a kill leaves the old file or the new one). A path this process has no entry for (not read here,
    or changed since) is left out: the next start reads it. Nothing is written when the file already holds exactly
    those keys (a resume of an unchanged corpus). True when written; OSError when folder is not writable."""
    keys = []
    for p in paths:
        try:
            k = key(p)
        except FileNotFoundError:
            continue
        if k in _ENTRIES:
            keys.append(k)
    target = os.path.join(folder, FILE)
    if not keys or _file_keys(target) == keys:  # no source read in place (raw text only), or nothing new
        return False
    rows, parts, at = [], [], 0
    for k in keys:
        e = _ENTRIES[k]
        n = -1 if e.ends is None else len(e.ends)
        rows.append([*k, e.dtype, e.n_tokens, e.n_docs, at if n >= 0 else -1, at + max(n, 0), e.sha256])
        if n > 0:
            parts.append(e.ends.astype(np.int64))
        at += max(n, 0)
    header = np.frombuffer(json.dumps({"version": VERSION, "entries": rows}).encode(), dtype=np.uint8)
    ends = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    with open(target + ".tmp", "wb") as f:  # a file object: np.savez would append .npz to the name
        np.savez(f, header=header, ends=ends)
        f.flush()
        os.fsync(f.fileno())
    os.replace(target + ".tmp", target)
    st = os.stat(target)
    _LOADED[folder] = (st.st_size, st.st_mtime_ns)
    return True


def _file_keys(path: str) -> list[Key] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes())
        return [(p, size, stamp) for p, size, stamp, *_ in header["entries"]] if header.get("version") == VERSION \
            else None
    except Exception:  # noqa: BLE001 - absent or damaged: write it
        return None


def clear() -> None:
    """Forget every entry and loaded file (tests: a fresh process)."""
    _ENTRIES.clear()
    _LOADED.clear()
    stats.update(read=0, hit=0)
