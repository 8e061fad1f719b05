"""The command behind train_fsdp.py and train_2d.py: parse, check without collectives, run, and the error boundary.

The two scripts differ only in the tensor-parallel plan they hand main (and that plan's layout
checks). Every error a user can fix is one 'error:' line before any collective starts; a lost
peer is one line naming the newest complete checkpoint.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import tomllib

import hf
from checkpoint import complete_checkpoints
from config import Config, compute_dtype, parse_config, validate
from core.errors import PeerError, SetupError, UserError, report, require
from parallel import distributed
from parallel.composition import check_composition
from parallel.layout import Layout
from parallel.memory import check_fits, rank_memory
from parallel.parallelize import TPPlan
from storage.rundir import forget_exit_record, lock_run_dir
from training.loop import exit_status, train
from training.planned import PlannedPeak
from training.resume import checkpoint_tokenizer, source_tokenizer
from training.session import build


def check_run(cfg: Config, world_size: int, tp_plan: TPPlan | None = None,
              check_layout: Callable[[Config, int], None] | None = None) -> None:
    """Every check that needs no collective, in the order a user can fix them; raises a UserError.

    First what does not run together (composition.TABLE, train_fsdp.py's rows too when there is no
    tp_plan), then check_layout(cfg, world_size): the TP plan's own layout checks (train_2d.py).
    A new start from other weights (init_from_hf, checkpoint.load_from) takes their tokenizer, or is
    refused when this run's differs (resume.source_tokenizer).
    """
    check_composition(cfg, "train_fsdp.py" if tp_plan is None else "train_2d.py")
    if check_layout is not None:
        check_layout(cfg, world_size)
    source = None  # (what the weights of a new start are, the tokenizer they were trained with)
    if cfg.init_from_hf:
        require("safetensors", "hf", "--init_from_hf")
        try:
            hf.check_args(cfg.init_from_hf, cfg.model)
            source = (f"--init_from_hf {cfg.init_from_hf}", hf.tokenizer_path(cfg.init_from_hf))
        except hf.HFError as e:
            raise SetupError(f"--init_from_hf: {e}") from None
    elif cfg.checkpoint.load_from:
        source = (f"checkpoint.load_from {cfg.checkpoint.load_from}", checkpoint_tokenizer(cfg.checkpoint.load_from))
    if source and source[1] and not has_own_checkpoints(cfg):
        note = source_tokenizer(cfg, *source)
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(f"[train] {note}", flush=True)
    validate(cfg, world_size)
    note = Layout.of(cfg.parallel, world_size).shard_group_note(distributed.local_world_size())
    if note and int(os.environ.get("RANK", 0)) == 0:
        print(note, flush=True)
    device = distributed.resolve_device(cfg.train.device)
    cfg.train.dtype = compute_dtype(cfg.train, device)  # the resolved dtype is what config.toml records
    check_fits(cfg.model, cfg.optim.name, world_size, cfg.parallel.dp_replicate,
               *rank_memory(device, distributed.local_world_size(), cfg.parallel.cpu_offload))
    if cfg.train.dtype == "bfloat16" and device.type == "cpu" and not distributed.cpu_has_native_bf16() \
            and int(os.environ.get("RANK", 0)) == 0:
        print("[train] notice: train.dtype bfloat16 on a CPU without native bf16 matmuls (no avx512_bf16 or "
              "amx_bf16): expect it 3-8x slower than --train.dtype float32", flush=True)


def has_own_checkpoints(cfg: Config) -> bool:
    """Whether the run resumes from checkpoints of its own (then checkpoint.load_from and init_from_hf are not used)."""
    try:
        return bool(complete_checkpoints(cfg.checkpoint.root(cfg.run_dir)))
    except Exception:  # a store this check cannot reach: the start's own checks name it
        return False


def peer_message(cfg: Config, where: str, rank: int, why: str) -> str:
    """The one line a rank prints when a peer rank hung or died: where, what, what is safe, what to do."""
    try:
        found = complete_checkpoints(cfg.checkpoint.root(cfg.run_dir))
    except Exception:  # a store that is down too must not hide the peer's failure
        found = []
    timeout = f" for train.collective_timeout_s ({cfg.train.collective_timeout_s:g} s)" if "answering" in why else ""
    return (f"{where}: rank {rank}: a peer rank {why}{timeout}; the newest complete checkpoint is "
            f"{found[-1][1] if found else 'none yet'}; see the other ranks' output for the cause, then run the same "
            f"command to resume (torchrun --max-restarts N restarts and resumes by itself)")


def run(cfg: Config, tp_plan: TPPlan | None = None, argv: list[str] | None = None) -> int:
    """Train as configured (called under torchrun on every rank, after check_run); returns train()'s result.

    argv: the command's arguments, for the plan rank 0 runs beside a run that records its peak (training/planned.py).
    """
    rank0 = int(os.environ.get("RANK", 0)) == 0
    lock = lock_run_dir(cfg.run_dir) if rank0 else None
    kind = distributed.resolve_device(cfg.train.device).type
    planned = PlannedPeak(list(sys.argv[1:] if argv is None else argv), distributed.world_size(),
                          distributed.local_world_size(), kind, cfg.train.collective_timeout_s) \
        if rank0 and (kind == "cuda" or cfg.train.track_memory) else None
    try:
        rank, world_size, device = distributed.init_distributed(cfg.train.device)
        session = None
        try:
            session = build(cfg, rank, world_size, device, tp_plan)
            session.planned = planned
            stopped_by = train(session)
        except RuntimeError as e:
            why = distributed.peer_failure(e)
            if not why:
                raise
            where = f"after step {session.train_state.step}" if session else "during start-up"
            raise PeerError(peer_message(cfg, where, rank, why)) from e
        distributed.finish_distributed()
        return stopped_by
    finally:
        distributed.abandon_distributed()
        if planned is not None:
            planned.close()
        if lock is not None:
            lock.close()


def main(argv: list[str] | None = None, tp_plan: TPPlan | None = None,
         check_layout: Callable[[Config, int], None] | None = None, description: str = "") -> int:
    """Entry point of train_fsdp.py and train_2d.py: parse, check, run.

    Exit status: 0 finished, or stopped by SIGTERM after saving; 130 after Ctrl-C (SIGINT:
    saved, or interrupted before training started); 2 on bad input, with one line
    'error: ...' (see errors.report). tp_plan: the tensor-parallel plan (train_2d.py);
    check_layout(cfg, world_size): its layout checks, run before anything is created.
    description: the --help text's head.
    """
    distributed.die_with_agent()  # no orphan worker outlives its torchrun agent
    cfg, started = None, time.time()
    try:
        cfg = parse_config(argv, description, require_file=True)
        check_run(cfg, distributed.world_size(), tp_plan, check_layout)
        return exit_status(run(cfg, tp_plan, argv))
    except PeerError as e:
        forget_last_exit(cfg, argv, started)
        report(e)
        # The process group is broken: leave now, before interpreter teardown races gloo's threads
        # into an abort ("terminate called ..."). Everything worth keeping is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except UserError as e:
        forget_last_exit(cfg, argv, started)
        report(e)
        return 2
    except SystemExit as e:  # argparse's own errors exit 2; --help exits 0
        if e.code:
            forget_last_exit(cfg, argv, started)
        raise
    except Exception:  # a crash keeps its traceback
        forget_last_exit(cfg, argv, started)
        raise
    except KeyboardInterrupt:  # a Ctrl-C before the loop, or a second one inside it
        if int(os.environ.get("RANK", 0)) == 0:
            print("[train] interrupted (Ctrl-C); what was saved before stays; run the same command to resume",
                  file=sys.stderr, flush=True)
        return 130


def forget_last_exit(cfg: Config | None, argv: list[str] | None, started: float) -> None:
    """Rank 0 of a start that did not end cleanly removes a previous stop's exit.json, one written before started
    (a time.time()): rundir.forget_exit_record.

    The run directory is the parsed config's or, when the command line or the config file was
    refused, the last --run_dir given, else the --config file's run_dir as far as it reads as TOML
    (a file that is not TOML names none: nothing is removed then).
    """
    if int(os.environ.get("RANK", 0)) != 0:
        return
    run_dir = cfg.run_dir if cfg is not None else given_run_dir(list(sys.argv[1:] if argv is None else argv))
    if run_dir:
        forget_exit_record(run_dir, started)


def given_run_dir(args: list[str]) -> str:
    """The run directory a refused command line names: its last --run_dir, else its --config file's run_dir, or ''."""
    flags = {}
    for i, a in enumerate(args):
        for flag in ("--run_dir", "--config"):
            if a == flag and i + 1 < len(args):
                flags[flag] = args[i + 1]
            elif a.startswith(flag + "="):
                flags[flag] = a.split("=", 1)[1]
    if "--run_dir" in flags or "--config" not in flags:
        return flags.get("--run_dir", "")
    try:
        with open(flags["--config"], "rb") as f:
            run_dir = tomllib.load(f).get("run_dir", "")
    except (OSError, ValueError):  # tomllib.TOMLDecodeError is a ValueError
        return ""
    return run_dir if isinstance(run_dir, str) else ""
