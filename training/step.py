"""The one training step that the loop, the tests and the benchmarks run: forward/backward, clip, update, schedule.

A Trainable is what a step reads and changes on one rank (the sharded model, its optimizer and
LR schedule, the counters, its runner and step hooks); build_trainable makes one from a Config.
The step asks its runner (parallel/runner.py) for the forward and backward, whatever the layout,
and calls its hooks (parallel/hooks.py) at fixed points, whatever the model's features. It needs
no host sync beyond the gradient norm's finiteness check (and the spike guard's global loss when on).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
import torch.distributed as dist

from checkpoint import TrainState
from config import Config, compute_dtype
from model import Transformer
from optimization.optimizers import build_optimizer
from optimization.spike import push, spike_reason
from parallel import distributed
from parallel.hooks import StepHook, model_hooks
from parallel.layout import Mesh
from parallel.parallelize import TPPlan, build_model_of
from parallel.runner import Runner, build_runner


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
                   veto: Callable[[float], bool] | None = None, across_stages=None) -> torch.Tensor:
    """Clip to grad_clip (0: no clipping), step, zero the gradients; returns the pre-clip global norm.

    A non-finite norm never reaches the weights: the gradients are dropped and NonFiniteError
    is raised, or, with skip_nonfinite, the update is skipped and the non-finite norm returned.
    veto(norm): called with a finite pre-clip norm; True drops the gradients instead of the
    update (the spike guard). Checking costs one host sync per step. across_stages: the runner's group of
    the ranks running the model's other stages, None with one (the norm is the whole model's: distributed.grad_norm_).
    """
    norm = distributed.grad_norm_(model.parameters(), grad_clip, device, across_stages)
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

    def global_losses(self, dp_group) -> tuple[float, float]:
        """(mean token cross-entropy, mean logsumexp^2) of the step's global batch (collective over dp_group; syncs)."""
        total = torch.stack([self.loss_sum, self.loss_sum.new_zeros(()) if self.z_sum is None else self.z_sum])
        dist.all_reduce(total, group=dp_group)
        loss, z = (total / self.n_targets).tolist()
        return loss, z

    def global_loss(self, dp_group) -> float:
        """The mean token cross-entropy of the step's global batch (collective over dp_group, the loss ranks'
        (layout.Mesh.loss); syncs)."""
        return self.mean_loss if self.mean_loss is not None else self.global_losses(dp_group)[0]


@dataclasses.dataclass
class Trainable:
    """What a training step reads and changes on one rank: the sharded model, its optimizer and schedule, the counters."""

    cfg: Config
    rank: int
    device: torch.device
    mesh: Mesh
    dp: int
    """Data-parallel ranks (mesh.size("data"))."""
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_state: TrainState
    runner: Runner
    """What runs this rank's part of the model (parallel/runner.py): runner.OneStage, or a pipeline's stages."""
    hooks: list[StepHook]
    """The model features' parts in the step (parallel/hooks.py), called in this order."""


def train_step(s: Trainable, micro_batches, after_backward: Callable[[torch.nn.Module], None] | None = None
               ) -> StepResult:
    """One optimizer step, as the loop runs it: forward/backward, clip, update, LR schedule, counters.

    micro_batches: this rank's [(inputs, labels)] of the step, each (mb, seq_len) int64 (the
    loader's next_step()). after_backward(model): called once the gradients are complete and
    before clipping (tests read them there). The loss is that of the global batch of
    cfg.train.batch_size_at(step) windows of cfg.data.seq_len targets each (runner.OneStage.forward_backward).
    Raises NonFiniteError when the norm is not finite and cfg.train.nonfinite is "stop":
    neither the weights, the schedule nor the counters moved. With "skip", or when the spike
    guard (train.spike_skip, spike.py) finds the loss or the norm an outlier, the update is
    skipped but the step counts (StepResult.skipped says why). With train.rollback on, no
    update is skipped: an outlier is trained through as without the guard (StepResult.outlier
    says why it is one), and a non-finite norm or the train.rollback_after-th outlier in a row
    raise Divergence, with nothing moved but the outlier count; the rollback goes back to
    before the first outlier, so the run is always one without the guard, with data skipped.
    The hooks' auxiliary losses join the objective (a mixture of experts' among them), and each
    hook is called after the backward and after the update, applied or not (its routing biases
    move after an applied one: parallel/hooks.py).
    """
    cfg, t = s.cfg, s.cfg.train
    # Every data-parallel rank holds an equal share of whole windows, and every label is a target (packed).
    n_targets = sum(len(inputs) for inputs, _ in micro_batches) * s.dp * cfg.data.seq_len
    lr = s.scheduler.get_last_lr()[0]
    for hook in s.hooks:
        hook.begin()
    loss_sum, z_sum = s.runner.forward_backward(micro_batches, n_targets, s.hooks)
    for hook in s.hooks:  # a mixture of experts' gradients under TP are complete after its hook
        hook.after_backward()
    if after_backward is not None:
        after_backward(s.model)
    result = StepResult(loss_sum, torch.zeros(()), lr, n_targets, z_sum)
    veto = None
    if t.spike_skip:
        result.mean_loss = result.global_loss(s.mesh.loss.get_group())
        veto = functools.partial(_spike_veto, s.train_state, result, t.spike_skip, t.spike_window,
                                 t.rollback_after if t.rollback else 0)
    try:
        result.grad_norm = optimizer_step(s.model, s.optimizer, cfg.optim.grad_clip, s.device,
                                          t.nonfinite == "skip" or t.rollback > 0, veto, s.runner.across_stages)
    except NonFiniteError as e:
        ranks = s.mesh.size("loss")
        raise NonFiniteError(f"{e} (loss {loss_sum.item() / n_targets * ranks:.4g} on rank {s.rank})") from None
    finite = bool(torch.isfinite(result.grad_norm).item())
    if not result.skipped and not finite:
        result.skipped = "non-finite gradient norm"
        s.train_state.outliers += 1
    if t.rollback:
        _check_divergence(s.train_state, result, t.rollback_after, finite)
    for hook in s.hooks:
        hook.after_update(not result.skipped)
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


def build_trainable(cfg: Config, rank: int, mesh: Mesh, device: torch.device, tp_plan: TPPlan | None = None,
                    model: torch.nn.Module | None = None) -> Trainable:
    """The sharded model (parallelize.build_model, from cfg.train.seed), optimizer, LR schedule, a fresh TrainState,
    the runner and the step hooks.

    model: an already parallelized and initialised model to use instead (benchmarks time
    another model source with the same step). Collective when it builds the model.
    """
    t = cfg.train
    dtype = compute_dtype(t, device)
    if model is None:
        model = build_model_of(cfg, mesh, device, dtype, tp_plan)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.steps, fused=not cfg.parallel.cpu_offload,
                                           batch_schedule=t.batch_schedule(), group=mesh.same_params)
    runner = build_runner(model, mesh, cfg, device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    return Trainable(cfg, rank, device, mesh, mesh.size("data"), model, optimizer, scheduler, TrainState(), runner,
                     model_hooks(cfg, model, mesh, device, optimizer))
