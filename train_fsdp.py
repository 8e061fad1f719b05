"""Pretrain a Llama model with FSDP2 (``fully_shard``) on one data-parallel mesh.

    torchrun --standalone --nproc_per_node=N train_fsdp.py --config configs/debug.toml --run_dir DIR

Order of construction (DESIGN.md): build on the meta device -> tensor-parallel plan
(train_2d.py only) -> activation checkpointing -> compile -> ``fully_shard`` each block, then
the root -> ``to_empty`` -> ``init_weights`` -> optimizer. Running the same command again
resumes from the newest complete checkpoint in DIR/checkpoints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import signal
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import config as config_lib
import data as data_lib
import hf
from checkpoint import (AppState, CheckpointConfig, CheckpointError, Checkpointer, TrainState, check_compatible,
                        check_same_config, lock_run_dir)
from metrics import MetricsLog, device_peak_flops, peak_memory_gib
from model import PRESETS, ModelArgs, Transformer, flops_per_token, num_params


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train for (the LR schedule ends here)."""
    global_batch_size: int = 64
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = 0
    """Sequences per forward pass on one rank (0: global_batch_size / data-parallel size, no accumulation)."""
    seed: int = 0
    """Seed of the initial weights and of the data order."""
    dtype: str = "bfloat16"
    """Parameter dtype in forward/backward: 'bfloat16' (mixed precision, fp32 master weights and reductions) or 'float32'."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cuda' or 'cpu'."""
    activation_checkpointing: str = "none"
    """'none', 'full' (recompute every block in backward) or 'selective' (keep matmul outputs, recompute the rest)."""
    compile: bool = False
    """torch.compile each block."""
    log_interval: int = 10
    """Log train metrics every this many steps."""
    val_interval: int = 200
    """Validate every this many steps and at the end (0: never)."""
    val_batches: int = 4
    """Validation uses up to this many global batches of held-out sequences."""
    nonfinite: str = "stop"
    """A non-finite gradient norm: 'stop' the run (the last checkpoint stays as it was) or 'skip' that step's update."""


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """Final LR of the cosine decay, as a fraction of lr."""
    warmup_steps: int = 1000
    """Steps of linear warmup from lr/warmup_steps to lr."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (embeddings and projections); norm weights are not decayed."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this (0: no clipping; the norm is still logged)."""


@dataclasses.dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (train_2d.py only; train_fsdp.py needs 1)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3); false keeps them until backward (ZeRO-2 like)."""
    prefetch: int = 1
    """How many blocks ahead FSDP gathers parameters in forward and backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA runs only)."""


@dataclasses.dataclass
class Config:
    run_dir: str = "runs/default"
    """Directory of this run: metrics.jsonl, config.toml, checkpoints/, data/."""
    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    """Model shape; 'preset = NAME' selects one of model.PRESETS, then fields override it."""
    data: data_lib.DataConfig = dataclasses.field(default_factory=data_lib.DataConfig)
    """Text source, tokenizer and packing."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Loop, batch, precision and memory options."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW, LR schedule and clipping."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Sharding options."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint interval, retention, async saving, explicit resume path."""
    init_from_hf: str = ""
    """Hugging Face Llama folder whose weights replace the random init when the run has no checkpoint yet (continued pretraining); [model] must match its config.json, and data.tokenizer defaults to its tokenizer.json."""


class SetupError(ValueError):
    """Bad configuration found before training; the message names the field and the fix."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite gradient); the message says at which step and why."""


def parse_config(argv: list[str] | None = None, description: str = __doc__) -> Config:
    """Config from --config FILE and --section.field overrides; ConfigError on bad input."""
    return config_lib.parse_args(Config, argv, presets={"model": PRESETS}, description=description)


def validate(cfg: Config, world_size: int, tp: int) -> None:
    """Checks that need no collective; raise SetupError naming the field and the fix."""
    t, d = cfg.train, cfg.data
    if world_size % tp:
        raise SetupError(f"world size {world_size} is not divisible by parallel.tp {tp}; use a multiple of {tp} processes")
    dp = world_size // tp
    micro = t.micro_batch_size or t.global_batch_size // max(dp, 1)
    if t.global_batch_size <= 0 or t.global_batch_size % dp or micro <= 0 or t.global_batch_size % (dp * micro):
        raise SetupError(
            f"train.global_batch_size ({t.global_batch_size}) must be a positive multiple of data-parallel size "
            f"({dp}) x train.micro_batch_size ({micro}); change one of them"
        )
    if d.seq_len <= 0 or d.seq_len > cfg.model.max_seq_len:
        raise SetupError(
            f"data.seq_len ({d.seq_len}) must be in 1..model.max_seq_len ({cfg.model.max_seq_len}), the RoPE table length"
        )
    if t.steps <= 0:
        raise SetupError(f"train.steps must be > 0, got {t.steps}")
    if t.dtype not in ("bfloat16", "float32"):
        raise SetupError(f"train.dtype must be 'bfloat16' or 'float32', got '{t.dtype}'")
    if t.device not in ("auto", "cuda", "cpu"):
        raise SetupError(f"train.device must be 'auto', 'cuda' or 'cpu', got '{t.device}'")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise SetupError("train.device is 'cuda' but no CUDA device is visible; use --train.device cpu")
    if t.activation_checkpointing not in ("none", "full", "selective"):
        raise SetupError(
            f"train.activation_checkpointing must be 'none', 'full' or 'selective', got '{t.activation_checkpointing}'"
        )
    if not 0 <= t.seed < 2 ** 32:
        raise SetupError(f"train.seed must be in 0..2**32-1, got {t.seed}")
    if t.log_interval <= 0:
        raise SetupError(f"train.log_interval must be > 0, got {t.log_interval}")
    for name, value in (("train.val_interval", t.val_interval), ("train.val_batches", t.val_batches),
                        ("train.micro_batch_size", t.micro_batch_size), ("checkpoint.keep", cfg.checkpoint.keep)):
        if value < 0:
            raise SetupError(f"{name} must be >= 0, got {value}")
    if cfg.checkpoint.interval <= 0:
        raise SetupError(f"checkpoint.interval must be > 0, got {cfg.checkpoint.interval}")
    o = cfg.optim
    if o.warmup_steps < 0 or not o.lr > 0:
        raise SetupError(f"optim.lr must be > 0 and optim.warmup_steps >= 0, got {o.lr} and {o.warmup_steps}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise SetupError(f"optim.{name} must be in [0, 1), got {getattr(o, name)}")
    for name in ("eps", "weight_decay", "grad_clip", "min_lr_ratio"):
        if not getattr(o, name) >= 0 or (name == "eps" and o.eps == 0):
            raise SetupError(f"optim.{name} must be {'> 0' if name == 'eps' else '>= 0'}, got {getattr(o, name)}")
    if not 0 <= d.val_fraction < 1:
        raise SetupError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if cfg.parallel.prefetch < 1:
        raise SetupError(f"parallel.prefetch must be >= 1, got {cfg.parallel.prefetch}")
    if cfg.parallel.cpu_offload and resolve_device(cfg, 0).type != "cuda":
        raise SetupError("parallel.cpu_offload needs a CUDA run; on CPU the parameters are in CPU memory already")
    data_lib.check_source(d)
    if cfg.init_from_hf:
        try:
            hf.check_args(cfg.init_from_hf, cfg.model)
            d.tokenizer = d.tokenizer or hf.tokenizer_path(cfg.init_from_hf)
        except hf.HFError as e:
            raise SetupError(f"--init_from_hf: {e}") from None
    if d.tokenizer:
        tok = data_lib.load_tokenizer(d.tokenizer)
        check_vocab(tok.get_vocab_size(), cfg.model.vocab_size, d.tokenizer)
    elif d.tokenizer_vocab_size > cfg.model.vocab_size:
        raise SetupError(
            f"data.tokenizer_vocab_size ({d.tokenizer_vocab_size}) is larger than model.vocab_size "
            f"({cfg.model.vocab_size}); lower the first or raise the second"
        )
    if t.nonfinite not in ("stop", "skip"):
        raise SetupError(f"train.nonfinite must be 'stop' or 'skip', got '{t.nonfinite}'")
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        probe = os.path.join(cfg.run_dir, f".write_probe_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise SetupError(f"--run_dir '{cfg.run_dir}' is not writable ({e.strerror}); choose another directory") from e


def check_vocab(tokenizer_vocab: int, model_vocab: int, where: str) -> None:
    if tokenizer_vocab > model_vocab:
        raise SetupError(
            f"tokenizer '{where}' has {tokenizer_vocab} tokens but model.vocab_size is {model_vocab}; "
            f"raise model.vocab_size or use a smaller tokenizer (data.tokenizer_vocab_size)"
        )


def resolve_device(cfg: Config, local_rank: int) -> torch.device:
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


# ---------------------------------------------------------------- parallelism, in one place

def selective_policy(ctx, op, *args, **kwargs):
    """Keep matmul and attention outputs for backward, recompute the cheap elementwise rest."""
    keep = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: Config, device: torch.device,
                tensor_parallel: Callable[[Transformer, DeviceMesh], None] | None = None) -> None:
    """Apply TP (if given), activation checkpointing, compile and FSDP2 to a meta-device model.

    mesh has a "dp" dimension (and "tp" for 2D). Module names stay unchanged: composable
    activation checkpointing and Module.compile add no prefixes to state-dict keys.
    """
    if tensor_parallel is not None:
        tensor_parallel(model, mesh["tp"])
    ac = cfg.train.activation_checkpointing
    for block in model.layers:
        if ac == "full":
            activation_checkpoint(block)
        elif ac == "selective":
            activation_checkpoint(block, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                      selective_policy))
        if cfg.train.compile:
            block.compile()
    mp = None
    if cfg.train.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh["dp"], reshard_after_forward=cfg.parallel.reshard_after_forward,
                  offload_policy=CPUOffloadPolicy() if cfg.parallel.cpu_offload else OffloadPolicy())
    if mp is not None:
        kwargs["mp_policy"] = mp
    blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    depth = cfg.parallel.prefetch
    if depth > 1:  # depth 1 is FSDP2's implicit prefetch
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


def copy_sharded(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full initial value into a (possibly DTensor) parameter, keeping only the local shard.

    distribute_tensor with src_data_rank=None slices locally: no communication, and the
    result is the same whatever the mesh, so initial weights do not depend on sharding.
    """
    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def materialize(model: Transformer, device: torch.device, cfg: Config) -> None:
    """to_empty onto the device (parameters on CPU when offloading), then init_weights from the seed."""
    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else device)
    for name in ("rope_cos", "rope_sin"):  # buffers are not offloaded: compute needs them on the device
        setattr(model, name, getattr(model, name).to(device))
    model.init_weights(cfg.train.seed, copy_=copy_sharded)


# ---------------------------------------------------------------- optimizer and schedule

def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for the optimizer step that follows `step` completed steps.

    Linear warmup: (step + 1) / warmup_steps for the first warmup_steps steps; then cosine
    decay from 1 to min_ratio over the remaining steps (Loshchilov & Hutter, SGDR, 2017).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device):
    """AdamW (fused kernel on CUDA and CPU) with decay on matrices only, and its warmup + cosine LambdaLR."""
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = not cfg.parallel.cpu_offload  # torch >= 2.4 has fused AdamW on CPU too
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or None)
    schedule = functools.partial(lr_factor, warmup_steps=o.warmup_steps, total_steps=cfg.train.steps,
                                 min_ratio=o.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def grad_norm_(params, max_norm: float, device: torch.device) -> torch.Tensor:
    """Global L2 norm of the gradients of params (DTensors on any mesh, or plain tensors); clip in place.

    Each gradient's local squared sum is reduced over the mesh dimensions it is sharded on
    (replicated dimensions hold copies and are not summed), on `device` so CPU-offloaded
    gradients work with NCCL. Returns the pre-clip norm as a 0-dim fp32 tensor on device.
    Clipping (max_norm > 0) scales every gradient by min(1, max_norm / (norm + 1e-6)).
    """
    groups: dict[tuple, torch.Tensor] = {}
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, local = (g.device_mesh, dims), g.to_local()
        else:
            key, local = (None, ()), g
        sq = local.detach().float().pow(2).sum().to(device)
        groups[key] = groups[key] + sq if key in groups else sq
    total = torch.zeros((), device=device)
    for (mesh, dims), sq in groups.items():
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))
        total = total + sq
    norm = total.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device))
    return norm


# ---------------------------------------------------------------- the step

def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def token_loss_sum(model, inputs, labels, loss_context) -> torch.Tensor:
    """Sum over tokens of the fp32 cross-entropy of next-token prediction (inputs, labels: (B, T) int64)."""
    with loss_context():
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def forward_backward(model, micro_batches, n_targets: int, dp_size: int, device, loss_context) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches of one step; gradients accumulate.

    Every micro-batch's loss sum is divided by n_targets, the global count of target tokens
    of the step, and multiplied by dp_size because FSDP averages gradients over data-parallel
    ranks: the gradient is exactly that of the global mean token loss, however the batch is
    split. Returns this rank's summed token loss, a 0-dim fp32 tensor on device (no host sync).
    """
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, labels) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once per step
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with loss_context():
            loss = token_loss_sum(model, inputs, labels, contextlib.nullcontext)
            (loss * (dp_size / n_targets)).backward()
        loss_sum += _scalar(loss).detach()
    return loss_sum


class NonFiniteError(RuntimeError):
    """The global gradient norm is NaN or inf; the weights were not updated."""


def optimizer_step(model, optimizer, grad_clip: float, device, skip_nonfinite: bool = False) -> torch.Tensor:
    """Clip to grad_clip (0: no clipping), step, zero the gradients; returns the pre-clip global norm.

    A non-finite norm never reaches the weights: the gradients are dropped and NonFiniteError
    is raised, or, with skip_nonfinite, the update is skipped and the non-finite norm returned.
    Checking costs one host sync per step.
    """
    norm = grad_norm_(model.parameters(), grad_clip, device)
    if not torch.isfinite(norm).item():
        optimizer.zero_grad(set_to_none=True)
        if skip_nonfinite:
            return norm
        raise NonFiniteError(f"gradient norm is {norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@torch.no_grad()
def evaluate(model, batches, device, dp_group, loss_context) -> float:
    """Mean token loss over every rank's validation batches (each rank must get as many batches)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for inputs, labels in batches:
        loss = token_loss_sum(model, inputs.to(device), labels.to(device), loss_context)
        total[0] += _scalar(loss).double()
        total[1] += labels.numel()
    model.train()
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item()


# ---------------------------------------------------------------- the run

def on_rank0(fn, rank: int):
    """Run fn on rank 0 and share its result; every rank raises the same error if it failed."""
    box = [None, None]
    if rank == 0:
        try:
            box[0] = fn()
        except (data_lib.DataError, SetupError, CheckpointError) as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise SetupError(box[1])
    return box[0]


def prepare_data(cfg: Config, rank: int, world_size: int) -> dict:
    """data.prepare on every rank (collective), on a gloo group whose timeout allows a large corpus.

    Raises SetupError on every rank for bad data found on any rank or a tokenizer larger than the model.
    """
    # Tokenizing a large corpus can outlast the default group's 30-minute timeout; a hung peer is
    # still caught, because torchrun stops every rank when one fails.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=24))
    data_lib.share_cores_between_local_ranks()

    def all_gather(obj):
        out = [None] * world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    try:
        meta = data_lib.prepare(cfg.data, os.path.join(cfg.run_dir, "data"), rank, world_size, all_gather)
    except data_lib.DataError as e:
        raise SetupError(str(e)) from None
    finally:
        dist.destroy_process_group(group)
    check_vocab(meta["vocab_size"], cfg.model.vocab_size, meta["tokenizer"])
    return meta


class StopFlag:
    """SIGTERM (preemption) sets a flag; ranks agree on it once per step, so all stop together."""

    def __init__(self):
        self.local = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.local = True

    def any_rank(self) -> bool:
        flag = torch.tensor([1.0 if self.local else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, never a GPU sync
        return bool(flag.item())


def init_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """Process group from torchrun's environment: NCCL for CUDA tensors plus gloo for CPU ones."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a plain `python` run of one process: any free port, no clash
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    device = resolve_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    return rank, world, device


def finish_distributed() -> None:
    """Leave the process group together: a barrier, then destroy.

    Without the barrier, a rank that finishes its last gloo collective first can close its
    connections while a peer's gloo thread still uses them, and the peer aborts on exit
    ("terminate called without an active exception") after its work is done.
    """
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: Config, tensor_parallel: Callable[[Transformer, DeviceMesh], None] | None = None,
        loss_context=contextlib.nullcontext) -> None:
    """Train as configured (called under torchrun on every rank). tensor_parallel: train_2d.py's plan."""
    tp = cfg.parallel.tp
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg, world_size, tp)
    lock = lock_run_dir(cfg.run_dir) if int(os.environ.get("RANK", 0)) == 0 else None
    try:
        rank, world_size, device = init_distributed(cfg)
        train(build(cfg, rank, world_size, device, tensor_parallel), loss_context)
        finish_distributed()
    finally:
        if dist.is_initialized():  # after an error: no barrier, a peer may never reach it
            dist.destroy_process_group()
        if lock is not None:
            lock.close()


@dataclasses.dataclass
class Session:
    """Everything built for a run on one rank, before the loop (also used by tests and benchmarks)."""

    cfg: Config
    rank: int
    device: torch.device
    mesh: DeviceMesh
    dp: int
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    corpus: data_lib.PackedCorpus
    loader: data_lib.GlobalBatchLoader
    micro_batch_size: int
    train_state: TrainState
    ckpt: Checkpointer
    app: AppState
    meta: dict
    resumed_from: str | None


def build(cfg: Config, rank: int, world_size: int, device: torch.device,
          tensor_parallel: Callable[[Transformer, DeviceMesh], None] | None = None, resume: bool = True) -> Session:
    """Mesh, data, sharded model, optimizer and checkpointer (collective); resumes if a checkpoint exists."""
    tp = cfg.parallel.tp
    dp = world_size // tp
    shape, names = ((dp, tp), ("dp", "tp")) if tensor_parallel is not None else ((dp,), ("dp",))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(cfg.train.seed)

    # Data: all ranks tokenize their share of the corpus into the run directory, then map it.
    data_dir = os.path.join(cfg.run_dir, "data")
    meta = prepare_data(cfg, rank, world_size)
    corpus = data_lib.PackedCorpus(data_dir, cfg.data)
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size // dp
    data_state = data_lib.DataState()
    loader = data_lib.GlobalBatchLoader(corpus, cfg.train.global_batch_size, micro, dp_rank, dp,
                                        cfg.train.seed, data_state)

    with torch.device("meta"):
        model = Transformer(cfg.model)
    full_shapes = {k: v.shape for k, v in model.state_dict().items()}
    parallelize(model, mesh, cfg, device, tensor_parallel)
    materialize(model, device, cfg)
    optimizer, scheduler = build_optimizer(model, cfg, device)

    train_state = TrainState()
    ckpt = Checkpointer(cfg.checkpoint, cfg.run_dir, rank, config_lib.to_toml(cfg))
    app = AppState(model, optimizer, scheduler, train_state, data_state, rank)

    def find_resume():
        ckpt.clean_partial()
        path = ckpt.resume_path()
        if path is not None:
            check_compatible(path, full_shapes)
            check_same_config(path, "model", dataclasses.asdict(cfg.model))
        return path

    path = on_rank0(find_resume, rank) if resume else None
    if path is not None:
        ckpt.load(path, app)
    elif cfg.init_from_hf:  # every rank reads the folder and keeps its own shards: no communication
        hf.load_hf_into(model, cfg.init_from_hf, copy_=copy_sharded)
    return Session(cfg, rank, device, mesh, dp, model, optimizer, scheduler, corpus, loader, micro,
                   train_state, ckpt, app, meta, path)


def train(s: Session, loss_context=contextlib.nullcontext) -> None:
    """The training loop: steps, logging, validation, checkpoints, SIGTERM; from s.train_state.step on."""
    cfg, rank, device, dp = s.cfg, s.rank, s.device, s.dp
    model, optimizer, scheduler, loader, train_state, ckpt = (s.model, s.optimizer, s.scheduler, s.loader,
                                                              s.train_state, s.ckpt)
    if rank == 0:
        config_lib.write_resolved(cfg, os.path.join(cfg.run_dir, "config.toml"))

    n_targets = cfg.train.global_batch_size * cfg.data.seq_len  # packed: every label is a target
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = torch.tensor([device_peak_flops(device)], dtype=torch.float64)
    dist.all_reduce(peak)  # the run's peak is the sum of its ranks' peaks
    peak_total = peak.item()
    log = MetricsLog(cfg.run_dir, rank == 0)
    dp_mesh = s.mesh["dp"]
    val = data_lib.val_batches(s.corpus, cfg.train.val_batches * cfg.train.global_batch_size, s.micro_batch_size,
                               dp_mesh.get_local_rank(), dp)
    if rank == 0:
        print(f"[train] mesh {dict(zip(s.mesh.mesh_dim_names, s.mesh.shape))} device {device.type} | "
              f"params {num_params(cfg.model) / 1e6:.2f}M | {fpt / 1e6:.1f} MFLOP/token | "
              f"corpus {s.meta['n_tokens']:,} tokens in {s.meta['n_documents']} docs, {s.corpus.n_train} train / "
              f"{s.corpus.n_val} val sequences | "
              + (f"resumed from {s.resumed_from} at step {train_state.step}" if s.resumed_from else
                 f"weights from {cfg.init_from_hf}" if cfg.init_from_hf else "fresh start"),
              flush=True)

    stop = StopFlag()
    dp_group = dp_mesh.get_group()
    from tqdm import tqdm

    bar = tqdm(total=cfg.train.steps, initial=train_state.step, disable=rank != 0, dynamic_ncols=True)
    t_last, tokens_last = time.perf_counter(), train_state.tokens_seen
    while train_state.step < cfg.train.steps:
        lr = scheduler.get_last_lr()[0]
        loss_sum = forward_backward(model, loader.next_step(), n_targets, dp, device, loss_context)
        try:
            norm = optimizer_step(model, optimizer, cfg.optim.grad_clip, device, cfg.train.nonfinite == "skip")
        except NonFiniteError as e:
            raise TrainingError(
                f"step {train_state.step + 1}: {e} (loss {loss_sum.item() / n_targets * dp:.4g} on rank {rank}); "
                f"stopped before the update, so the last checkpoint in {ckpt.root} is untouched; lower optim.lr, "
                f"raise optim.warmup_steps, or pass --train.nonfinite skip"
            ) from None
        scheduler.step()
        train_state.step += 1
        train_state.tokens_seen += n_targets
        step = train_state.step
        bar.update(1)
        ckpt.poll()

        if step % cfg.train.log_interval == 0 or step == cfg.train.steps:
            dist.all_reduce(loss_sum, group=dp_group)
            loss = loss_sum.item() / n_targets
            grad_norm = norm.item()
            elapsed = time.perf_counter() - t_last
            tps = (train_state.tokens_seen - tokens_last) / elapsed
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                      "mfu": tps * fpt / peak_total, "tokens_seen": train_state.tokens_seen,
                      "epoch": loader.epoch, "peak_mem_gib": peak_memory_gib(device)}
            if not math.isfinite(grad_norm):
                record["skipped"] = True
            log.write(record)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}", mfu=f"{record['mfu']:.1%}")
            t_last, tokens_last = time.perf_counter(), train_state.tokens_seen

        paused = time.perf_counter()
        if val and cfg.train.val_interval and (step % cfg.train.val_interval == 0 or step == cfg.train.steps):
            val_loss = evaluate(model, val, device, dp_group, loss_context)
            log.write({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
            if rank == 0:
                bar.write(f"[val] step {step}: val_loss {val_loss:.4f}")
        if step % cfg.checkpoint.interval == 0 or step == cfg.train.steps:
            ckpt.save(step, s.app)
        if stop.any_rank():
            ckpt.save(step, s.app)
            ckpt.wait()
            if rank == 0:
                bar.write(f"[train] SIGTERM: saved step {step} in {ckpt.root}; run the same command to resume")
            break
        t_last += time.perf_counter() - paused  # validation and saving are not training throughput
    ckpt.close()
    bar.close()
    if rank == 0:
        print(f"[train] done at step {train_state.step}; peak memory {peak_memory_gib(device):.2f} GiB on rank 0",
              flush=True)


def main(argv: list[str] | None = None, tensor_parallel=None, loss_context=contextlib.nullcontext,
         description: str = __doc__, check: Callable[[Config, int], None] | None = None) -> int:
    """Entry point: parse, validate, run; bad input exits with status 2 and a one-line message.

    check(cfg, world_size), if given, runs first of the checks, before the process group exists.
    """
    try:
        args = sys.argv[1:] if argv is None else argv
        if not any(a == "--config" or a.startswith("--config=") for a in args) and "--help" not in args \
                and "-h" not in args:
            raise SetupError("--config FILE.toml is required (the defaults alone are a 179M-parameter GPU run); "
                             "start with --config configs/debug.toml")
        cfg = parse_config(argv, description)
        if tensor_parallel is None and cfg.parallel.tp != 1:
            raise SetupError(f"parallel.tp is {cfg.parallel.tp}: tensor parallelism runs with train_2d.py")
        if check is not None:
            check(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        run(cfg, tensor_parallel, loss_context)
    except (config_lib.ConfigError, SetupError, TrainingError, data_lib.DataError, CheckpointError, hf.HFError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
