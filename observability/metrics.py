"""Throughput, MFU, memory, and the run's metrics: metrics.jsonl and, optionally, TensorBoard and Weights & Biases."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time
from typing import Callable

import torch

from core.errors import ConfigError, require
from observability.wandblog import WandbLog, check_wandb
from storage.rundir import RunDir


@dataclasses.dataclass
class MetricsConfig:
    tensorboard: bool = False
    """Also write every metric to RUN_DIR/tensorboard/ (torch.utils.tensorboard; needs the tensorboard extra: pip install -e ".[tensorboard]")."""
    wandb: bool = False
    """Also log every metric to a Weights & Biases run, the same run on every resume (its id in RUN_DIR/wandb_run_id; WANDB_MODE=offline writes RUN_DIR/wandb/ only; needs the wandb extra: pip install -e ".[wandb]")."""
    wandb_project: str = ""
    """The W&B project (empty: WANDB_PROJECT, else W&B's default)."""
    wandb_entity: str = ""
    """The W&B user or team that owns the project (empty: WANDB_ENTITY, else your default entity)."""
    wandb_run_name: str = ""
    """The W&B run's display name (empty: the run directory's name)."""
    wandb_group: str = ""
    """A W&B group to put the run in, e.g. one per sweep (empty: none)."""

    def __post_init__(self) -> None:
        bad = set("/\\#?%:") & set(self.wandb_project)  # the characters W&B refuses in a project name
        if bad or len(self.wandb_project) > 128:
            raise ConfigError(f"metrics.wandb_project must be at most 128 characters without any of / \\ # ? % :, "
                              f"got {self.wandb_project!r}; choose another name")


def check_metrics(cfg: MetricsConfig, run_dir: str = "") -> None:
    """Raise MissingPackageError when cfg asks for TensorBoard or W&B and its package is missing; with W&B,
    SetupError for a WANDB_MODE that W&B does not know or a bad RUN_DIR/wandb_run_id (run_dir given)."""
    if cfg.tensorboard:
        require("tensorboard", "tensorboard", "metrics.tensorboard = true", "set it to false")
    if cfg.wandb:
        require("wandb", "wandb", "metrics.wandb = true", "set it to false")
        check_wandb(run_dir)


# Dense bf16 peak per device, TFLOP/s, from the vendors' data sheets (SXM, without sparsity).
GPU_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def measured_cpu_peak_flops(n: int = 1024, seconds: float = 0.1, min_timings: int = 3,
                            clock: Callable[[], float] = time.perf_counter,
                            cpu_clock: Callable[[], float] = time.process_time) -> float:
    """An estimate of this process's dense fp32 matmul peak, FLOP/s: the CPU's MFU denominator.

    Measured, not a data-sheet figure: one untimed n x n x n fp32 matmul (thread pool start,
    page faults), then timed ones (2 n^3 FLOPs each) with the process's current torch thread
    count T, at least min_timings of them and for at least `seconds`. A timing's rate is
    2 n^3 over the shorter of its wall time (clock) and its CPU time (cpu_clock) / T: time
    the threads spent descheduled by other jobs does not count, so a busy machine does not
    make the peak low (a single wall-clock timing taken while the cores were shared made the
    MFU read above 100%). Returns the fastest rate. It is the peak of this GEMM with T
    threads, not the CPU's theoretical peak (cores x clock x FLOPs per cycle), which is
    higher; on a shared machine MFU then reads low rather than above 1. n: matrix size
    (1024: on one thread of this project's 2-core machine its rate equals a 2048^3 GEMM's,
    99-102 against 93-97 GFLOP/s, in 0.13 s instead of 0.77 s, which every rank of every start paid).
    """
    threads = torch.get_num_threads()
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    timings, start = [], clock()
    now = start
    while len(timings) < min_timings or now - start < seconds:
        t0, c0 = clock(), cpu_clock()
        a @ b
        now, c1 = clock(), cpu_clock()
        timings.append(min(now - t0, (c1 - c0) / threads))
    return 2 * n ** 3 / min(timings)


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device: bf16 data-sheet peak on a known GPU, measured fp32 GEMM on CPU.

    On CPU this takes a few 1024^3 matmuls, about 0.1 s (measured_cpu_peak_flops: the best of three or more timings,
    each corrected for time descheduled, which is what keeps a busy machine from lowering the peak).

    An unknown GPU falls back to the H100 figure; the name is what torch reports.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_BF16_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return GPU_BF16_PEAK_TFLOPS["H100"] * 1e12
    return measured_cpu_peak_flops()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank in GiB: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # ru_maxrss is KiB on Linux


def scalars(record: dict) -> dict:
    """The record's numeric values but its step: what TensorBoard and W&B are given (a bool is a flag, not a value)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLog:
    """One JSON object per record in <run_dir>/metrics.jsonl, its scalars in TensorBoard and W&B (rank 0 writes).

    resume_step: the step the run continues from. Records of later steps, left by a run
    that went on past its last checkpoint, are dropped first (atomically), so the file
    holds one train record per logged step after any number of resumes; TensorBoard's
    events of those steps are purged the same way (purge_step), and the W&B run is rewound
    to resume_step (wandblog.WandbLog). metrics: the [metrics] section (None: neither);
    config: the resolved config, the W&B run's config. Raises MissingPackageError when
    TensorBoard or W&B is asked for but its package is missing (found before training by
    check_metrics, through config.validate), SetupError when W&B cannot start the run.
    """

    def __init__(self, run_dir: str, enabled: bool, resume_step: int = 0, metrics: MetricsConfig | None = None,
                 config: dict | None = None):
        self.path = RunDir(run_dir).metrics
        self.enabled = enabled
        self.tb = self.wandb = None
        self._open = (run_dir, metrics or MetricsConfig(), config or {})
        if enabled:
            self._start(resume_step, rollbacks_before=resume_step)

    def _start(self, step: int, rollbacks_before: float) -> None:
        run_dir, metrics, config = self._open
        kept, dropped = self._kept(step, rollbacks_before)
        if metrics.wandb:  # first: a W&B start that is refused leaves metrics.jsonl and the run directory as they were
            self.wandb = WandbLog(run_dir, config, step, rewind=dropped, project=metrics.wandb_project,
                                  entity=metrics.wandb_entity, name=metrics.wandb_run_name, group=metrics.wandb_group)
        if kept is not None:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)
        if metrics.tensorboard:
            check_metrics(MetricsConfig(tensorboard=True))
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(RunDir(run_dir).tensorboard, purge_step=step + 1)

    def rewind(self, step: int) -> None:
        """Go back to step after a rollback (training/rollback.py): later records dropped, as at a resume, except
        the rollback records, which stay; TensorBoard purged and the W&B run rewound the same way."""
        if not self.enabled:
            return
        self.close()
        self.tb = self.wandb = None
        self._start(step, rollbacks_before=math.inf)

    def _kept(self, step: int, rollbacks_before: float) -> tuple[list[str] | None, bool]:
        """(metrics.jsonl's lines without the records of steps after step, or None when that is all of them; whether
        a whole record is dropped, whose step W&B may hold).

        A rollback record of a later step stays when it went back to rollbacks_before or earlier:
        the state resumed from was saved after it (so it counts that rollback), or is the one it
        went back to (the stop of a spent budget: its remedy resumes there with the skips added, and
        the record is the run's history; should the rollback happen again, note keeps one record).
        """
        if not os.path.exists(self.path):
            return None, False
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        kept, dropped = [], False
        for line in lines:
            try:
                record = json.loads(line)
                if record.get("step", 0) <= step or "rollback" in record and record["rollback"].get(
                        "to_step", math.inf) <= rollbacks_before:
                    kept.append(line.rstrip("\n") + "\n")
                else:
                    dropped = dropped or "rollback" not in record
            except ValueError:  # cut by a crash mid-write, before TensorBoard or W&B got it: resuming from before it
                pass
        return (None if kept == lines else kept), dropped

    def note(self, record: dict) -> None:
        """Append record (an int "step" and anything JSON holds) to metrics.jsonl only: an event, not a scalar.

        A rollback record that metrics.jsonl already holds (the same step, target and skip: the
        same rollback made again after a resume from its target) is not written twice.
        """
        if self.enabled:
            if "rollback" in record and os.path.exists(self.path):
                key = _rollback_key(record)
                with open(self.path) as f:
                    if any(_rollback_key(_loads(line)) == key for line in f if '"rollback"' in line):
                        return
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def write(self, record: dict) -> None:
        """Append record (an int "step" and values) to metrics.jsonl; its numbers to TensorBoard and W&B at its step."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        values = scalars(record)
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record["step"], values)

    def close(self) -> None:
        """Close TensorBoard's writer and finish the W&B run (which flushes it)."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _loads(line: str) -> dict:
    """A metrics.jsonl line as a dict; {} for a line a crash cut."""
    try:
        return json.loads(line)
    except ValueError:
        return {}


def _rollback_key(record: dict) -> tuple | None:
    """What makes two rollback records the same rollback: (step, to_step, skip); None for other records."""
    rb = record.get("rollback")
    return (record.get("step"), rb.get("to_step"), tuple(rb.get("skip", ()))) if isinstance(rb, dict) else None
