"""Checkpoints through torch.distributed.checkpoint (DCP): one call saves everything.

Layout under checkpoint.dir (default ``<run_dir>/checkpoints/``)::

    step_00000010/        committed: complete on every rank (DCP's .metadata, config.toml, .committed)
    step_00000015.tmp/    local: being written, or left by a crash: never loaded, removed on start
    step_00000020/        on a URL without .committed: being written or left by a crash, likewise

A local checkpoint is written under ``.tmp`` and renamed by rank 0 only after DCP's finish
step, which runs after every rank's writes, so a directory without ``.tmp`` is always
complete. An object store (checkpoint.dir = s3://bucket/prefix, see storage.py) has no
atomic rename: the step is written in place and rank 0 writes the ``.committed`` marker
last, inside DCP's finish step (after every rank's writes and the metadata), so a step
without the marker is never loaded and a failure to commit reaches every rank.
One DCP save holds the model, the optimizer, the LR schedule, the train state, the data
loader's global position and each rank's RNG state. Model and optimizer go through
``get_state_dict``/``set_state_dict`` as sharded DTensors keyed by the unwrapped module's
names, so a checkpoint loads at another world size or parallel layout.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from core.errors import ConfigError, UserError, one_line
from optimization.optimizers import reapply_schedule
from parallel import distributed, float8
from storage import fs
from storage.rundir import CONFIG_FILE, RunDir

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMMIT_MARKER = ".committed"
"""Written last into every checkpoint by rank 0; on a URL a step without it is incomplete."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the directory and the mismatch."""


@dataclasses.dataclass
class CheckpointConfig:
    dir: str = ""
    """Where checkpoints go: a local directory or a URL such as s3://BUCKET/PREFIX (endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION); empty: RUN_DIR/checkpoints."""
    interval: int = 500
    """Save every this many optimizer steps (and always at the end of training)."""
    keep: int = 3
    """Keep the newest this many complete checkpoints (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in a background thread while training goes on (state staged to CPU first)."""
    load_from: str = ""
    """Start from this checkpoint directory or URL (e.g. another run's) while the run directory has no checkpoint of its own; once it has, a re-run resumes from its own newest, so the same command survives preemption."""

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ConfigError(f"checkpoint.interval must be > 0, got {self.interval}")
        if self.keep < 0:
            raise ConfigError(f"checkpoint.keep must be >= 0, got {self.keep}")

    def root(self, run_dir: str) -> str:
        """The checkpoints directory or URL of a run: checkpoint.dir, else RunDir(run_dir).checkpoints."""
        return self.dir.rstrip("/") if self.dir else RunDir(run_dir).checkpoints


@dataclasses.dataclass
class TrainState:
    """Counters saved with every checkpoint."""

    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Training tokens consumed (global)."""
    recent_losses: list[float] = dataclasses.field(default_factory=list)
    """The spike guard's window of the last train.spike_window step losses (empty when it is off)."""
    recent_grad_norms: list[float] = dataclasses.field(default_factory=list)
    """The spike guard's window of the last train.spike_window gradient norms (pre-clip)."""
    outliers: int = 0
    """Consecutive steps up to this one that the spike rule called outliers (train.rollback_after counts them)."""
    rollbacks: int = 0
    """Automatic rollbacks made so far (train.rollback is the budget)."""


class AppState(Stateful):
    """Everything a run needs to continue, as one DCP Stateful.

    model/optimizer: sharded state from get_state_dict (no wrapper prefixes); scheduler:
    LR scheduler state; train: TrainState; data: the loader's DataState; rng: this rank's
    CPU (and CUDA) generator states, restored only at the same world size.
    """

    def __init__(self, model, optimizer, scheduler, train_state: TrainState, data_state, rank: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self.data_state, self.rank = train_state, data_state, rank

    def _rng(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": float8.plain_state_dict(model_sd),  # the same plain tensors with train.float8 on or off
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "train": dataclasses.asdict(self.train_state),
            "data": dataclasses.asdict(self.data_state),
            f"rng_rank{self.rank}": self._rng(),
        }

    def load_state_dict(self, sd: dict) -> None:
        # The config in force is this run's: the saved optimizer brings its moments, momentum buffers
        # and step counts, but every group's hyperparameters (lr, weight_decay, betas, eps, momentum)
        # and the schedule's base LRs are the ones this run's optimizer was built with.
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        base_lrs = list(self.scheduler.base_lrs)
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for group, values in zip(self.optimizer.param_groups, hyper):
            group.update(values)
        self.scheduler.load_state_dict(sd["scheduler"])
        self.scheduler.base_lrs = base_lrs
        reapply_schedule(self.scheduler)  # this run's train.steps and optim.lr, not the saved run's
        for k, v in sd["train"].items():
            setattr(self.train_state, k, v)
        for k, v in sd["data"].items():
            setattr(self.data_state, k, v)
        rng = sd.get(f"rng_rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])


def step_dir(root: str, step: int) -> str:
    """The directory (or URL) of step's checkpoint under root."""
    return fs.join(root, f"step_{step:08d}") if root else f"step_{step:08d}"


def is_complete(path: str) -> bool:
    """Whether the checkpoint at path is committed: local, DCP's .metadata (renamed in whole); URL, the marker."""
    return fs.isfile(fs.join(path, COMMIT_MARKER if fs.is_url(path) else ".metadata"))


def checkpoint_step(path: str) -> int | None:
    """The step of a checkpoint directory or URL named step_N (N: optimizer steps done), else None."""
    m = _STEP_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoints under root (a directory or URL) as [(step, path)], oldest first.

    Local '.tmp' directories and, on a URL, steps without COMMIT_MARKER are left out.
    """
    found = [(int(m.group(1)), fs.join(root, name)) for name in fs.listdir(root)
             for m in [_STEP_DIR.match(name)] if m]
    return sorted((step, path) for step, path in found if is_complete(path))


def read_metadata(path: str):
    """DCP metadata of a checkpoint (a directory or URL); raises CheckpointError naming the file if unreadable
    or, on a URL, if the checkpoint was never committed."""
    meta_file = fs.join(path, ".metadata")
    try:
        if not fs.isfile(meta_file):
            hint = ("it does not exist" if not fs.exists(path) else "no .metadata file (it is a run directory)" if
                    (not fs.is_url(path) and os.path.isdir(RunDir(path).checkpoints)) else "no .metadata file, so not a complete DCP checkpoint")
            raise CheckpointError(f"checkpoint '{path}': {hint}; give a checkpoint folder, e.g. "
                                  f"RUN_DIR/checkpoints/step_00000200")
        if fs.is_url(path) and not fs.isfile(fs.join(path, COMMIT_MARKER)):
            raise CheckpointError(f"checkpoint '{path}' has no {COMMIT_MARKER} marker: its save never finished; "
                                  f"pick another checkpoint")
        return (fs.dcp_reader(path) or dcp.FileSystemReader(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # pickle or IO errors of any kind
        raise CheckpointError(f"checkpoint '{path}': cannot read '{meta_file}': {one_line(e)}") from e


def check_compatible(path: str, model_shapes: dict[str, torch.Size]) -> None:
    """Compare a checkpoint's model tensors with the model's full shapes before loading.

    Raises CheckpointError listing missing, unexpected and mismatched keys (with shapes).
    """
    meta = read_metadata(path)
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel and not fs.isfile(fs.join(path, rel)):
            raise CheckpointError(f"checkpoint '{path}' is incomplete: '{rel}' is missing; resume from another "
                                  f"checkpoint with --checkpoint.load_from, or delete this one")
    saved = {k[len("app.model."):]: tuple(v.size) for k, v in meta.state_dict_metadata.items()
             if k.startswith("app.model.") and hasattr(v, "size")}
    if not saved:
        raise CheckpointError(f"checkpoint '{path}' holds no model weights (keys app.model.*)")
    want = {k: tuple(s) for k, s in model_shapes.items()}
    problems = [f"{k}: checkpoint {saved[k]} vs model {want[k]}" for k in sorted(want) if k in saved and saved[k] != want[k]]
    problems += [f"{k}: missing from checkpoint" for k in sorted(set(want) - set(saved))]
    problems += [f"{k}: not in model" for k in sorted(set(saved) - set(want))]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(
            f"checkpoint '{path}' was saved from another model ({shown}); "
            f"use the model config it was trained with, or another run directory"
        )


def newest_checkpoint(root: str) -> str:
    """The newest complete checkpoint under root (a run's checkpoint directory or URL); CheckpointError if none."""
    found = complete_checkpoints(root)
    if not found:
        raise CheckpointError(f"no complete checkpoint in '{root}'")
    return found[-1][1]


def read_model_weights(path: str, state_dict: dict[str, torch.Tensor], no_dist: bool = True,
                       model_shapes: dict[str, torch.Size] | None = None) -> None:
    """Fill state_dict (our names -> tensors, plain or DTensor) in place from checkpoint path's model.

    Reads only the "app.model.*" entries, whatever world size or layout saved them. no_dist:
    read in this process alone (no process group); False: a collective read, every rank calls.
    model_shapes: the whole model's full shapes, when state_dict holds only some of its tensors
    (then only those are read). Raises CheckpointError listing missing or mismatched keys
    (check_compatible, against the whole model), or naming a damaged shard file.
    """
    check_compatible(path, model_shapes or {k: v.shape for k, v in state_dict.items()})
    with warnings.catch_warnings():  # DCP warns that it assumes one process, which is the point
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load({"app": {"model": state_dict}}, checkpoint_id=path, storage_reader=fs.dcp_reader(path),
                     no_dist=no_dist)
        except (CheckpointException, OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
            # A truncated or overwritten shard file: the metadata was fine, the data is not.
            raise CheckpointError(f"checkpoint '{path}' is damaged, its weights cannot be read "
                                  f"({one_line(e)}); pick another with --checkpoint") from e


class Checkpointer:
    """Saves and finds checkpoints of one run; every rank holds one.

    save() is collective (all ranks call it at the same step). With async_save the write
    runs in a background thread on a dedicated gloo group; at most one save is in flight,
    and rank 0 commits it (local: rename; URL: the marker, inside DCP's finish step), then
    prunes to checkpoint.keep, once DCP reports it finished. root: a directory or a URL.
    A save that fails (a full disk, a store that stays down) raises CheckpointError on
    every rank naming root and the last complete checkpoint, which stays as it was.
    """

    def __init__(self, cfg: CheckpointConfig, root: str, rank: int, config_text: str | None = None):
        self.cfg = cfg
        self.config_text = config_text  # the run's resolved config, written into every checkpoint
        self.root = root  # the run's checkpoints directory (RunDir.checkpoints) or URL (checkpoint.dir)
        self.remote = fs.is_url(root)
        self.rank = rank
        self._pending: tuple[Future, str, str] | None = None
        self._last_step = -1  # the same on every rank, unlike a directory listing during a commit
        self.last_complete = ""  # the newest checkpoint known complete (loaded or committed), for error messages
        self._async_group = dist.new_group(backend="gloo") if cfg.async_save else None
        # One stager for the whole run: it keeps its CPU copy between saves, so the loop blocks
        # only for a memcpy, not for allocating (and faulting in) a fresh copy every time.
        # At most one save is in flight (save() waits first), so the copy is never overwritten mid-write.
        self._stager = None
        if cfg.async_save:
            pinned = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))

    def clean_partial(self) -> None:
        """Remove what a crash left (rank 0; call before the first save): local '.tmp' directories, and on a
        URL the steps without a commit marker.

        Raises CheckpointError, before anything is trained, when checkpoints/ or an entry named
        like a checkpoint is not a directory: a later save would fail there.
        """
        if self.rank != 0:
            return
        if self.remote:
            for name in fs.listdir(self.root):
                path = fs.join(self.root, name)
                if _STEP_DIR.match(name) and not is_complete(path):
                    print(f"[checkpoint] removing {path}: its save never finished (no {COMMIT_MARKER})", flush=True)
                    fs.remove(path)
            return
        if not os.path.lexists(self.root):
            return
        if not os.path.isdir(self.root):
            raise CheckpointError(f"'{self.root}' is not a directory; move it away so checkpoints can be saved there")
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if _STEP_DIR.match(name.removesuffix(".tmp")) and not os.path.isdir(path):
                raise CheckpointError(f"'{path}' is not a checkpoint directory; move it away so checkpoints can be "
                                      f"saved there")
            if name.endswith(".tmp"):
                shutil.rmtree(path, ignore_errors=True)

    def resume_path(self) -> str | None:
        """The checkpoint to resume from: checkpoint.load_from, else the newest complete one, else None.

        Raises CheckpointError if load_from is given but is not a complete checkpoint.
        """
        found = complete_checkpoints(self.root)
        if self.cfg.load_from:
            if not found:  # once the run has its own, the source may be gone: only read it when it is used
                read_metadata(self.cfg.load_from)
                return self.cfg.load_from
            if _differ(found[-1][1], self.cfg.load_from):
                print(f"[checkpoint] {self.root} has checkpoints of its own: resuming from the newest, "
                      f"{found[-1][1]}, not checkpoint.load_from; to go back to an older one, move the newer "
                      f"ones out of {self.root}", flush=True)
        return found[-1][1] if found else None

    def load(self, path: str, state: AppState) -> None:
        """Load path into state in place (collective). The caller checks compatibility first."""
        target = _Loading(state, set(read_metadata(path).state_dict_metadata))
        try:
            dcp.load({"app": target}, checkpoint_id=path, storage_reader=fs.dcp_reader(path))
        except CheckpointException as e:  # DCP gathers every rank's failure, so all ranks get here
            failures = "; ".join(f"rank {r}: {one_line(err[0])}"
                                 for r, err in sorted(e.failures.items())[:2])
            raise CheckpointError(f"checkpoint '{path}' is damaged, it cannot be read ({failures}); resume from "
                                  f"another one with --checkpoint.load_from, or move this one away") from e
        self._last_step = state.train_state.step
        self.last_complete = path

    def save(self, step: int, state: AppState) -> None:
        """Write a checkpoint for step (collective); commit it at once or, async, when done.

        Raises CheckpointError on every rank when the write or the commit fails (see the class).
        """
        if step == self._last_step:
            return  # e.g. the final save right after an interval save
        self.wait()
        self._last_step = step
        final = step_dir(self.root, step)
        if self.remote:  # written in place: a committed step would keep its marker while mixed
            distributed.on_rank0(lambda: self._refuse_rewrite(final), self.rank)
        target = final if self.remote else final + ".tmp"  # an object store has no rename: write in place
        writer = fs.dcp_writer(target, after_finish=lambda: self._write_marker(final))
        if not self.remote:
            os.makedirs(self.root, exist_ok=True)
        try:
            if self.cfg.async_save:
                fut = dcp.async_save({"app": state}, checkpoint_id=target, storage_writer=writer,
                                     process_group=self._async_group, async_stager=self._stager)
                self._pending = (fut, target, final)
            else:
                dcp.save({"app": state}, checkpoint_id=target, storage_writer=writer)
                self._commit(target, final)
        except (CheckpointException, OSError) as e:
            raise self._failed(step, e) from None

    def _refuse_rewrite(self, final: str) -> None:
        if is_complete(final):
            raise CheckpointError(f"checkpoint '{final}' is committed already and is never rewritten; does another "
                                  f"run write to {self.root}? The run stops here")

    def poll(self) -> None:
        """Commit a finished asynchronous save without waiting for an unfinished one."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight asynchronous save (if any) is written, then commit it.

        Raises CheckpointError when that save failed.
        """
        if self._pending is None:
            return
        fut, tmp, final = self._pending
        self._pending = None
        try:
            fut.result()
            self._commit(tmp, final)
        except (CheckpointException, OSError) as e:
            raise self._failed(self._last_step, e) from None

    def close(self) -> None:
        """Finish the in-flight save and free the asynchronous staging copy."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _failed(self, step: int, e: BaseException) -> CheckpointError:
        last = self.last_complete or "none yet"
        return CheckpointError(f"saving the checkpoint of step {step} to {self.root} failed ({one_line(e)}); the "
                               f"last complete checkpoint, {last}, is untouched; the run stops here: fix the store "
                               f"or disk, then run the same command to resume from it")

    def _write_marker(self, final: str) -> None:
        """Rank 0, inside DCP's finish step of a URL save: config.toml, then the commit marker, last."""
        if self.config_text is not None:
            fs.write_bytes(fs.join(final, CONFIG_FILE), self.config_text.encode())
        fs.write_bytes(fs.join(final, COMMIT_MARKER), b"")

    def _commit(self, tmp: str, final: str) -> None:
        self.last_complete = final
        if self.rank != 0:
            return
        if not self.remote:
            if self.config_text is not None:
                with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                    f.write(self.config_text)
            open(os.path.join(tmp, COMMIT_MARKER), "w").close()  # so a copy to a store reads as committed
            if os.path.exists(final):
                if os.path.isfile(os.path.join(final, ".metadata")):
                    raise CheckpointError(f"checkpoint '{final}' exists already; does another run write to this "
                                          f"run directory?")
                shutil.rmtree(final)  # a step directory without .metadata: what is left of a broken or deleted one
            os.replace(tmp, final)
        if self.cfg.keep > 0:
            for _, old in complete_checkpoints(self.root)[:-self.cfg.keep]:
                fs.remove(old)


def _differ(a: str, b: str) -> bool:
    """Whether two checkpoint paths or URLs name different checkpoints (local paths compared after resolving links)."""
    if fs.is_url(a) or fs.is_url(b):
        return a.rstrip("/") != b.rstrip("/")
    return os.path.realpath(a) != os.path.realpath(b)


class _Loading(Stateful):
    """The AppState view a load fills: only entries the checkpoint holds.

    The RNG entry only when this rank existed in the saving run; the train state's fields as
    saved; the data state entry by entry as saved (its per-source counts are a dict keyed by source name; a checkpoint from
    before mixtures holds consumed_samples alone), so fields it lacks keep their defaults.
    """

    def __init__(self, inner: AppState, saved_keys: set[str]):
        self.inner, self.saved_keys = inner, saved_keys

    def state_dict(self) -> dict:
        sd = {k: v for k, v in self.inner.state_dict().items()
              if not k.startswith("rng_rank") or any(s.startswith(f"app.{k}.") for s in self.saved_keys)}
        data: dict = {}
        for key in sorted(self.saved_keys):
            if key.startswith("app.data."):  # DCP's flattened name: app.data.FIELD[.SOURCE]
                *parents, leaf = key.split(".")[2:]
                node = data
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = 0  # a placeholder of the saved value, which DCP puts in its place
        sd["data"] = data
        # A checkpoint from before the spike guard has no windows: they keep their (empty) defaults.
        sd["train"] = {k: v for k, v in sd["train"].items() if f"app.train.{k}" in self.saved_keys}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)
