"""Where a run starts from, and what a resume may change: the checks before a checkpoint is loaded.

A resume continues the checkpoint's state under this command's config. What cannot change (the
model, the data cursor's windows, the seed, the optimizer whose state it holds) is refused in
one line naming the field; what can change is named in the start-up line, value by value, and
then honoured (the optimizer's hyperparameters and the schedule come from the config:
checkpoint.AppState.load_state_dict).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Callable

import tomllib
import torch

from checkpoint import CheckpointConfig, Checkpointer, CheckpointError, check_compatible, complete_checkpoints
from config import Config
from core.errors import SetupError
from data import mixture_note
from data_pipeline.tokenizer import same_tokenizer
from model import ModelArgs, Transformer
from nn import parametrization
from nn.moe_args import MOE_FIELDS
from storage import fs
from storage.rundir import CONFIG_FILE, RunDir


def resume_point(cfg: Config, ckpt: Checkpointer) -> tuple[str | None, str]:
    """(checkpoint to resume from or None, the start-up line's note of what changed) on rank 0.

    Removes what a crash left first (Checkpointer.clean_partial). Raises CheckpointError when the
    checkpoint does not fit this model, data cursor, seed or optimizer. Writes nothing else: the
    owner record of an explicit checkpoint.dir is claim_checkpoint_dir's, once the data is ready.
    """
    check_owner(cfg, ckpt.root)  # before clean_partial: another run's unfinished step is not ours to remove
    ckpt.clean_partial()
    path = ckpt.resume_path()
    if path is None:
        check_not_moved(cfg, ckpt.root)
        return None, ""
    if cfg.init_from_hf:  # as checkpoint.load_from says (Checkpointer.resume_path): the flag starts a new run only
        print(f"[checkpoint] {ckpt.root} has checkpoints of its own: resuming from the newest, {path}, not "
              f"--init_from_hf {cfg.init_from_hf}, which only starts a new run; for that, give a new --run_dir",
              flush=True)
    check_steps_left(path, cfg.train.steps)  # nothing could run, and config.toml would get a train.steps never run
    saved = saved_config(path)  # read once: on a store every read is a request
    if saved.get("model"):  # saved before model.parametrization (sp) or the base multipliers (mup's q.k / head_dim)
        saved["model"] = {**parametrization.predated(saved["model"]), **saved["model"]}
    check_same_experts(path, saved.get("model", {}), cfg.model.n_experts)
    # Fields first: they name what differs, where shapes could only list tensors.
    check_same_config(path, saved, "model", dataclasses.asdict(cfg.model))
    # The data cursor counts windows of seq_len among the train windows: another length or
    # split would point it elsewhere in the corpus.
    check_same_config(path, saved, "data", {"seq_len": cfg.data.seq_len, "val_fraction": cfg.data.val_fraction})
    check_same_config(path, saved, "train", {"seed": cfg.train.seed})  # it seeds the data order too
    check_same_optimizer(path, saved.get("optim", {}).get("name", cfg.optim.name), cfg.optim.name)
    with torch.device("meta"):
        check_compatible(path, {k: v.shape for k, v in Transformer(cfg.model).state_dict().items()})
    batch = saved.get("train", {}).get("global_batch_size", cfg.train.global_batch_size)
    notes = [] if batch == cfg.train.global_batch_size else \
        [f"train.global_batch_size {batch} -> {cfg.train.global_batch_size} (the data position is kept, in samples)"]
    notes += changed(saved, "optim", dataclasses.asdict(cfg.optim))
    notes.append(mixture_note(saved.get("data", {}), cfg.data))
    return path, "; ".join(n for n in notes if n)


def claim_checkpoint_dir(cfg: Config, root: str) -> None:
    """Write the owner record of an explicit checkpoint.dir if it has none (rank 0; check_owner's claim)."""
    check_owner(cfg, root)()


def check_steps_left(path: str, steps: int) -> None:
    """CheckpointError when steps (train.steps) is below the steps done in checkpoint path (named step_N); equal is
    a finished run, which the loop leaves as it is."""
    name = path.rstrip("/").rsplit("/", 1)[-1].removeprefix("step_")
    done = int(name) if name.isdigit() else 0
    if done > steps:
        raise CheckpointError(f"train.steps ({steps}) is below the {done} steps already done in {path}: pass "
                              f"--train.steps above {done} to continue this run, or branch from an earlier "
                              f"checkpoint with --checkpoint.load_from and a new --run_dir")


OWNER_FILE = "owner.json"
"""At the root of an explicit checkpoint.dir: {"run_dir": the absolute run directory that owns it}."""


def check_owner(cfg: Config, root: str) -> Callable[[], None]:
    """Check that checkpoint.dir is free or this run's (CheckpointError naming its owner otherwise); returns the claim,
    which writes the owner record once every other check of the start has passed.

    Two runs on one location would resume from each other's steps and overwrite them. The
    owner is the run directory (as an absolute path, the same on every node of a job) in
    ROOT/owner.json, written at the first start; a location from before owner records is owned
    by the run directory its newest checkpoint's config.toml names. RUN_DIR/checkpoints
    belongs to its run directory anyway (and its lock guards it): nothing is written there.
    """
    if not cfg.checkpoint.dir:
        return lambda: None
    me, record = os.path.abspath(cfg.run_dir), fs.join(root, OWNER_FILE)
    try:
        owner = json.loads(fs.read_bytes(record)).get("run_dir", "")
        written = True
    except FileNotFoundError:
        found = complete_checkpoints(root)
        owner = saved_config(found[-1][1]).get("run_dir", "") if found else ""
        owner, written = (os.path.abspath(owner) if owner and not fs.is_url(owner) else owner), False
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint.dir {root}: {record} is not an owner record ({e}); delete it if no "
                              f"other run writes there") from None
    if owner and owner != me:
        raise CheckpointError(
            f"checkpoint.dir {root} belongs to the run in {owner} ({record}): two runs on one location would overwrite "
            f"each other's checkpoints; give this run its own --checkpoint.dir (start from one of those with "
            f"--checkpoint.load_from), or, if this is that run moved to {me}, delete {record}")

    def claim() -> None:
        if not written:
            if not fs.is_url(root):
                os.makedirs(root, exist_ok=True)
            fs.write_bytes(record, json.dumps({"run_dir": me}).encode())

    return claim


def check_not_moved(cfg: Config, root: str) -> None:
    """Refuse a fresh start in root when the run directory's checkpoints are elsewhere (CheckpointError).

    Where they were: the checkpoint.dir of the run directory's config.toml (the last start's),
    and RUN_DIR/checkpoints. A job moved to a bucket, or a typo in checkpoint.dir, would
    otherwise start over and drop the run's metrics history. --checkpoint.load_from says a new
    start from a checkpoint is meant.
    """
    if cfg.checkpoint.load_from:
        return
    run = RunDir(cfg.run_dir)
    before = ""
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError, AttributeError, UnicodeDecodeError):
        with open(run.config, "rb") as f:
            before = tomllib.load(f).get("checkpoint", {}).get("dir", "")
    for old in dict.fromkeys([CheckpointConfig(dir=before).root(cfg.run_dir), run.checkpoints]):
        if old == root:
            continue
        try:
            found = complete_checkpoints(old)
        except Exception:  # a store this start cannot reach: nothing known to be lost there
            continue
        if found:
            raise CheckpointError(
                f"checkpoint.dir {root} holds no checkpoint, but run directory {cfg.run_dir} has its checkpoints in "
                f"{old} (newest: step {found[-1][0]}); starting over here would drop its history: copy them to "
                f"{root}, or pass --checkpoint.load_from {found[-1][1]}, or start over in a new --run_dir")


def changed(saved: dict, section: str, current: dict) -> list[str]:
    """'section.field old -> new' for every field of section whose saved value (config.toml) differs."""
    old = saved.get(section, {})
    return [f"{section}.{k} {old[k]!r} -> {v!r}".replace("'", "") for k, v in current.items()
            if k in old and old[k] != (list(v) if isinstance(v, tuple) else v)]


def check_same_experts(path: str, saved: dict, current: int) -> None:
    """Raise CheckpointError when a mixture-of-experts checkpoint is resumed as a dense model or the reverse.

    saved: the checkpoint's [model] section (without n_experts: saved dense, before MoE existed);
    current: this run's model.n_experts. The message gives the flags of the checkpoint's model.
    """
    n = saved.get("n_experts", 0)
    if bool(n) == bool(current):
        return
    if n:
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs)}
        flags = "".join(f" --model.{k} {str(saved[k]).lower() if isinstance(saved[k], bool) else saved[k]}"
                        for k in MOE_FIELDS if k in saved and saved[k] != defaults[k])
        raise CheckpointError(f"checkpoint '{path}' holds a mixture of experts (model.n_experts {n}), but this run is "
                              f"a dense model (model.n_experts 0); pass --model.n_experts {n}{flags} to resume it, or "
                              f"start a new --run_dir")
    raise CheckpointError(f"checkpoint '{path}' holds a dense model (model.n_experts 0), but this run is a mixture of "
                          f"experts (model.n_experts {current}); resume it without --model.n_experts and the other expert "
                          f"options, or start a new --run_dir")


def check_same_optimizer(path: str, saved: str, current: str) -> None:
    """Raise CheckpointError when the checkpoint holds the state of another optim.name than this run's."""
    if saved != current:
        raise CheckpointError(
            f"checkpoint '{path}' holds the state of optim.name {saved!r}, but this run has {current!r}: one "
            f"optimizer's state cannot continue as another's; resume with --optim.name {saved}, or start a new "
            f"--run_dir from its weights alone (python hf.py export --run_dir RUN --checkpoint {path} --out DIR, "
            f"then --init_from_hf DIR)")


def saved_config(path: str) -> dict:
    """The config a checkpoint was saved with (its config.toml as a dict of sections; {} if it has none).

    Raises CheckpointError naming the file if it cannot be read.
    """
    saved_file = fs.join(path, CONFIG_FILE)
    try:
        return tomllib.loads(fs.read_bytes(saved_file).decode())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"checkpoint '{path}': cannot read '{saved_file}': {e}") from e


def check_same_config(path: str, saved: dict, section: str, current: dict) -> None:
    """Compare a checkpoint's saved [section] (saved: its config.toml, from saved_config) with the current values.

    Catches what shapes cannot (e.g. model.rope_theta, or n_heads vs head_dim at equal
    widths) and names the fields. Checkpoints without a config.toml, and fields they lack,
    are not checked. Raises CheckpointError naming each differing field with both values.
    """
    old = saved.get(section, {})
    diffs = [f"{section}.{k}: checkpoint {old[k]!r}, now {v!r}" for k, v in current.items()
             if k in old and old[k] != v]
    if diffs:
        raise CheckpointError(
            f"checkpoint '{path}' was saved with other settings ({'; '.join(diffs)}); "
            f"use the settings it was trained with, or another run directory"
        )


def source_tokenizer(cfg: Config, source: str, source_tokenizer_path: str) -> str:
    """Give a new start from another run's weights the tokenizer those weights were trained with.

    Called on every rank before any collective (check_run). source names the weights
    ('checkpoint.load_from P' or 'init_from_hf F'); source_tokenizer_path is their tokenizer.json.
    Token ids mean nothing under another tokenizer, so: a run with no tokenizer of its own yet
    (no data.tokenizer, no prepared data/) takes the source's as data.tokenizer; a run whose
    tokenizer is fixed (data.tokenizer, or data/ prepared without it) keeps it when it encodes as
    the source's, and is refused (SetupError naming both) when not. Returns the start-up note
    ('' when nothing changed).
    """
    own = cfg.data.tokenizer or (RunDir(cfg.run_dir).tokenizer if not cfg.data.prepared else "")
    if own and os.path.isfile(own) or cfg.data.tokenizer:
        if not same_tokenizer(own, source_tokenizer_path):
            where = "data.tokenizer" if cfg.data.tokenizer else "the tokenizer of its prepared data"
            raise SetupError(f"{source} was trained with the tokenizer {source_tokenizer_path}, but this run's "
                             f"({where}) is {own}, which encodes text otherwise: the weights' token ids would mean "
                             f"other tokens; start in a new --run_dir without data.tokenizer (it takes the source's), "
                             f"or use the source's tokenizer")
        return ""
    if cfg.data.prepared:
        return ""
    cfg.data.tokenizer = source_tokenizer_path
    return f"data.tokenizer {source_tokenizer_path}: the tokenizer {source} was trained with"


def checkpoint_tokenizer(path: str) -> str:
    """The tokenizer.json a local checkpoint was trained with ('' when it cannot be found; URLs are not searched).

    In order: the checkpoint's own tokenizer.json, its config.toml's data.tokenizer, the
    tokenizer of its run directory's data/ (its config.toml's run_dir, or the folder above its
    checkpoints/).
    """
    if fs.is_url(path):
        return ""
    saved = saved_config(path)
    run_dirs = [saved.get("run_dir", ""), os.path.dirname(os.path.dirname(os.path.abspath(path)))]
    for candidate in (os.path.join(path, "tokenizer.json"), saved.get("data", {}).get("tokenizer", ""),
                      *(RunDir(r).tokenizer for r in run_dirs if r and not fs.is_url(r))):
        if candidate and os.path.isfile(candidate):
            return candidate
    return ""
