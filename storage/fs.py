"""Where checkpoints and prepared data live: a local path or an object-store URL, behind one small interface.

    /data/run1/checkpoints         a local directory (os and shutil, as always)
    s3://bucket/prefix             S3 or any S3-compatible store (MinIO, R2, SeaweedFS, ...) through s3fs

A location is exactly a local path or an ``s3://`` URL: check_location refuses anything else
that looks like a URL (another scheme, ``file://``, or ``s3:/`` with one slash, which would
otherwise be a local folder named ``s3:``). The URL goes through fsspec's s3fs, and DCP writes
and reads it with its own FsspecWriter/FsspecReader: this module holds no S3 client of its
own. The endpoint and credentials are never configured here: botocore reads them itself from
the standard variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, or ``~/.aws``), so one command runs against AWS, MinIO, R2 or a local
test server alike.

An object store has no directories and no atomic rename: callers that need "complete or
absent" (checkpoint.py) commit with a marker object written last, not with a rename.

Transient faults (connection resets, 5xx, throttling) are retried by botocore with backoff:
``standard`` retry mode with 10 attempts unless ``AWS_RETRY_MODE``/``AWS_MAX_ATTEMPTS`` say
otherwise (botocore reads those too).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from typing import Any, Callable

import fsspec
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from core.errors import UserError, one_line, require

S3_RETRIES = {"mode": "standard", "max_attempts": 10}
"""botocore's retry settings for s3:// (about 20 s of backoff before a store counts as down)."""


_LOOKS_LIKE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")
"""A scheme and one slash (s3:/bucket): a URL mistyped, not a local path anyone means."""


class StorageError(UserError):
    """A location that cannot be used (unknown scheme, missing bucket or credentials); names the field and the fix."""


def is_url(path: str) -> bool:
    """Whether path is a URL (scheme://...) rather than a local path."""
    return "://" in str(path)


def scheme(path: str) -> str:
    """The URL's scheme ('s3'), or '' for a local path."""
    return str(path).split("://", 1)[0] if is_url(path) else ""


def join(root: str, *parts: str) -> str:
    """root/part/...: os.path.join for a local path, '/' for a URL."""
    if not is_url(root):
        return os.path.join(root, *parts)
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def options(path: str) -> dict[str, Any]:
    """fsspec storage options for path's scheme ({} for local paths and schemes without settings of ours).

    s3: no listing cache (another rank or node writes the same prefix, so a cached listing
    would hide its objects) and botocore's retries (S3_RETRIES, unless AWS_RETRY_MODE or
    AWS_MAX_ATTEMPTS is set, which botocore then applies itself).
    """
    if scheme(path) != "s3":
        return {}
    opts: dict[str, Any] = {"use_listings_cache": False}
    if not (os.environ.get("AWS_RETRY_MODE") or os.environ.get("AWS_MAX_ATTEMPTS")):
        opts["config_kwargs"] = {"retries": dict(S3_RETRIES)}
    return opts


def filesystem(path: str):
    """(fsspec filesystem, path inside it) for a URL; raises StorageError for an unknown scheme or missing package."""
    name = scheme(path)
    if name == "s3":  # fsspec keeps a class once imported: ask for the package itself
        require("s3fs", "s3", f"'{path}'")
    try:
        fsspec.get_filesystem_class(name)
    except ValueError:
        raise StorageError(f"'{path}': unknown URL scheme '{name}://'; use a local path or s3://BUCKET/PREFIX") \
            from None
    except ImportError:
        raise StorageError(f"'{path}': the fsspec filesystem for '{name}://' is not installed; install its package "
                           f"(e.g. gcsfs for gs://) or use s3://") from None
    return fsspec.core.url_to_fs(path, **options(path))


def check_location(path: str, field: str) -> None:
    """Check that a URL can be used before any collective: scheme, package, credentials, bucket, endpoint.

    Local paths are not checked here (their callers create and probe them), except one that looks
    like a mistyped URL (s3:/x); a scheme other than s3:// (file://, gs://, ftp://, ...) is refused.
    The bucket probe gives up within seconds. Raises StorageError (or MissingPackageError without
    s3fs) naming field and the fix; nothing is written.
    """
    if not is_url(path):
        if _LOOKS_LIKE_URL.match(str(path)):
            raise StorageError(f"{field} {path}: this looks like a URL with one slash, which would be a local folder "
                               f"named '{str(path).split(':', 1)[0]}:'; write s3://BUCKET/PREFIX, or ./{path} for a "
                               f"local folder")
        return
    if scheme(path) != "s3":
        local = " (for a local folder, give its path without file://)" if scheme(path) == "file" else ""
        raise StorageError(f"{field} {path}: '{scheme(path)}://' is not supported: use a local path or "
                           f"s3://BUCKET/PREFIX{local}")
    require("s3fs", "s3", f"{field} {path}")
    import botocore.session  # s3fs depends on botocore

    if botocore.session.get_session().get_credentials() is None:
        raise StorageError(f"{field} {path}: no S3 credentials found; set AWS_ACCESS_KEY_ID and "
                           f"AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a store other than AWS)")
    bucket = str(path).split("://", 1)[1].split("/", 1)[0]
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS's default endpoint")
    # A probe of its own, bounded: a wrong or missing AWS_ENDPOINT_URL must fail in seconds, not
    # after the minute of retries that a store that is down mid-run deserves.
    probe = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                              config_kwargs={"connect_timeout": 3, "read_timeout": 5,
                                             "retries": {"mode": "standard", "max_attempts": 2}})
    try:
        probe.ls(bucket, detail=False)
    except FileNotFoundError:
        raise StorageError(f"{field} {path}: bucket '{bucket}' does not exist at {endpoint}; create it "
                           f"(aws s3 mb s3://{bucket}) or fix the URL or AWS_ENDPOINT_URL") from None
    except PermissionError as e:
        raise StorageError(f"{field} {path}: access to bucket '{bucket}' at {endpoint} is denied ({one_line(e)}); "
                           f"check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
    except Exception as e:  # botocore's connection and credential errors share no base class with OSError
        raise StorageError(f"{field} {path}: cannot reach the store at {endpoint} ({one_line(e)}); check "
                           f"AWS_ENDPOINT_URL and the network") from None


def exists(path: str) -> bool:
    """Whether a file or directory (for a URL: an object or a prefix) is at path."""
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


def isfile(path: str) -> bool:
    """Whether a file (an object) is at path."""
    if not is_url(path):
        return os.path.isfile(path)
    fs, inner = filesystem(path)
    return fs.isfile(inner)


def listdir(path: str) -> list[str]:
    """Names directly under path (files and sub-directories / prefixes), [] when nothing is there."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, inner = filesystem(path)
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(inner, detail=False)]
    except FileNotFoundError:
        return []


def size(path: str) -> int:
    """The file's size in bytes; FileNotFoundError if absent."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, inner = filesystem(path)
    return fs.size(inner)


def sha256(path: str) -> str:
    """Hex SHA-256 of the file at path (local or URL), read in 16 MiB blocks; OSError when it cannot be read."""
    h = hashlib.sha256()
    if is_url(path):
        fs, inner = filesystem(path)
        f = fs.open(inner, "rb", block_size=1 << 24)
    else:
        f = open(path, "rb")
    with f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def read_bytes(path: str) -> bytes:
    """The file's contents; OSError (FileNotFoundError if absent) when it cannot be read."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


def write_bytes(path: str, data: bytes) -> None:
    """Write data to path whole (for a URL: one PUT, so the object appears complete or not at all)."""
    if not is_url(path):
        with open(path, "wb") as f:
            f.write(data)
        return
    fs, inner = filesystem(path)
    fs.pipe_file(inner, data)


def remove(path: str) -> None:
    """Delete path and everything under it, if present; errors are ignored (a later clean-up retries)."""
    if not is_url(path):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
        return
    fs, inner = filesystem(path)
    try:
        fs.rm(inner, recursive=True)
    except (FileNotFoundError, OSError):
        pass


def move(path: str, dest: str, first: str = "") -> None:
    """Move the folder (or file) at path to dest, a name that is free, on the same store.

    Local: one rename (dest's parent created). URL: every object copied, then the source
    removed, its object named `first` (a commit marker) before the rest, so a move cut short
    never leaves a source that reads as complete without all its objects. Raises OSError
    (FileNotFoundError, FileExistsError) when it cannot.
    """
    if not is_url(path):
        if os.path.lexists(dest):
            raise FileExistsError(f"{dest} exists")
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        os.rename(path, dest)
        return
    fs, inner = filesystem(path)
    _, inner_dest = filesystem(dest)
    if fs.exists(inner_dest):
        raise FileExistsError(f"{dest} exists")
    fs.copy(inner, inner_dest, recursive=True)
    if first:
        fs.rm(f"{inner.rstrip('/')}/{first}")
    fs.rm(inner, recursive=True)


def download(path: str, local: str) -> None:
    """Copy the file at URL path to the local file local (written whole, then renamed into place)."""
    fs, inner = filesystem(path)
    tmp = f"{local}.part{os.getpid()}"
    fs.get_file(inner, tmp)
    os.replace(tmp, local)


def upload(local: str, path: str) -> None:
    """Copy the local file local to path (a URL or a local path)."""
    if not is_url(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        shutil.copyfile(local, path)
        return
    fs, inner = filesystem(path)
    fs.put_file(local, inner)


class _FinishingWriter(FsspecWriter):
    """DCP's FsspecWriter that runs after_finish on the coordinator once the metadata is written.

    DCP calls finish on rank 0 after every rank's writes, and sends its failure to every rank,
    so a commit made here is both last and seen by all ranks if it fails.
    """

    def __init__(self, path: str, after_finish: Callable[[], None] | None, **kwargs):
        super().__init__(path, **kwargs)
        self.after_finish = after_finish

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        if self.after_finish is not None:
            self.after_finish()


def dcp_writer(path: str, after_finish: Callable[[], None] | None = None):
    """DCP's storage writer for a URL (FsspecWriter), or None for a local path (DCP's FileSystemWriter).

    after_finish: called on the coordinating rank after DCP wrote the metadata (URLs only).
    """
    if not is_url(path):
        return None
    filesystem(path)  # the scheme's own error, not DCP's
    # No fsync: DCP would fall back to os.sync() of every local disk for an object it cannot fsync.
    return _FinishingWriter(path, after_finish, sync_files=False, **options(path))


def dcp_reader(path: str):
    """DCP's storage reader for a URL (FsspecReader), or None for a local path (DCP's FileSystemReader)."""
    if not is_url(path):
        return None
    filesystem(path)
    return FsspecReader(path, **options(path))
