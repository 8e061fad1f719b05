"""Automatic rollback (train.rollback): a divergence sends the run back to its last good checkpoint, past the data.

PaLM's remedy for a loss spike (Chowdhery et al. 2022, section 5.1: restart about 100 steps
before the spike and skip 200-500 batches), done by the run itself. On a Divergence
(training/step.py: a non-finite norm, or train.rollback_after outliers of the spike rule in a
row, raised before the update and alike on every rank) every rank:

1. loads the newest complete checkpoint of step C <= first outlier - train.rollback_margin,
   after removing the checkpoints newer than C (they hold the diverged run, and the run
   saves those steps again);
2. adds the batches from the one step C + 1 would draw up to the divergent step's own
   batch to the data position's skips (DataState.skips, numbered as [[train.skip]]), so a
   resume, a restart or a fresh run given those tables trains on the same data;
3. writes one metrics.jsonl record {"step": S, "rollback": {"to_step": C, "skip": [a, b],
   "trigger": ...}}, drops the records of the steps after C (as a resume does) and prints
   one line; then trains on from step C + 1.

The count is saved in the train state; once train.rollback are made, the next divergence
stops the run before the update with one line: the checkpoint the next run resumes from (the
newest good one; none before the first: then the next run starts over), the skips, and the
[[train.skip]] tables to add. The checkpoints newer than that one (an outlier's update may be in
them) are moved, whole, into a folder beside them that no resume looks in (set_aside, below),
which the line names; so the same command with those tables added is a fresh run given them from
the start. train.rollback_lr_factor f < 1 scales the schedule by f after each rollback (f^n after
n rollbacks, also when a resume loads a checkpoint saved after them).
"""
from __future__ import annotations

import os

from checkpoint import COMMIT_MARKER, complete_checkpoints
from core.errors import TrainingError, UserError, one_line
from data_pipeline.loader import merge_ranges
from observability.metrics import MetricsLog
from observability.progress import Progress
from optimization.optimizers import scale_lr
from parallel import distributed
from storage import fs
from training.session import Session
from training.step import Divergence


class Rollback:
    """Handles the loop's Divergence: back to a good checkpoint with the bad data skipped, or a stop (see the module)."""

    def __init__(self, s: Session, log: MetricsLog, progress: Progress):
        self.s, self.log, self.progress = s, log, progress

    def run(self, d: Divergence) -> None:
        """Roll back after d (collective); afterwards s.train_state.step is the checkpoint's step.

        Raises TrainingError on every rank when the budget (train.rollback) is spent or no
        checkpoint is old enough: nothing is loaded, removed or overwritten then; the checkpoints
        newer than the one the line names are moved aside (see the module).
        """
        s, t = self.s, self.s.cfg.train
        s.ckpt.wait()  # an asynchronous save in flight is committed first: it may be the target
        limit = d.first - t.rollback_margin
        target = distributed.on_rank0(lambda: _newest_at_most(s.ckpt.root, limit), s.rank)
        made = s.train_state.rollbacks
        if target is None or made >= t.rollback:
            raise TrainingError(self._stop_line(d, target, made))
        to_step, path = target
        diverged_batch, skips = s.loader.state.steps, [list(r) for r in s.loader.state.skips]
        distributed.on_rank0(lambda: _remove_after(s.ckpt.root, to_step), s.rank)
        s.ckpt.load(path, s.app)
        scale_lr(s.scheduler, t.rollback_lr_factor ** (made + 1))  # the load set this run's optim.lr
        s.loader.state.skips = skips  # the loaded state may predate earlier rollbacks: their skips stay
        skip = [s.loader.next_data_step(), diverged_batch]
        s.loader.state.skips = merge_ranges([*map(tuple, skips), tuple(skip)])
        s.train_state.rollbacks = made + 1
        distributed.on_rank0(lambda: self.log.rewind(to_step), s.rank)  # a W&B that fails here stops every rank
        self.log.note({"step": d.step, "rollback": {"to_step": to_step, "skip": skip, "trigger": d.trigger}})
        self.progress.rewind(to_step)
        lr = f"; LR x{t.rollback_lr_factor ** (made + 1):g} from here" if t.rollback_lr_factor != 1 else ""
        self.progress.write(f"[train] step {d.step}: {d.trigger}; rollback {made + 1} of {t.rollback}: back to "
                            f"{path} (step {to_step}), skipping data steps {skip[0]}-{skip[1]} "
                            f"([[train.skip]] start_step = {skip[0]}, end_step = {skip[1]}){lr}")

    def _stop_line(self, d: Divergence, target: tuple[int, str] | None, made: int) -> str:
        """The stop's one line; first (rank 0, collective) the checkpoints newer than the one the next run must
        resume from are set aside, so that the remedy it names, applied as printed, is a fresh run given its
        tables."""
        s, t = self.s, self.s.cfg.train
        after = target[0] if target else 0
        moved, folder, failed = distributed.on_rank0(lambda: _set_aside(s.ckpt.root, after, d.step), s.rank)
        bad = s.loader.drawn(d.step - d.first + 1)
        fix = f"add {_tables(s.loader, (bad[0], bad[-1]), d)} to the --config file and run the same command"
        which = "the run's checkpoints" if target is None else f"the checkpoints after step {after}"
        if moved:
            steps = ("steps " if len(moved) > 1 else "step ") + ", ".join(map(str, moved))
            fix = f"{which} ({steps}) were moved to {folder}; {fix}"
        elif failed:
            fix = f"{which} could not be moved away ({failed}): move them out of {s.ckpt.root} by hand first; {fix}"
        if target is None:
            start = "from checkpoint.load_from again" if s.cfg.checkpoint.load_from else "from step 0"
            where = (f"no checkpoint in {s.ckpt.root} is from step {d.first - t.rollback_margin} or before (the "
                     f"first outlier, step {d.first}, minus train.rollback_margin) to roll back to: the next run "
                     f"starts {start}; {fix}")
        else:
            where = (f"the rollback budget is spent (train.rollback {t.rollback}; {made} made); data steps skipped: "
                     f"{_ranges(s.loader.state.skips)} by rollbacks, {_ranges(s.loader.config_skips)} by "
                     f"[[train.skip]]; the next run resumes from the newest good checkpoint, {target[1]} (step "
                     f"{target[0]}): {fix}, or raise train.rollback")
        return f"step {d.step}: {d.trigger}; stopped before the update; {where}"


def _ranges(ranges) -> str:
    """'4-8, 20-21' for [[4, 8], [20, 21]] (merged first), or 'none'."""
    return ", ".join(f"{a}-{b}" for a, b in merge_ranges(map(tuple, ranges))) or "none"


def _tables(loader, bad: tuple[int, int], d: Divergence) -> str:
    """The [[train.skip]] tables a stop's remedy adds: the diverging batches and the rollbacks' skips not already
    configured (the checkpoint resumed from, or a new start, may predate those rollbacks), as few as cover them."""
    configured = merge_ranges(loader.config_skips)
    out = []
    for a, b in merge_ranges([*map(tuple, loader.state.skips), bad]):
        if any(c <= a and b <= e for c, e in configured):
            continue
        has_bad = a <= bad[0] and bad[1] <= b
        why = (f"the batches of steps {d.first}-{d.step}" + (" and a rollback's skip" if (a, b) != bad else "")
               if has_bad else "a rollback's skip")
        out.append(f"[[train.skip]] start_step = {a}, end_step = {b} ({why})")
    return " and ".join(out)


def _set_aside(root: str, after: int, step: int) -> tuple[list[int], str, str]:
    """set_aside, its failure as text: (steps moved, folder, '' or why it failed)."""
    try:
        return (*set_aside(root, after, step), "")
    except (OSError, UserError) as e:  # the stop's line must still reach every rank, naming what to move by hand
        return [], "", one_line(e)


def _newest_at_most(root: str, step: int) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint under root of step <= step, or None."""
    found = [c for c in complete_checkpoints(root) if c[0] <= step]
    return found[-1] if found else None


def _remove_after(root: str, step: int) -> None:
    """Remove the complete checkpoints under root newer than step (rank 0): states of the diverged run."""
    for later, path in complete_checkpoints(root):
        if later > step:
            fs.remove(path)


SET_ASIDE = "diverged_at_step_{step}"
"""The folder under a checkpoint root that set_aside moves checkpoints into: no resume, load or prune looks there."""


def set_aside(root: str, after: int, step: int) -> tuple[list[int], str]:
    """Move the complete checkpoints under root newer than step `after` into root/SET_ASIDE (rank 0).

    They are kept whole (step: the divergent step, which names the folder; .2, .3 ... when that
    name is taken), but resume discovery, checkpoint.keep's pruning and clean_partial match only
    step_N names at root's top, so the next start resumes from the newest at or before `after`.
    Returns (the steps moved, the folder); ([], '') when none is newer. Raises OSError when a
    move fails (what was moved stays moved).
    """
    later = [(s, path) for s, path in complete_checkpoints(root) if s > after]
    if not later:
        return [], ""
    folder, n = fs.join(root, SET_ASIDE.format(step=step)), 1
    while fs.exists(folder):
        n += 1
        folder = fs.join(root, f"{SET_ASIDE.format(step=step)}.{n}")
    for _, path in later:
        fs.move(path, fs.join(folder, os.path.basename(path.rstrip("/"))), first=COMMIT_MARKER)
    return [s for s, _ in later], folder
