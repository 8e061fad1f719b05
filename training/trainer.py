"""The training run: build it, the step, the loop, validation, SIGTERM, and the command's error boundary.

``train_fsdp.py`` and ``train_2d.py`` call ``main``; they differ only in the tensor-parallel
plan they hand it (and that plan's layout checks). Everything else lives here once, on
top of the library modules: parallelize, optim, loss, data, prepare, checkpoint, metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hf
from checkpoint import (
    AppState,
    Checkpointer,
    TrainState,
    check_compatible,
    check_same_config,
    complete_checkpoints,
    lock_run_dir,
    saved_config,
)
from config import Config, check_tokenizer, compute_dtype, parse_config, validate
from core import cli
from core.errors import PeerError, SetupError, TrainingError, UserError, report
from data import PackedCorpus, mixture_note
from data_pipeline import datacache
from data_pipeline.loader import DataState, GlobalBatchLoader
from evaluation.downstream import Task, evaluate_tasks, load_tasks
from evaluation.validation import loss_sum_and_count, val_batches, val_record
from model import Transformer, flops_per_token, num_params
from nn.loss import applied_chunk_size, has_tp, loss_context, token_loss_sums
from observability.metrics import MetricsLog, device_peak_flops, peak_memory_gib
from observability.profiling import StepProfiler, parse_steps
from observability.progress import Progress
from optimization.optimizers import build_optimizer
from optimization.spike import push, spike_reason
from parallel import distributed, float8
from parallel.context_parallel import shard_batch
from parallel.parallelize import TPPlan, build_mesh, build_model, copy_sharded, dp_mesh, loss_mesh, shard_group_note
from prepare import prepare_on_all_ranks
from storage.rundir import RunDir

# ---------------------------------------------------------------- the step


def forward_backward(model, micro_batches, n_targets: int, dp_size: int, device, mesh: DeviceMesh,
                     loss_chunk_size: int = 0, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this rank's micro-batches of one step; gradients accumulate.

    micro_batches: [(inputs, labels)], each (mb, seq_len) int64. loss_chunk_size: see
    loss.token_loss_sum (ignored when mesh has "tp"); z_loss: loss.token_loss_sums. Every
    micro-batch's objective sum is divided by n_targets, the global count of target tokens of
    the step, and multiplied by dp_size because FSDP averages gradients over data-parallel
    ranks: the gradient is exactly that of the global mean token objective, however the batch
    is split. With a "cp" dimension each rank runs its slice of every window
    (context_parallel.shard_batch) and dp_size must count the CP ranks too
    (loss_mesh(mesh).size(): FSDP averages over them as well). Returns this rank's summed token
    cross-entropy and summed logsumexp^2 (0 without z_loss), 0-dim fp32 tensors on device (no
    host sync).
    """
    loss_sum = torch.zeros((), device=device)
    z_total = torch.zeros((), device=device)
    context, chunk = loss_context(mesh), applied_chunk_size(mesh, loss_chunk_size)
    for i, (inputs, labels) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once per step
        with context():
            inputs, labels, layout = shard_batch(model, inputs.to(device, non_blocking=True),
                                                 labels.to(device, non_blocking=True), mesh)
            objective, z_sum = token_loss_sums(model, inputs, labels, chunk, z_loss, layout)
            (objective * (dp_size / n_targets)).backward()
        loss_sum += objective.detach() - z_loss * z_sum
        z_total += z_sum
    return loss_sum, z_total


class NonFiniteError(RuntimeError):
    """The global gradient norm is NaN or inf; the weights were not updated."""


def optimizer_step(model, optimizer, grad_clip: float, device, skip_nonfinite: bool = False,
                   veto: Callable[[float], bool] | None = None) -> torch.Tensor:
    """Clip to grad_clip (0: no clipping), step, zero the gradients; returns the pre-clip global norm.

    A non-finite norm never reaches the weights: the gradients are dropped and NonFiniteError
    is raised, or, with skip_nonfinite, the update is skipped and the non-finite norm returned.
    veto(norm): called with a finite pre-clip norm; True drops the gradients instead of the
    update (the spike guard). Checking costs one host sync per step.
    """
    norm = distributed.grad_norm_(model.parameters(), grad_clip, device)
    if not torch.isfinite(norm).item():
        optimizer.zero_grad(set_to_none=True)
        if skip_nonfinite:
            return norm
        raise NonFiniteError(f"gradient norm is {norm.item()}")
    if veto is not None and veto(norm.item()):
        optimizer.zero_grad(set_to_none=True)
        return norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@dataclasses.dataclass
class StepResult:
    """What train_step returns; tensors stay on the device, so the step needs no host sync."""

    loss_sum: torch.Tensor
    """This rank's summed token loss of the step, a 0-dim fp32 tensor (see global_loss)."""
    grad_norm: torch.Tensor
    """The pre-clip global gradient norm, a 0-dim fp32 tensor (non-finite when the update was skipped)."""
    lr: float
    """The learning rate the update used."""
    n_targets: int
    """Target tokens of the step's global batch."""
    z_sum: torch.Tensor | None = None
    """This rank's sum of logsumexp^2 over its tokens, 0-dim fp32 (train.z_loss; None or 0 when off)."""
    skipped: str = ""
    """Why the update was skipped ('' when it was applied): a non-finite norm or the spike guard's reason."""
    mean_loss: float | None = None
    """global_loss, when the step already computed it (the spike guard needs it)."""

    def global_losses(self, dp_group) -> tuple[float, float]:
        """(mean token cross-entropy, mean logsumexp^2) of the step's global batch (collective over dp_group; syncs)."""
        total = torch.stack([self.loss_sum, self.loss_sum.new_zeros(()) if self.z_sum is None else self.z_sum])
        dist.all_reduce(total, group=dp_group)
        loss, z = (total / self.n_targets).tolist()
        return loss, z

    def global_loss(self, dp_group) -> float:
        """The mean token cross-entropy of the step's global batch (collective over dp_group, loss_mesh's group; syncs)."""
        return self.mean_loss if self.mean_loss is not None else self.global_losses(dp_group)[0]


@dataclasses.dataclass
class Trainable:
    """What a training step reads and changes on one rank: the sharded model, its optimizer and schedule, the counters."""

    cfg: Config
    rank: int
    device: torch.device
    mesh: DeviceMesh
    dp: int
    """Data-parallel ranks (dp_mesh(mesh).size())."""
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_state: TrainState


def train_step(s: Trainable, micro_batches, after_backward: Callable[[torch.nn.Module], None] | None = None
               ) -> StepResult:
    """One optimizer step, as the loop runs it: forward/backward, clip, update, LR schedule, counters.

    micro_batches: this rank's [(inputs, labels)] of the step, each (mb, seq_len) int64 (the
    loader's next_step()). after_backward(model): called once the gradients are complete and
    before clipping (tests read them there). The loss is that of the global batch of
    cfg.train.batch_size_at(step) windows of cfg.data.seq_len targets each (forward_backward).
    Raises NonFiniteError when the norm is not finite and cfg.train.nonfinite is "stop":
    neither the weights, the schedule nor the counters moved. With "skip", or when the spike
    guard (train.spike_skip, spike.py) finds the loss or the norm an outlier, the update is
    skipped but the step counts (StepResult.skipped says why).
    """
    cfg, t = s.cfg, s.cfg.train
    n_targets = t.batch_size_at(s.train_state.step) * cfg.data.seq_len  # packed: every label is a target
    lr = s.scheduler.get_last_lr()[0]
    ranks = loss_mesh(s.mesh).size()  # the data-parallel x CP ranks FSDP averages gradients over
    loss_sum, z_sum = forward_backward(s.model, micro_batches, n_targets, ranks, s.device, s.mesh, t.loss_chunk_size,
                                       t.z_loss)
    if after_backward is not None:
        after_backward(s.model)
    result = StepResult(loss_sum, torch.zeros(()), lr, n_targets, z_sum)
    veto = None
    if t.spike_skip:
        result.mean_loss = result.global_loss(loss_mesh(s.mesh).get_group())
        veto = functools.partial(_spike_veto, s.train_state, result, t.spike_skip, t.spike_window)
    try:
        result.grad_norm = optimizer_step(s.model, s.optimizer, cfg.optim.grad_clip, s.device, t.nonfinite == "skip",
                                          veto)
    except NonFiniteError as e:
        raise NonFiniteError(f"{e} (loss {loss_sum.item() / n_targets * ranks:.4g} on rank {s.rank})") from None
    if not result.skipped and not torch.isfinite(result.grad_norm).item():
        result.skipped = "non-finite gradient norm"
    if cfg.train.float8 == "tensorwise":  # the next step's float8 all-gathers use these weights' scales
        float8.precompute_scales(s.model)
    s.scheduler.step()
    s.train_state.step += 1
    s.train_state.tokens_seen += n_targets
    return result


def _spike_veto(state: TrainState, result: StepResult, sigmas: float, window: int, grad_norm: float) -> bool:
    """The spike guard's decision on a step of finite grad_norm (optimizer_step's veto); records it in the windows."""
    result.skipped = spike_reason(state.recent_losses, state.recent_grad_norms, result.mean_loss, grad_norm,
                                  sigmas, window)
    push(state.recent_losses, result.mean_loss, window)
    push(state.recent_grad_norms, grad_norm, window)
    return bool(result.skipped)


# ---------------------------------------------------------------- building a run


def build_trainable(cfg: Config, rank: int, mesh: DeviceMesh, device: torch.device, tp_plan: TPPlan | None = None,
                    model: torch.nn.Module | None = None) -> Trainable:
    """The sharded model (parallelize.build_model, from cfg.train.seed), optimizer, LR schedule and a fresh TrainState.

    model: an already parallelized and initialised model to use instead (benchmarks time
    another model source with the same step). Collective when it builds the model.
    """
    t = cfg.train
    if model is None:
        model = build_model(cfg.model, mesh, device, t.seed, cfg.parallel, dtype=compute_dtype(t, device),
                            activation_checkpointing=t.activation_checkpointing, compile=t.compile, tp_plan=tp_plan,
                            float8_recipe=t.float8)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.steps, fused=not cfg.parallel.cpu_offload,
                                           batch_schedule=t.batch_schedule())
    return Trainable(cfg, rank, device, mesh, dp_mesh(mesh).size(), model, optimizer, scheduler, TrainState())


@dataclasses.dataclass
class Session(Trainable):
    """Everything built for a run on one rank, before the loop: the Trainable, its data and its checkpoints."""

    corpus: PackedCorpus
    loader: GlobalBatchLoader
    micro_batch_size: int
    ckpt: Checkpointer
    app: AppState
    meta: dict
    resumed_from: str | None
    resume_note: str = ""
    """What changed since the checkpoint that the run carries over (for the start-up line)."""
    tasks: list[Task] = dataclasses.field(default_factory=list)
    """The [[eval.tasks]], read and tokenized."""


def build(cfg: Config, rank: int, world_size: int, device: torch.device, tp_plan: TPPlan | None = None,
          resume: bool = True) -> Session:
    """Mesh, data, sharded model, optimizer and checkpointer (collective); resumes if a checkpoint exists.

    tp_plan: train_2d.py's plan, used when cfg.parallel.tp > 1. Raises SetupError (on every
    rank) for bad data or a checkpoint that does not fit the model.
    """
    mesh = build_mesh(device, world_size, cfg.parallel.tp, cfg.parallel.dp_replicate, cfg.parallel.cp)
    data_parallel = dp_mesh(mesh)
    dp = data_parallel.size()
    torch.manual_seed(cfg.train.seed)

    # Data: all ranks tokenize their share of the corpus into the run directory, or each node
    # copies a published one (data.prepared) into its cache; then every rank maps it.
    data_dir = RunDir(cfg.run_dir).data
    try:
        if cfg.data.prepared:
            data_dir, meta = datacache.fetch(cfg.data, datacache.cache_dir(cfg.data, cfg.run_dir))
        else:
            meta = prepare_on_all_ranks(cfg.data, data_dir)
    except UserError as e:
        raise SetupError(str(e)) from None
    check_tokenizer(meta["tokenizer"], cfg.model, meta["vocab_size"])
    corpus = PackedCorpus(data_dir, cfg.data)
    micro = cfg.train.micro_batch(dp)
    data_state = DataState()
    loader = GlobalBatchLoader(corpus, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                               data_parallel.get_local_rank(), dp, cfg.train.seed, data_state,
                               cfg.train.batch_schedule()[1:])

    tr = build_trainable(cfg, rank, mesh, device, tp_plan)
    ckpt = Checkpointer(cfg.checkpoint, cfg.checkpoint.root(cfg.run_dir), rank, cli.to_toml(cfg))
    app = AppState(tr.model, tr.optimizer, tr.scheduler, tr.train_state, data_state, rank)

    def find_resume():
        ckpt.clean_partial()
        path = ckpt.resume_path()
        if path is None:
            return None, ""
        # Fields first: they name what differs, where shapes could only list tensors.
        check_same_config(path, "model", dataclasses.asdict(cfg.model))
        # The data cursor counts windows of seq_len among the train windows: another length or
        # split would point it elsewhere in the corpus.
        check_same_config(path, "data", {"seq_len": cfg.data.seq_len, "val_fraction": cfg.data.val_fraction})
        check_same_config(path, "train", {"seed": cfg.train.seed})  # it seeds the data order too
        with torch.device("meta"):
            check_compatible(path, {k: v.shape for k, v in Transformer(cfg.model).state_dict().items()})
        batch = saved_config(path).get("train", {}).get("global_batch_size", cfg.train.global_batch_size)
        note = "" if batch == cfg.train.global_batch_size else \
            f"train.global_batch_size {batch} -> {cfg.train.global_batch_size} (the data position is kept, in samples)"
        mix = mixture_note(saved_config(path).get("data", {}), cfg.data)
        return path, "; ".join(n for n in (note, mix) if n)

    path, note = distributed.on_rank0(find_resume, rank) if resume else (None, "")
    tasks = distributed.on_rank0(lambda: load_tasks(cfg.eval, meta["tokenizer"], cfg.model.max_seq_len),
                                 rank) if cfg.eval.tasks else []
    if path is not None:
        ckpt.load(path, app)
    elif cfg.init_from_hf:  # every rank reads the folder and keeps its own shards: no communication
        hf.load_hf_into(tr.model, cfg.init_from_hf, copy_=copy_sharded)
    return Session(**vars(tr), corpus=corpus, loader=loader, micro_batch_size=micro, ckpt=ckpt, app=app, meta=meta,
                   resumed_from=path, resume_note=note, tasks=tasks)


# ---------------------------------------------------------------- the loop


def loss_description(cfg: Config, mesh: DeviceMesh) -> str:
    """How the loss is computed, for the start-up line (says when loss_chunk_size is not applied)."""
    chunk = cfg.train.loss_chunk_size
    if has_tp(mesh):
        loss = "vocab-parallel" + (" (train.loss_chunk_size is not applied under tp)" if chunk else "")
    else:
        loss = f"in chunks of {chunk} tokens" if chunk else "on full logits"
    return f"{'document-masked' if cfg.model.document_mask else 'causal'} attention, loss {loss}"


def start_line(s: Session, fpt: float) -> str:
    """The one line a run prints when it starts: layout, model, corpus, attention and loss, where it starts from."""
    cfg, mesh = s.cfg, s.mesh
    start = (f"resumed from {s.resumed_from} at step {s.train_state.step}" if s.resumed_from else
             f"weights from {cfg.init_from_hf}" if cfg.init_from_hf else "fresh start")
    return (f"[train] mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} device {s.device.type} {cfg.train.dtype} | "
            f"params {num_params(cfg.model) / 1e6:.2f}M | {fpt / 1e6:.1f} MFLOP/token | "
            f"corpus {s.meta['n_tokens']:,} tokens in {s.meta['n_documents']} docs, {s.corpus.n_train} train / "
            f"{s.corpus.n_val} val sequences{s.corpus.describe()} | {loss_description(cfg, mesh)} | {start}"
            + (f" | {s.resume_note}" if s.resume_note else ""))


def train(s: Session) -> int:
    """The training loop: steps, logging, validation, checkpoints, profiles; from s.train_state.step on.

    Returns 0 when the run reached train.steps, else the number of the signal that stopped it
    (SIGTERM or SIGINT: every rank finished the step and the checkpoint of that step is saved).
    """
    cfg, rank, device, dp, mesh = s.cfg, s.rank, s.device, s.dp, s.mesh
    data_parallel = dp_mesh(mesh)  # looked up once, not at every logged step
    loss_group = loss_mesh(mesh).get_group()  # the ranks holding their own tokens: data-parallel x CP
    loader, train_state, ckpt, run_dir = s.loader, s.train_state, s.ckpt, RunDir(cfg.run_dir)
    opened = {}

    def open_log():  # first, on rank 0: a W&B run that cannot start stops every rank, the run directory as it was
        opened["log"] = MetricsLog(cfg.run_dir, True, train_state.step, cfg.metrics, dataclasses.asdict(cfg))

    distributed.on_rank0(open_log, rank)
    log = opened.get("log") or MetricsLog(cfg.run_dir, False)
    if rank == 0:
        cli.write_resolved(cfg, run_dir.config)
        with contextlib.suppress(FileNotFoundError):  # a record of an earlier run must not speak for this one
            os.remove(run_dir.exit_record)

    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = torch.tensor([device_peak_flops(device)], dtype=torch.float64)
    dist.all_reduce(peak)  # the run's peak is the sum of its ranks' peaks
    peak_total = peak.item()
    val = val_batches(s.corpus, cfg.train.val_batches * cfg.train.global_batch_size, s.micro_batch_size,
                      data_parallel.get_local_rank(), dp)
    if rank == 0:
        print(start_line(s, fpt), flush=True)
        unvalidated = [n for n in s.corpus.names if n not in {v.name for v in val}]
        if cfg.train.val_interval and len(s.corpus.names) > 1 and unvalidated:
            print(f"[train] notice: no val_loss/<name> for {', '.join(unvalidated)}: fewer held-out windows than the "
                  f"{dp} data-parallel rank(s); raise data.val_fraction or give the source more text", flush=True)

    stop = distributed.StopFlag()
    progress = Progress(cfg.train.steps, train_state.step, rank == 0)
    profiler = StepProfiler(parse_steps(cfg.train.profile_steps), cfg.run_dir, device, rank == 0)
    stopped_by, start_step = 0, train_state.step
    t_last, tokens_last = time.perf_counter(), train_state.tokens_seen
    while train_state.step < cfg.train.steps:
        profiler.before_step(train_state.step + 1)
        try:
            result = train_step(s, loader.next_step())
        except NonFiniteError as e:
            raise TrainingError(
                f"step {train_state.step + 1}: {e}; stopped before the update, so the last checkpoint in {ckpt.root} "
                f"is untouched; lower optim.lr, raise optim.warmup_steps, or pass --train.nonfinite skip"
            ) from None
        step = train_state.step
        if step == start_step + 1:  # compiled and warmed up: from now on a slow collective means a lost peer
            distributed.set_collective_timeout(cfg.train.collective_timeout_s)
        progress.step()
        ckpt.poll()
        trace = profiler.after_step(step)
        if trace:
            progress.write(f"[profile] steps {cfg.train.profile_steps}: {trace}")

        if step % cfg.train.log_interval == 0 or step == cfg.train.steps or result.skipped:
            grad_norm = result.grad_norm.item()
            tps = (train_state.tokens_seen - tokens_last) / (time.perf_counter() - t_last)
            loss, z = result.global_losses(loss_group)
            record = {"step": step, "loss": loss, "lr": result.lr,
                      "grad_norm": grad_norm, "tokens_per_sec": tps, "mfu": tps * fpt / peak_total,
                      "tokens_seen": train_state.tokens_seen, "global_batch_size": result.n_targets // cfg.data.seq_len,
                      "epoch": loader.epoch, "peak_mem_gib": peak_memory_gib(device), **loader.source_tokens()}
            if cfg.train.z_loss:
                record["z_loss"] = cfg.train.z_loss * z
            if result.skipped:
                record["skipped"] = True
                record["skip_reason"] = result.skipped
            log.write(record)
            progress.log(record)
            if result.skipped:
                progress.write(f"[train] step {step}: update skipped, {result.skipped}")
            t_last, tokens_last = time.perf_counter(), train_state.tokens_seen

        paused = time.perf_counter()
        if val and cfg.train.val_interval and (step % cfg.train.val_interval == 0 or step == cfg.train.steps):
            sums = {v.name: loss_sum_and_count(s.model, v, device, mesh, loss_group,
                                               cfg.train.loss_chunk_size) for v in val}  # each source alone
            val_losses = {name: total / count for name, (total, count) in sums.items()}
            record = val_record(val_losses, val)
            log.write({"step": step, **record})
            progress.write(f"[val] step {step}: val_loss {record['val_loss']:.4f}")
        if cfg.eval.due(step, cfg.train.steps):
            record = evaluate_tasks(s.model, s.tasks, device, mesh, data_parallel.get_local_rank(), dp,
                                    data_parallel.get_group(), s.micro_batch_size * cfg.data.seq_len)
            log.write({"step": step, **record})
            progress.write(f"[eval] step {step}: " + ", ".join(f"{k[5:]} {v:.4f}" for k, v in record.items()))
        if step % cfg.checkpoint.interval == 0 or step == cfg.train.steps:
            ckpt.save(step, s.app)
        stopped_by = stop.any_rank()
        if stopped_by:
            ckpt.save(step, s.app)
            ckpt.wait()
            break
        t_last += time.perf_counter() - paused  # validation and saving are not training throughput
    ckpt.close()
    progress.close()
    log.close()
    if rank == 0:
        step, total = train_state.step, cfg.train.steps
        write_exit_record(run_dir.exit_record, stopped_by, step, total)
        if stopped_by:
            verb = "interrupted" if stopped_by == signal.SIGINT else "stopped"
            print(f"[train] {signal.Signals(stopped_by).name}: saved step {step} in {ckpt.root}; {verb} at step "
                  f"{step} of {total}; run the same command to resume", flush=True)
        else:
            print(f"[train] finished: step {step} of {total}; peak memory {peak_memory_gib(device):.2f} GiB on "
                  f"rank 0", flush=True)
    return stopped_by


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


# ---------------------------------------------------------------- the command


def check_run(cfg: Config, world_size: int, tp_plan: TPPlan | None = None,
              check_layout: Callable[[Config, int], None] | None = None) -> None:
    """Every check that needs no collective, in the order a user can fix them; raises a UserError.

    check_layout(cfg, world_size): the TP plan's own layout checks (train_2d.py), run first.
    With init_from_hf, data.tokenizer defaults to the folder's tokenizer.json.
    """
    if tp_plan is None and cfg.parallel.tp != 1:
        raise SetupError(f"parallel.tp is {cfg.parallel.tp}: tensor parallelism runs with train_2d.py")
    if check_layout is not None:
        check_layout(cfg, world_size)
    if cfg.init_from_hf:
        from core.errors import require
        require("safetensors", "hf", "--init_from_hf")
        try:
            hf.check_args(cfg.init_from_hf, cfg.model)
            cfg.data.tokenizer = cfg.data.tokenizer or hf.tokenizer_path(cfg.init_from_hf)
        except hf.HFError as e:
            raise SetupError(f"--init_from_hf: {e}") from None
    validate(cfg, world_size)
    note = shard_group_note(cfg.parallel, world_size, distributed.local_world_size())
    if note and int(os.environ.get("RANK", 0)) == 0:
        print(note, flush=True)
    device = distributed.resolve_device(cfg.train.device)
    cfg.train.dtype = compute_dtype(cfg.train, device)  # the resolved dtype is what config.toml records
    if cfg.train.dtype == "bfloat16" and device.type == "cpu" and not distributed.cpu_has_native_bf16() \
            and int(os.environ.get("RANK", 0)) == 0:
        print("[train] notice: train.dtype bfloat16 on a CPU without native bf16 matmuls (no avx512_bf16 or "
              "amx_bf16): expect it 3-8x slower than --train.dtype float32", flush=True)


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


def run(cfg: Config, tp_plan: TPPlan | None = None) -> int:
    """Train as configured (called under torchrun on every rank, after check_run); returns train()'s result."""
    lock = lock_run_dir(cfg.run_dir) if int(os.environ.get("RANK", 0)) == 0 else None
    try:
        rank, world_size, device = distributed.init_distributed(cfg.train.device)
        session = None
        try:
            session = build(cfg, rank, world_size, device, tp_plan)
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
    try:
        cfg = parse_config(argv, description, require_file=True)
        check_run(cfg, distributed.world_size(), tp_plan, check_layout)
        return exit_status(run(cfg, tp_plan))
    except PeerError as e:
        report(e)
        # The process group is broken: leave now, before interpreter teardown races gloo's threads
        # into an abort ("terminate called ..."). Everything worth keeping is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except UserError as e:
        report(e)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C before the loop, or a second one inside it
        if int(os.environ.get("RANK", 0)) == 0:
            print("[train] interrupted (Ctrl-C); what was saved before stays; run the same command to resume",
                  file=sys.stderr, flush=True)
        return 130
