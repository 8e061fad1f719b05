"""The training loop: the skeleton of a run. Steps, and after each the components that are due, until train.steps
or a signal.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal

import torch
import torch.distributed as dist

from core import cli
from core.errors import TrainingError
from hf_format import HFError, hf_model_type
from model import ModelArgs, flops_per_token
from observability.metrics import MetricsLog, device_peak_flops, peak_memory_gib
from observability.progress import Progress
from optimization.optimizers import schedule_notice
from parallel import distributed
from parallel.compose import pipeline_notice
from storage.rundir import RunDir
from training.components import Checkpointing, Metrics, Profiling, Scoring, Validation, act
from training.rollback import Rollback
from training.session import Session, start_line
from training.step import Divergence, NonFiniteError, StepResult, train_step


def train(s: Session) -> int:
    """The training loop: steps, logging, validation, scoring, checkpoints, profiles; from s.train_state.step on.

    Returns 0 when the run reached train.steps, else the number of the signal that stopped it
    (SIGTERM or SIGINT: every rank finished the step and the checkpoint of that step is saved).
    """
    cfg, state = s.cfg, s.train_state
    if state.step > cfg.train.steps:  # resume_point refuses it by the checkpoint's name; a load_from named otherwise
        raise TrainingError(f"train.steps ({cfg.train.steps}) is below the {state.step} steps already done in "
                            f"{s.resumed_from}: pass --train.steps above {state.step} to continue this run, or branch "
                            f"from an earlier checkpoint with --checkpoint.load_from and a new --run_dir")
    if state.step == cfg.train.steps:  # a finished run started again
        s.ckpt.close()
        if s.rank == 0:  # config.toml, metrics and exit.json stay as the run left them: no step runs under this config
            print(f"[train] finished: step {state.step} of {cfg.train.steps} already; nothing to run, the run "
                  f"directory is left as it was", flush=True)
        return 0
    log = open_metrics_log(s)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    progress = Progress(cfg.train.steps, state.step, s.rank == 0)
    metrics = Metrics(s, log, progress, fpt, run_peak_flops(s.device))
    profiling = Profiling(cfg, s, progress)
    validation = Validation(s, log, progress)
    checkpointing = Checkpointing(s)
    rollback = Rollback(s, log, progress)
    between_steps = (validation, Scoring(s, log, progress), checkpointing)
    progress.write(start_line(s, fpt))  # rank 0 only, and above the progress bar
    for notice in (validation.notice(), schedule_notice(cfg.optim, cfg.train.steps),
                   pipeline_notice(cfg.parallel, cfg.train.micro_batch_size), export_notice(cfg.model)):
        if notice:
            progress.write(notice)

    stop, stopped_by, start_step = distributed.StopFlag(), 0, state.step
    while state.step < cfg.train.steps:
        profiling.before(state.step + 1)
        try:
            result = step_or_stop(s)
        except Divergence as d:  # train.rollback: alike on every rank, before the update
            with metrics.paused():
                rollback.run(d)
            metrics.rewound()
            continue
        step = state.step
        if step == start_step + 1:  # compiled and warmed up: from now on a slow collective means a lost peer
            distributed.set_collective_timeout(cfg.train.collective_timeout_s)
        progress.step()
        s.ckpt.poll()
        act((profiling, metrics), step, result)
        with metrics.paused():
            act(between_steps, step, result)
            stopped_by = stop.any_rank()
            if stopped_by:
                checkpointing.save_now(step)
                profiling.stop(step)
                break
    s.ckpt.close()
    progress.close()
    log.close()
    if s.rank == 0:
        finish(s, stopped_by)
    return stopped_by


def export_notice(args: ModelArgs) -> str:
    """One line for the start when `hf.py export` will refuse the model this run trains, else ''.

    By the export's own rules (hf_format.hf_model_type): a shape no transformers class computes (softmax routing
    with shared experts, dense first layers or raw weights; sigmoid over one expert) and, known only from the
    weights, a softmax MoE (a MixtralForCausalLM, which has no routing bias) whose balancing bias moved, as the
    default model.moe_bias_update_rate moves it from the first step. Not an error: a run need not be exported; but
    hours of training should not end in a refusal the start could have named, with its fix.
    """
    reasons = []
    try:
        hf_model_type(args)
    except HFError as e:
        reasons.append(str(e))
    if args.n_experts and args.moe_score == "softmax" and args.moe_bias_update_rate:
        sigmoid = " or --model.moe_score sigmoid (a Glm4MoeForCausalLM)" if args.n_experts > 1 else ""
        reasons.append(f"a MixtralForCausalLM (softmax routing) has no routing bias, and the balancing bias "
                       f"(model.moe_bias_update_rate {args.moe_bias_update_rate:g}) moves from the first step; to "
                       f"keep the run exportable, pass --model.moe_bias_update_rate 0 (balance by "
                       f"--model.moe_aux_loss){sigmoid}")
    return f"[train] notice: hf.py export will refuse this model: {'; and '.join(reasons)}" if reasons else ""


def step_or_stop(s: Session) -> StepResult:
    """train_step on the loader's next batch; a non-finite gradient norm (train.nonfinite stop) becomes one line."""
    try:
        return train_step(s, s.loader.next_step())
    except NonFiniteError as e:
        raise TrainingError(
            f"step {s.train_state.step + 1}: {e}; stopped before the update, so the last checkpoint in {s.ckpt.root} "
            f"is untouched; lower optim.lr, raise optim.warmup_steps, or pass --train.nonfinite skip"
        ) from None


def open_metrics_log(s: Session) -> MetricsLog:
    """metrics.jsonl (and TensorBoard, W&B) opened at the resumed step; on rank 0 also config.toml written, exit.json
    removed. A W&B run that cannot start stops every rank, with the run directory as it was."""
    cfg, opened = s.cfg, {}

    def open_log():
        opened["log"] = MetricsLog(cfg.run_dir, True, s.train_state.step, cfg.metrics, dataclasses.asdict(cfg))

    distributed.on_rank0(open_log, s.rank)
    if s.rank == 0:
        run_dir = RunDir(cfg.run_dir)
        cli.write_resolved(cfg, run_dir.config)
        with contextlib.suppress(FileNotFoundError):  # a record of an earlier run must not speak for this one
            os.remove(run_dir.exit_record)
    return opened.get("log") or MetricsLog(cfg.run_dir, False)


def run_peak_flops(device: torch.device) -> float:
    """The run's peak FLOP/s for mfu: the sum of its ranks' device peaks (collective over the world group)."""
    peak = torch.tensor([device_peak_flops(device)], dtype=torch.float64)
    dist.all_reduce(peak)
    return peak.item()


def finish(s: Session, stopped_by: int) -> None:
    """Rank 0, after the loop: exit.json and the last line (finished, or stopped by a signal and saved)."""
    step, total = s.train_state.step, s.cfg.train.steps
    write_exit_record(RunDir(s.cfg.run_dir).exit_record, stopped_by, step, total)
    if stopped_by:
        verb = "interrupted" if stopped_by == signal.SIGINT else "stopped"
        print(f"[train] {signal.Signals(stopped_by).name}: saved step {step} in {s.ckpt.root}; {verb} at step "
              f"{step} of {total}; run the same command to resume", flush=True)
    else:
        print(f"[train] finished: step {step} of {total}; peak memory {peak_memory_gib(s.device):.2f} GiB on "
              f"rank 0", flush=True)


def exit_status(stopped_by: int) -> int:
    """The command's exit status after train() returned stopped_by: 130 after SIGINT (Ctrl-C), else 0."""
    return 130 if stopped_by == signal.SIGINT else 0


def write_exit_record(path: str, stopped_by: int, step: int, steps: int) -> None:
    """Write how the run ended as JSON, atomically (rank 0): what scripts/slurm_train.sh exits with.

    {"status": "finished" | "stopped" (SIGTERM) | "interrupted" (SIGINT), "signal": name or
    null, "step": steps done, "steps": train.steps, "exit_status": 0 or 130}. torchrun's agent
    itself exits 1 after it forwarded a signal, so its status cannot tell a clean stop from a
    crash; a crash writes no record (and the start of every run removes the last one).
    """
    status = {0: "finished", signal.SIGINT: "interrupted"}.get(stopped_by, "stopped")
    record = {"status": status, "signal": signal.Signals(stopped_by).name if stopped_by else None, "step": step,
              "steps": steps, "exit_status": exit_status(stopped_by)}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
