"""metrics.jsonl's records in Weights & Biases (metrics.wandb): one W&B run per run directory, continued on resume.

The run's id is kept in RUN_DIR/wandb_run_id, so every start of the run directory logs to
the same W&B run. A start that resumes from a step before the last one logged (the run
went past its last checkpoint before it was killed) rewinds the W&B run to that step
(``resume_from="ID?_step=N"``), as metrics.jsonl drops those records and TensorBoard purges
them: the steps are logged again and W&B holds one row per step. Offline
(``WANDB_MODE=offline``) each start writes its own RUN_DIR/wandb/offline-run-<time>-<ID>/
folder, the rewind recorded in it as the run's branch point; ``wandb sync`` uploads the
folders in order of start time.
"""
from __future__ import annotations

import os
import secrets
import string
import sys

from core.errors import SetupError, one_line, require
from storage.rundir import RunDir

WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
"""The values of WANDB_MODE that wandb 0.31 takes (its Settings.mode)."""


def _saved_id(path: str) -> str:
    with open(path) as f:
        found = f.read().strip()
    if not found or any(c in found for c in ":;,#?/' \t\n"):  # W&B's reserved characters, and blanks
        raise SetupError(f"{path} holds {found!r}, not a W&B run id; put the run's id in it (the last part "
                         f"of its URL), or delete the file to start a new W&B run")
    return found


def check_wandb(run_dir: str = "") -> None:
    """Checks before any collective: WANDB_MODE is one W&B takes, and run_dir's id file, if any, holds an id.

    Raises SetupError naming the variable or the file and the fix.
    """
    mode = os.environ.get("WANDB_MODE", "")
    if mode and mode not in WANDB_MODES:
        raise SetupError(f"WANDB_MODE={mode!r} is not a W&B mode; use one of {', '.join(WANDB_MODES[:3])}, or unset it")
    path = RunDir(run_dir).wandb_id if run_dir else ""
    if path and os.path.exists(path):
        _saved_id(path)


def run_id(run_dir: str) -> tuple[str, bool]:
    """(the W&B run id of run_dir, whether it is new): the id file's, or 8 random base-36 digits (as W&B makes them).

    A new id is not written here: save_run_id writes it once W&B started the run, so a refused
    start leaves the run directory as it was. Raises SetupError naming the id file when it
    holds no usable id (empty, or a character W&B refuses).
    """
    path = RunDir(run_dir).wandb_id
    if os.path.exists(path):
        return _saved_id(path), False
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)), True


def save_run_id(run_dir: str, rid: str) -> None:
    """Write rid into run_dir's id file (atomically), for every later start to continue the same W&B run."""
    path = RunDir(run_dir).wandb_id
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(rid + "\n")
    os.replace(tmp, path)


class WandbLog:
    """The W&B run of a run directory (rank 0 only): log(step, values), finish().

    project, entity, name, group: the [metrics] section's wandb_* fields ('' for W&B's default;
    name '' for the run directory's name). config: the resolved
    config, stored as the W&B run's config (the latest start's values win). resume_step: the
    step this start continues from; rewind: whether an earlier start logged steps after it
    (metrics.jsonl held them), which makes this start rewind the W&B run to resume_step.
    W&B's rewind is a preview feature of its server: where the server refuses it, the run is
    continued without it (W&B then keeps its first rows of the steps logged again) and one
    notice says so. Raises MissingPackageError without the wandb package, SetupError when
    W&B cannot start the run (no login, say) or the id file is bad.
    """

    def __init__(self, run_dir: str, config: dict, resume_step: int, rewind: bool, project: str = "",
                 entity: str = "", name: str = "", group: str = ""):
        wandb = require("wandb", "wandb", "metrics.wandb = true", "set it to false")
        rid, new = run_id(run_dir)
        base = dict(project=project or None, entity=entity or None,
                    name=name or os.path.basename(os.path.abspath(run_dir)),
                    group=group or None, dir=RunDir(run_dir).root, config=config,
                    allow_val_change=True)  # a resumed run may change train.steps, say
        self.run = None
        try:
            if rewind:
                try:
                    self.run = wandb.init(**base, resume_from=f"{rid}?_step={resume_step}")
                except wandb.Error as e:
                    print(f"[wandb] notice: W&B refused to rewind run {rid} to step {resume_step} ({one_line(e)}); "
                          f"continuing it instead, so W&B keeps the earlier values of the steps after "
                          f"{resume_step} (metrics.jsonl holds the new ones)", file=sys.stderr, flush=True)
            if self.run is None:
                self.run = wandb.init(**base, id=rid, resume="allow")
        except Exception as e:  # wandb.Error, and pydantic's errors for bad WANDB_* settings, among others
            raise SetupError(f"metrics.wandb = true: W&B could not start run {rid} ({one_line(e)}); check the "
                             f"WANDB_* variables, run `wandb login`, set WANDB_MODE=offline, or set "
                             f"metrics.wandb = false") from None
        if new:
            save_run_id(run_dir, rid)

    def log(self, step: int, values: dict) -> None:
        """Log values ({name: number}) at step; the values of one step logged in several calls make one W&B row."""
        self.run.log(values, step=step)

    def finish(self) -> None:
        """Finish the W&B run (flushes it: offline, the run's .wandb file is complete after this)."""
        self.run.finish()

