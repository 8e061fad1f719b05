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
stops the run with one line naming the newest good checkpoint and the skips, every checkpoint
kept. train.rollback_lr_factor f < 1 scales the schedule by f after each rollback (f^n after
n rollbacks, also when a resume loads a checkpoint saved after them).
"""
from __future__ import annotations

from checkpoint import complete_checkpoints
from core.errors import TrainingError
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
        checkpoint is old enough: nothing is loaded, removed or overwritten then.
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
        s, t = self.s, self.s.cfg.train
        bad = s.loader.drawn(d.step - d.first + 1)
        fix = (f"add [[train.skip]] start_step = {bad[0]}, end_step = {bad[-1]} (the batches of steps "
               f"{d.first}-{d.step}) and run the same command")
        if target is None:
            where = (f"no checkpoint in {s.ckpt.root} is from step {d.first - t.rollback_margin} or before (the "
                     f"first outlier, step {d.first}, minus train.rollback_margin) to roll back to; {fix}")
        else:
            skipped = ", ".join(f"{a}-{b}" for a, b in s.loader.state.skips) or "none"
            where = (f"the rollback budget is spent (train.rollback {t.rollback}; {made} made, skipping data steps "
                     f"{skipped}); the newest good checkpoint is {target[1]} (step {target[0]}); {fix}, or raise "
                     f"train.rollback")
        return f"step {d.step}: {d.trigger}; stopped before the update, every checkpoint kept; {where}"


def _newest_at_most(root: str, step: int) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint under root of step <= step, or None."""
    found = [c for c in complete_checkpoints(root) if c[0] <= step]
    return found[-1] if found else None


def _remove_after(root: str, step: int) -> None:
    """Remove the complete checkpoints under root newer than step (rank 0): states of the diverged run."""
    for later, path in complete_checkpoints(root):
        if later > step:
            fs.remove(path)
