"""What a run does between its steps, one component per concern, each owning its cadence and its state.

Every component answers ``due(step, result)``: whether it acts after optimizer step ``step``
(1-based, with that step's StepResult), and acts in ``run(step, result)``. The loop
(training/loop.py) asks each in turn and knows none of their intervals. Every rank asks the same
question with the same answer, since the collective ones (metrics' loss, validation, scoring,
checkpointing) must run on all ranks together.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Protocol

from config import Config
from evaluation.downstream import evaluate_tasks
from evaluation.validation import loss_sum_and_count, val_batches, val_record
from observability.metrics import MetricsLog, peak_memory_gib
from observability.profiling import StepProfiler, parse_steps
from observability.progress import Progress
from training.session import Session
from training.step import StepResult


class Component(Protocol):
    """The loop's view of a component."""

    def due(self, step: int, result: StepResult) -> bool:
        """Whether run(step, result) is to be called after this step (the same answer on every rank)."""

    def run(self, step: int, result: StepResult) -> None:
        """Act after the step (collective for most components)."""


def act(components: tuple[Component, ...], step: int, result: StepResult) -> None:
    """Ask each component, in order, whether it is due after step, and run the ones that are."""
    for c in components:
        if c.due(step, result):
            c.run(step, result)


class Metrics:
    """Train records (metrics.jsonl, TensorBoard, W&B, the progress bar): every train.log_interval steps, the
    last step, and every step whose update was skipped or that was an outlier (train.rollback). Throughput counts
    only the time spent training."""

    def __init__(self, s: Session, log: MetricsLog, progress: Progress, flops_per_token: float, peak_flops: float):
        self.s, self.log, self.progress = s, log, progress
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.loss_group = s.mesh.loss.get_group()  # the ranks holding their own tokens: data-parallel x CP
        self.t_last, self.tokens_last = time.perf_counter(), s.train_state.tokens_seen

    def due(self, step: int, result: StepResult) -> bool:
        t = self.s.cfg.train
        return step % t.log_interval == 0 or step == t.steps or bool(result.skipped or result.outlier)

    def run(self, step: int, result: StepResult) -> None:
        cfg, state = self.s.cfg, self.s.train_state
        grad_norm = result.grad_norm.item()
        tps = (state.tokens_seen - self.tokens_last) / (time.perf_counter() - self.t_last)
        loss, z = result.global_losses(self.loss_group)
        record = {"step": step, "loss": loss, "lr": result.lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                  "mfu": tps * self.flops_per_token / self.peak_flops, "tokens_seen": state.tokens_seen,
                  "global_batch_size": result.n_targets // cfg.data.seq_len, "epoch": self.s.loader.epoch,
                  "peak_mem_gib": peak_memory_gib(self.s.device), **self.s.loader.source_tokens()}
        if cfg.train.z_loss:
            record["z_loss"] = cfg.train.z_loss * z
        for hook in self.s.hooks:
            record.update(hook.record(result.n_targets))
        if result.skipped:
            record["skipped"] = True
            record["skip_reason"] = result.skipped
        if result.outlier:
            record["outlier"] = result.outlier
        self.log.write(record)
        self.progress.log(record)
        if result.skipped:
            self.progress.write(f"[train] step {step}: update skipped, {result.skipped}")
        if result.outlier:
            self.progress.write(f"[train] step {step}: outlier {state.outliers} in a row (a rollback at "
                                f"train.rollback_after {cfg.train.rollback_after}), update kept: {result.outlier}")
        self.t_last, self.tokens_last = time.perf_counter(), state.tokens_seen

    def rewound(self) -> None:
        """The run went back to an earlier step (a rollback): throughput counts from here."""
        self.t_last, self.tokens_last = time.perf_counter(), self.s.train_state.tokens_seen

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not training time (validation, scoring, saving): tokens_per_sec leaves it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t_last += time.perf_counter() - start


class Validation:
    """val_loss (and val_loss/<name> per source) every train.val_interval steps and at the last step (collective)."""

    def __init__(self, s: Session, log: MetricsLog, progress: Progress):
        self.s, self.log, self.progress = s, log, progress
        t = s.cfg.train
        self.sets = val_batches(s.corpus, t.val_batches * t.global_batch_size, s.micro_batch_size,
                                s.mesh.local_rank("data"), s.dp)
        self.loss_group = s.mesh.loss.get_group()

    def notice(self) -> str:
        """One line for the start when the corpus, or a source of a mixture, has too few held-out windows to be
        validated (fewer than the data-parallel ranks), else ''."""
        cfg, names = self.s.cfg, self.s.corpus.names
        unvalidated = [n for n in names if n not in {v.name for v in self.sets}]
        if not (cfg.train.val_interval and unvalidated):
            return ""
        what = "no val_loss at all" if len(unvalidated) == len(names) else \
            f"no val_loss/<name> for {', '.join(unvalidated)}"
        return (f"[train] notice: {what}: fewer held-out windows than the {self.s.dp} data-parallel rank(s); raise "
                f"data.val_fraction or give the source more text")

    def due(self, step: int, result: StepResult) -> bool:
        t = self.s.cfg.train
        return bool(self.sets) and t.val_interval > 0 and (step % t.val_interval == 0 or step == t.steps)

    def run(self, step: int, result: StepResult) -> None:
        s = self.s
        sums = {v.name: loss_sum_and_count(s.runner, v, self.loss_group) for v in self.sets}  # each source alone
        record = val_record({name: total / count for name, (total, count) in sums.items()}, self.sets)
        self.log.write({"step": step, **record})
        # A mixture's val_loss averages its sources: one noisy source can hide a clean one's, so each is shown.
        sources = ", ".join(f"{k.split('/', 1)[1]} {x:.4f}" for k, x in record.items() if k.startswith("val_loss/"))
        self.progress.write(f"[val] step {step}: val_loss {record['val_loss']:.4f}"
                            + (f" (per source: {sources})" if sources else ""))


class Scoring:
    """The [[eval.tasks]] downstream scores every eval.interval steps and at the last step (collective)."""

    def __init__(self, s: Session, log: MetricsLog, progress: Progress):
        self.s, self.log, self.progress = s, log, progress

    def due(self, step: int, result: StepResult) -> bool:
        return self.s.cfg.eval.due(step, self.s.cfg.train.steps)

    def run(self, step: int, result: StepResult) -> None:
        s = self.s
        record = evaluate_tasks(s.runner, s.tasks, s.mesh.local_rank("data"), s.dp, s.mesh.data.get_group(),
                                s.micro_batch_size * s.cfg.data.seq_len)
        self.log.write({"step": step, **record})
        self.progress.write(f"[eval] step {step}: " + ", ".join(f"{k[5:]} {v:.4f}" for k, v in record.items()))


class Checkpointing:
    """A checkpoint every checkpoint.interval steps and at the last step (collective; asynchronous if configured)."""

    def __init__(self, s: Session):
        self.s = s

    def due(self, step: int, result: StepResult) -> bool:
        return step % self.s.cfg.checkpoint.interval == 0 or step == self.s.cfg.train.steps

    def run(self, step: int, result: StepResult) -> None:
        self.s.ckpt.save(step, self.s.app)

    def save_now(self, step: int) -> None:
        """Save step and wait until it is committed (a stop by signal); a no-op save if step was just saved."""
        self.s.ckpt.save(step, self.s.app)
        self.s.ckpt.wait()


class Profiling:
    """A profiler trace (and a CUDA memory snapshot) of the steps train.profile_steps names, on rank 0; a span that
    reaches past the run's last step, or that a signal cuts short, ends there."""

    def __init__(self, cfg: Config, s: Session, progress: Progress):
        self.profiler = StepProfiler(parse_steps(cfg.train.profile_steps), cfg.run_dir, s.device, s.rank == 0)
        self.progress, self.last_step = progress, cfg.train.steps

    def before(self, step: int) -> None:
        """Called before step (1-based) runs: starts the profiler at the first step of the span."""
        self.profiler.before_step(step)

    def due(self, step: int, result: StepResult) -> bool:
        return self.profiler.finishes(step, last=step == self.last_step)

    def run(self, step: int, result: StepResult | None, last: bool = False) -> None:
        trace = self.profiler.after_step(step, last=last or step == self.last_step)
        self.progress.write(f"[profile] steps {self.profiler.span[0]}-{step}: {trace}")

    def stop(self, step: int) -> None:
        """The run stops after step (a signal): a span still open ends there and its trace is written."""
        if self.profiler.finishes(step, last=True):
            self.run(step, None, last=True)
