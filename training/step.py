"""The one training step that the loop, the tests and the benchmarks run: forward/backward, clip, update, schedule.

A Trainable is what a step reads and changes on one rank (the sharded model, its optimizer and
LR schedule, the counters); build_trainable makes one from a Config. The step needs no host
sync beyond the gradient norm's finiteness check (and the spike guard's global loss when on).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from checkpoint import TrainState
from config import Config, compute_dtype
from model import Transformer
from nn.loss import applied_chunk_size, loss_context, token_loss_sums
from nn.moe import MoE, moe_layers
from optimization.optimizers import build_optimizer
from optimization.spike import push, spike_reason
from parallel import distributed, float8
from parallel.context_parallel import shard_batch
from parallel.parallelize import TPPlan, build_model, dp_mesh, loss_mesh, stage_group
from parallel.pipeline import Pipeline, build_pipeline, default_microbatches


@dataclasses.dataclass
class MoEStats:
    """A step's MoE figures, summed over this rank's micro-batches (device tensors: no host sync).

    After reduce(): counts are the global batch's, the same on every rank.
    """

    layers: list[MoE]
    counts: torch.Tensor
    """(MoE layers, n_experts) int64: tokens routed to each expert."""
    aux_sum: torch.Tensor
    """0-dim fp32: this rank's sum of the layers' aux_loss (coefficients applied; a token sum, see nn/moe.py)."""
    aux_on: bool = False
    """Whether the model has an aux or router z-loss (model.moe_aux_loss, model.moe_router_z_loss)."""

    @classmethod
    def of(cls, model: torch.nn.Module, device) -> MoEStats | None:
        """Empty stats for model's MoE layers; None for a dense model. A pipeline stage of an MoE model gets stats
        even without MoE layers of its own (its record joins the other stages')."""
        layers, args = moe_layers(model), getattr(model, "args", None)
        n_experts = layers[0].n_experts if layers else getattr(args, "n_experts", 0)
        if not n_experts:
            return None
        aux_on = any(m.aux_coef or m.z_coef for m in layers) or bool(
            args is not None and (args.moe_aux_loss or args.moe_router_z_loss))
        return cls(layers, torch.zeros(len(layers), n_experts, dtype=torch.int64, device=device),
                   torch.zeros((), device=device), aux_on)

    def collect(self) -> torch.Tensor | None:
        """Add the last forward's counts; return the layers' aux losses summed (with autograd), None if off."""
        self.counts += torch.stack([m.counts for m in self.layers])
        losses = [m.aux_loss for m in self.layers if m.aux_loss is not None]
        if not losses:
            return None
        aux = torch.stack(losses).sum()
        self.aux_sum += aux.detach()
        return aux

    def reduce(self, group) -> None:
        """Sum the counts over group's ranks (the data-parallel ranks): every rank then holds the global counts."""
        if self.layers:  # a pipeline stage without MoE layers: so are its data-parallel peers
            dist.all_reduce(self.counts, group=group)

    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free update: each expert's bias += rate * sign(mean load - its load).

        From the global counts (after reduce), so the bias is the same on every rank and at every layout.
        """
        with torch.no_grad():
            for layer, c in zip(self.layers, self.counts.float()):
                layer.expert_bias.add_(torch.sign(c.mean() - c), alpha=rate)

    def record(self, n_targets: int, group, stages_group=None) -> dict:
        """The train record's MoE fields (collective over group; syncs): moe_max_load (the busiest expert's tokens
        over the mean per expert, the largest over the MoE layers), moe_bias_range (largest minus smallest bias over
        all layers), and moe_aux_loss (the aux and z losses as added to the objective, per token) when on.
        stages_group: under pipeline parallelism the pp group, over whose stages' layers these are taken."""
        c = self.counts.float()
        bias = torch.cat([m.expert_bias for m in self.layers] or [c.new_zeros(0)])
        # [max load, max bias, -min bias, aux sum]: one reduction per op over the stages
        top = torch.stack([(c.max(1).values / c.mean(1).clamp(min=1e-9)).max() if len(c) else c.new_zeros(()),
                           bias.max() if len(bias) else c.new_full((), -math.inf),
                           -bias.min() if len(bias) else c.new_full((), -math.inf)])
        aux = self.aux_sum.clone()
        if stages_group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=stages_group)
        out = {"moe_max_load": top[0].item(), "moe_bias_range": (top[1] + top[2]).item()}
        if self.aux_on:
            dist.all_reduce(aux, group=group)
            if stages_group is not None:
                dist.all_reduce(aux, group=stages_group)
            out["moe_aux_loss"] = aux.item() / n_targets
        return out


def forward_backward(model, micro_batches, n_targets: int, dp_size: int, device, mesh: DeviceMesh,
                     loss_chunk_size: int = 0, z_loss: float = 0.0, moe: MoEStats | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
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
    host sync). moe: an MoE model's MoEStats, which gathers each micro-batch's expert counts; the
    MoE layers' aux losses (token sums) join the objective, normalised as the cross-entropy.
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
            aux = moe.collect() if moe is not None else None  # before backward: recomputation may run forward again
            ((objective if aux is None else objective + aux) * (dp_size / n_targets)).backward()
        loss_sum += objective.detach() - z_loss * z_sum
        z_total += z_sum
    return loss_sum, z_total


class NonFiniteError(RuntimeError):
    """The global gradient norm is NaN or inf; the weights were not updated."""


class Divergence(Exception):
    """train.rollback's trigger, raised before the update (weights, schedule and counters unchanged), alike on every
    rank: the loss and the norm it is decided on are global."""

    def __init__(self, step: int, first: int, trigger: str):
        super().__init__(trigger)
        self.step = step
        """The divergent step (1-based): the one that did not update."""
        self.first = first
        """The first outlier step of the divergence (== step for a non-finite one)."""
        self.trigger = trigger
        """Why, in words (a non-finite norm, or the outliers' rule)."""


def optimizer_step(model, optimizer, grad_clip: float, device, skip_nonfinite: bool = False,
                   veto: Callable[[float], bool] | None = None, stages_group=None) -> torch.Tensor:
    """Clip to grad_clip (0: no clipping), step, zero the gradients; returns the pre-clip global norm.

    A non-finite norm never reaches the weights: the gradients are dropped and NonFiniteError
    is raised, or, with skip_nonfinite, the update is skipped and the non-finite norm returned.
    veto(norm): called with a finite pre-clip norm; True drops the gradients instead of the
    update (the spike guard). Checking costs one host sync per step. stages_group: the pp group under
    pipeline parallelism (the norm is the whole model's: distributed.grad_norm_).
    """
    norm = distributed.grad_norm_(model.parameters(), grad_clip, device, stages_group)
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
    outlier: str = ""
    """Under train.rollback: why the spike rule calls the step an outlier, whose update was applied ('' if none)."""
    mean_loss: float | None = None
    """global_loss, when the step already computed it (the spike guard needs it)."""
    moe: MoEStats | None = None
    """An MoE model's expert counts (global) and aux losses of the step; None for a dense model."""

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
    pipeline: Pipeline | None
    """Under parallel.pp > 1: this rank's stage and its schedule (model is the stage)."""


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
    skipped but the step counts (StepResult.skipped says why). With train.rollback on, no
    update is skipped: an outlier is trained through as without the guard (StepResult.outlier
    says why it is one), and a non-finite norm or the train.rollback_after-th outlier in a row
    raise Divergence, with nothing moved but the outlier count; the rollback goes back to
    before the first outlier, so the run is always one without the guard, with data skipped.
    An MoE model's aux losses join the objective, and after an applied update its experts'
    routing biases move from the step's global token counts (MoEStats; model.moe_bias_update_rate).
    """
    cfg, t = s.cfg, s.cfg.train
    # Every data-parallel rank holds an equal share of whole windows, and every label is a target (packed).
    n_targets = sum(len(inputs) for inputs, _ in micro_batches) * s.dp * cfg.data.seq_len
    lr = s.scheduler.get_last_lr()[0]
    ranks = loss_mesh(s.mesh).size()  # the data-parallel x CP ranks FSDP averages gradients over
    moe = MoEStats.of(s.model, s.device)
    if s.pipeline is not None:
        loss_sum, z_sum = s.pipeline.forward_backward(micro_batches, n_targets, ranks, s.device, s.mesh, moe)
    else:
        loss_sum, z_sum = forward_backward(s.model, micro_batches, n_targets, ranks, s.device, s.mesh,
                                           t.loss_chunk_size, t.z_loss, moe)
    if after_backward is not None:
        after_backward(s.model)
    if moe is not None:
        moe.reduce(loss_mesh(s.mesh).get_group())
    result = StepResult(loss_sum, torch.zeros(()), lr, n_targets, z_sum, moe=moe)
    veto = None
    if t.spike_skip:
        result.mean_loss = result.global_loss(loss_mesh(s.mesh).get_group())
        veto = functools.partial(_spike_veto, s.train_state, result, t.spike_skip, t.spike_window,
                                 t.rollback_after if t.rollback else 0)
    try:
        result.grad_norm = optimizer_step(s.model, s.optimizer, cfg.optim.grad_clip, s.device,
                                          t.nonfinite == "skip" or t.rollback > 0, veto,
                                          s.pipeline.group if s.pipeline is not None else None)
    except NonFiniteError as e:
        raise NonFiniteError(f"{e} (loss {loss_sum.item() / n_targets * ranks:.4g} on rank {s.rank})") from None
    finite = bool(torch.isfinite(result.grad_norm).item())
    if not result.skipped and not finite:
        result.skipped = "non-finite gradient norm"
        s.train_state.outliers += 1
    if t.rollback:
        _check_divergence(s.train_state, result, t.rollback_after, finite)
    if moe is not None and cfg.model.moe_bias_update_rate and not result.skipped:
        moe.update_bias(cfg.model.moe_bias_update_rate)  # after the update it balances, as DeepSeek-V3
    if cfg.train.float8 == "tensorwise":  # the next step's float8 all-gathers use these weights' scales
        float8.precompute_scales(s.model)
    s.scheduler.step()
    s.train_state.step += 1
    s.train_state.tokens_seen += n_targets
    return result


def _spike_veto(state: TrainState, result: StepResult, sigmas: float, window: int, rollback_after: int,
                grad_norm: float) -> bool:
    """The spike guard's decision on a step of finite grad_norm (optimizer_step's veto); records it in the windows.

    Under train.rollback (rollback_after > 0) an outlier's update is kept (result.outlier)
    unless it is the rollback_after-th in a row, and an outlier stays out of the windows: the
    steps of a divergence are each measured against the steps before it, not against a
    window they have raised.
    """
    rollback = rollback_after > 0
    reason = spike_reason(state.recent_losses, state.recent_grad_norms, result.mean_loss, grad_norm, sigmas, window)
    state.outliers = state.outliers + 1 if reason else 0
    if rollback:
        result.outlier = reason
    else:
        result.skipped = reason
    if not (rollback and reason):
        push(state.recent_losses, result.mean_loss, window)
        push(state.recent_grad_norms, grad_norm, window)
    return bool(result.skipped) or (rollback and state.outliers >= rollback_after)


def _check_divergence(state: TrainState, result: StepResult, rollback_after: int, finite: bool) -> None:
    """Raise Divergence for a non-finite step (finite: whether the gradient norm is), or the rollback_after-th
    outlier in a row (train.rollback)."""
    step = state.step + 1
    if not finite or (result.mean_loss is not None and not math.isfinite(result.mean_loss)):
        raise Divergence(step, step - state.outliers + 1, f"non-finite gradient norm ({result.grad_norm.item()})")
    if state.outliers >= rollback_after:
        raise Divergence(step, step - state.outliers + 1,
                         f"{state.outliers} outliers in a row, the last a {result.outlier}")


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
                                           batch_schedule=t.batch_schedule(), group=stage_group(mesh))
    pipeline = None
    if "pp" in (mesh.mesh_dim_names or ()):
        p = cfg.parallel
        local = t.global_batch_size // dp_mesh(mesh).size()
        dtype = torch.bfloat16 if compute_dtype(t, device) == "bfloat16" else torch.float32
        pipeline = build_pipeline(model, mesh, device, p.pp_schedule,
                                  p.pp_microbatches or default_microbatches(p.pp, local, p.pp_schedule), t.z_loss, dtype)
    return Trainable(cfg, rank, device, mesh, dp_mesh(mesh).size(), model, optimizer, scheduler, TrainState(),
                     pipeline)
