"""Prepared data on a URL: publish a prepared directory to it, and copy what a node needs into a local cache.

    python prepare.py --config FILE.toml --run_dir DIR --data.prepared s3://BUCKET/data   (publish)
    torchrun ... train_fsdp.py --config FILE.toml --data.prepared s3://BUCKET/data          (train from it)

Training memory-maps token files, which an object store cannot serve: each node copies the
files its sources need (tokenizer.json and one token file per source, as meta.json lists
them) into data.cache_dir, checks each by size and SHA-256 against meta.json, then reads the
copy as a local prepared directory. The ranks of a node take a file lock on the cache, so the
first downloads and the others find the copy done; a file that checks out is never fetched
again (a stamp of its size and mtime spares re-hashing it at every restart). meta.json is
published last, so a reader never sees a directory whose files are still on their way.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os

from data import DataConfig, DataError, read_meta
from storage import fs
from storage.rundir import RunDir

CACHE_LOCK = ".cache.lock"
"""In the cache: the lock its node's ranks take in turn."""
STAMPS = ".verified.json"
"""In the cache: {relative path: [size, mtime_ns, sha256]} of the files checked already."""


def cache_dir(cfg: DataConfig, run_dir: str) -> str:
    """The node-local folder of a remote data.prepared: data.cache_dir, else RUN_DIR/data_cache."""
    return cfg.cache_dir or RunDir(run_dir).data_cache


def remote_meta(cfg: DataConfig) -> dict:
    """The meta.json of data.prepared (a URL or a local directory), checked against cfg; no process group needed.

    Raises DataError naming the location when meta.json is missing or unreadable, when it lacks
    one of cfg's sources, or when the tokenizer or a source was prepared with other settings.
    """
    where = cfg.prepared
    try:
        meta = json.loads(fs.read_bytes(fs.join(where, "meta.json")))
    except FileNotFoundError:
        raise DataError(f"--data.prepared {where}: no meta.json there; publish a prepared directory with "
                        f"prepare.py --data.prepared {where}, or fix the path") from None
    except (OSError, ValueError) as e:
        raise DataError(f"--data.prepared {where}: cannot read meta.json ({type(e).__name__}: {e})") from None
    wanted = cfg.prepared_settings()
    diffs = [f"data.{k}: prepared {meta.get('tokenizer_config', {}).get(k)!r}, now {v!r}"
             for k, v in wanted["tokenizer"].items() if meta.get("tokenizer_config", {}).get(k) != v]
    for src in wanted["sources"]:
        record = meta.get("sources", {}).get(src["name"])
        if record is None:
            raise DataError(f"--data.prepared {where} holds no source '{src['name']}' (it has "
                            f"{', '.join(meta.get('sources', {})) or 'none'}); prepare it there with this config")
        reading = {k: v for k, v in src.items() if k != "name"}
        diffs += [f"source {src['name']} {k}: prepared {record['config'].get(k)!r}, now {v!r}"
                  for k, v in reading.items() if record["config"].get(k) != v]
    if diffs:
        raise DataError(f"--data.prepared {where} was prepared with other data settings ({'; '.join(diffs[:4])}); "
                        f"use the data settings it was prepared with")
    return meta


@contextlib.contextmanager
def _node_lock(folder: str):
    """An exclusive lock on folder/CACHE_LOCK: the ranks of one node take turns; the first one downloads."""
    with open(os.path.join(folder, CACHE_LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch(cfg: DataConfig, folder: str, rel: str, size: int | None, sha: str | None, stamps: dict) -> None:
    """Make folder/rel the checked copy of data.prepared/rel (size in bytes and sha256 from meta.json when known)."""
    local = os.path.join(folder, rel)

    def checks(path: str) -> bool:
        st = os.stat(path)
        if size is not None and st.st_size != size:
            return False
        if stamps.get(rel) == [st.st_size, st.st_mtime_ns, sha]:
            return True
        ok = sha is None or fs.sha256(path) == sha
        if ok:
            stamps[rel] = [st.st_size, st.st_mtime_ns, sha]
        return ok

    if os.path.isfile(local) and checks(local):
        return
    os.makedirs(os.path.dirname(local), exist_ok=True)
    remote = fs.join(cfg.prepared, rel)
    print(f"[data] downloading {remote} -> {local}", flush=True)
    try:
        fs.download(remote, local)
    except (OSError, FileNotFoundError) as e:
        raise DataError(f"--data.prepared: cannot download {remote} ({type(e).__name__}: {e})") from None
    if not checks(local):
        os.remove(local)
        raise DataError(f"--data.prepared: {remote} does not match its meta.json (size or SHA-256); publish the "
                        f"directory again with prepare.py --data.prepared")


def fetch(cfg: DataConfig, folder: str) -> tuple[str, dict]:
    """Copy what cfg's sources need from data.prepared into folder (node-local); returns (local folder, meta).

    Every rank calls it; no collective. A local data.prepared is read in place (the folder
    returned). meta is prepare.prepare's: data.read_meta's layout with "tokenizer" the local
    tokenizer.json, plus "n_tokens" and "n_documents" of cfg's sources. Raises
    DataError (see remote_meta, and for a file that cannot be downloaded or does not check out).
    """
    if not fs.is_url(cfg.prepared):  # a local (or shared) directory is read where it is
        folder = cfg.prepared
        meta = remote_meta(cfg)
    else:
        os.makedirs(folder, exist_ok=True)
        with _node_lock(folder):
            meta = remote_meta(cfg)
            stamps_path = os.path.join(folder, STAMPS)
            try:
                with open(stamps_path) as f:
                    stamps = json.load(f)
            except (OSError, ValueError):
                stamps = {}
            _fetch(cfg, folder, "tokenizer.json", None, meta.get("tokenizer_sha256"), stamps)
            for s in cfg.source_list():
                record = meta["sources"][s.name]
                n_bytes = record["n_tokens"] * (2 if record["dtype"] == "uint16" else 4)
                _fetch(cfg, folder, record["file"], n_bytes, record.get("sha256"), stamps)
            with open(os.path.join(folder, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            with open(stamps_path, "w") as f:
                json.dump(stamps, f)
    meta = {**read_meta(folder), "tokenizer": os.path.join(folder, "tokenizer.json")}
    records = [meta["sources"][s.name] for s in cfg.source_list()]
    return folder, {**meta, "n_tokens": sum(r["n_tokens"] for r in records),
                    "n_documents": sum(r["n_documents"] for r in records)}


def tokenizer_path(cfg: DataConfig, run_dir: str) -> str:
    """A local tokenizer.json of data.prepared (downloaded into the node's cache if needed), for commands
    that read a finished run. Raises DataError when it cannot be found or downloaded."""
    if not fs.is_url(cfg.prepared):
        return os.path.join(cfg.prepared, "tokenizer.json")
    folder = cache_dir(cfg, run_dir)
    os.makedirs(folder, exist_ok=True)
    with _node_lock(folder):
        _fetch(cfg, folder, "tokenizer.json", None, remote_meta(cfg).get("tokenizer_sha256"), {})
    return os.path.join(folder, "tokenizer.json")


def publish(out_dir: str, url: str) -> None:
    """Upload a prepared directory (out_dir, local) to url: tokenizer.json and the token files, meta.json last.

    A file already there is sent again unless its SHA-256 is the local file's (a size alone would
    keep a corrupted object that fetch then refuses). Raises DataError naming the file when an
    upload fails.
    """
    meta = read_meta(out_dir)
    files = ["tokenizer.json", *(r["file"] for r in meta["sources"].values()), "meta.json"]
    for rel in files:
        local, remote = os.path.join(out_dir, rel), fs.join(url, rel)
        try:
            if rel != "meta.json" and fs.isfile(remote) and fs.size(remote) == os.path.getsize(local) \
                    and fs.sha256(remote) == fs.sha256(local):
                continue
            fs.upload(local, remote)
        except OSError as e:
            raise DataError(f"--data.prepared {url}: uploading {rel} failed ({type(e).__name__}: {e})") from None
        print(f"[data] uploaded {local} -> {remote}", flush=True)
