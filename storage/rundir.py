"""The run directory: every path a run writes or reads under ``--run_dir``, named once.

    DIR/config.toml       the resolved config of the run (written at every start)
    DIR/data/             the prepared corpus: tokenizer.json, meta.json, per-source token files
    DIR/data_cache/       the node's copy of a remote data.prepared (datacache.py)
    DIR/checkpoints/      DCP checkpoints, step_<N>/ (see checkpoint.py), unless checkpoint.dir puts them elsewhere
    DIR/metrics.jsonl     one JSON record per logged step and per validation
    DIR/tensorboard/      the same scalars as TensorBoard events (metrics.tensorboard)
    DIR/wandb/            Weights & Biases' own folder of the run (metrics.wandb; wandb.init(dir=DIR) writes it)
    DIR/wandb_run_id      the W&B run's id, so that every start of the run logs to the same W&B run
    DIR/profile/          torch.profiler traces (train.profile_steps)
    DIR/eval_data/<hash>/ another source tokenized by evaluate.py with the run's tokenizer
    DIR/.lock             held by the running job (lock_run_dir)
    DIR/exit.json         how the last run ended, for scripts (torchrun's own exit status is 1 after a signal)

Modules take their paths from here, never from string literals of their own, so a path
can move (checkpoints to object storage, say) in one place.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import socket

from core.errors import SetupError

CONFIG_FILE = "config.toml"
"""The resolved config's file name, in the run directory and in every checkpoint directory."""


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (root: the --run_dir as given)."""

    root: str

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def config(self) -> str:
        return self._path(CONFIG_FILE)

    @property
    def data(self) -> str:
        return self._path("data")

    @property
    def tokenizer(self) -> str:
        return self._path("data", "tokenizer.json")

    @property
    def data_cache(self) -> str:
        """The node-local copy of a remote data.prepared (datacache.py), unless data.cache_dir names another."""
        return self._path("data_cache")

    @property
    def checkpoints(self) -> str:
        return self._path("checkpoints")

    @property
    def metrics(self) -> str:
        return self._path("metrics.jsonl")

    @property
    def tensorboard(self) -> str:
        return self._path("tensorboard")

    @property
    def wandb(self) -> str:
        """The folder W&B writes its run folders in: wandb.init(dir=root) makes root/wandb, not a path of ours."""
        return self._path("wandb")

    @property
    def wandb_id(self) -> str:
        return self._path("wandb_run_id")

    @property
    def profile(self) -> str:
        return self._path("profile")

    @property
    def lock(self) -> str:
        return self._path(".lock")

    @property
    def exit_record(self) -> str:
        return self._path("exit.json")

    def eval_data(self, digest: str) -> str:
        """Where evaluate.py tokenizes another source (digest: a hash of its reading settings)."""
        return self._path("eval_data", digest)


def check_local_dir(path: str, flag: str, remote_hint: str = "") -> None:
    """Check that path is a local directory this process can write: an existing one, or one it can create.

    Writability is tried, not asked (os.access says yes to root on a read-only mount or under
    /proc): a probe directory is made and removed in the directory itself or in its nearest
    existing parent, so nothing is left behind. Raises SetupError naming flag and the fix for a
    URL (remote_hint: where a URL is supported instead), an empty path, a file, or a location
    that cannot be written.
    """
    if not path:
        raise SetupError(f"{flag} is empty; give a local directory, e.g. {flag} runs/debug")
    if "://" in path or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", path):  # s3:/x too: not a folder named 's3:'
        raise SetupError(f"{flag} {path!r}: must be a local directory{remote_hint}")
    try:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise NotADirectoryError(20, "it is a file, not a directory")
        parent = os.path.abspath(path)
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise NotADirectoryError(20, f"'{parent}' is a file, not a directory")
        probe = os.path.join(parent, f".write_probe_{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except (OSError, ValueError) as e:  # ValueError: e.g. a NUL byte in the path
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SetupError(f"{flag} {path!r} cannot be written ({reason}); choose another directory") from None


def forget_exit_record(run_dir: str, older_than: float) -> None:
    """Remove run_dir's exit.json when it names a signal and predates this start (its mtime before older_than, a
    time.time()), after a start that did not end cleanly (refused, crashed).

    docs/cluster.md's rule for a requeue loop: a non-zero status from torchrun with an exit.json
    that names a signal is a clean stop. A start refused for bad input writes nothing, so the
    previous start's "stopped by SIGTERM" would speak for it, and such a loop would requeue the
    bad command forever. Only that kind of record is removed: a finished run's record reads as
    no clean stop already, and every other file (checkpoints, metrics, config) stays as it was.
    A live run holding the directory's lock keeps its record, and so does this start (a stop it
    recorded before failing at teardown). Never raises: the start's own error is the one to report.
    """
    run = RunDir(run_dir)
    if "://" in run_dir or not os.path.isfile(run.exit_record):
        return
    try:
        if os.path.getmtime(run.exit_record) >= older_than:
            return
        with open(run.exit_record) as f:
            if not json.load(f).get("signal"):
                return
        with open(run.lock, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.remove(run.exit_record)
    except (OSError, ValueError, AttributeError):  # a live run holds the lock, a record that is not ours, ...
        pass


def lock_run_dir(run_dir: str):
    """Hold an exclusive lock on the run directory (RunDir.lock) for as long as the returned file stays open.

    Two runs writing one run directory would overwrite each other's checkpoints and data;
    the second now stops at once. The OS drops the lock when the process ends, even on
    SIGKILL, so no stale lock survives a crash. File systems without locks are not guarded.
    Raises SetupError naming the holder.
    """
    try:  # config.check_run_dir checked it can be, and created nothing; a race or a lying mount can still refuse
        os.makedirs(run_dir, exist_ok=True)
        f = open(RunDir(run_dir).lock, "a+")
    except OSError as e:
        raise SetupError(f"--run_dir {run_dir!r} cannot be written ({e.strerror or e}); choose another directory") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SetupError(f"--run_dir '{run_dir}' is in use by {holder}; wait for that run to end, "
                              f"or choose another --run_dir") from None
    except OSError:  # e.g. ENOLCK on a file system without locks
        return f
    f.seek(0)
    f.truncate()
    f.write(f"a run with pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f
