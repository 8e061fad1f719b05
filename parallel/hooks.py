"""Step hooks: how a model feature takes part in the training step without the step knowing it.

The step (training/step.py) and both runners (runner.OneStage, pipeline.Pipeline) call every
hook at the same points, so a feature's accounting has one path whatever the layout:
  begin           before the step's first forward
  measure/add     after each micro-batch's forward of a module (the whole model, or a pipeline
                  stage): what the feature counts, and an auxiliary loss that joins the objective
  after_backward  once the step's gradients are complete
  after_update    after the optimizer step (applied: whether the update was)
  record          the train record's fields (collective; syncs)
A mixture of experts counts tokens per expert, adds its aux losses and moves its routing biases
(MoEHook); tensorwise float8 refreshes the weights' scales after each update (Float8Hook).
torchtitan does the same with an optimizer hook and a post-step hook.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nn.moe import moe_layers
from parallel import float8
from parallel.accounting import account_step
from parallel.layout import Mesh
from parallel.moe_sequence import reduce_over_tp


class StepHook:
    """A feature's part in the step; every method does nothing unless the feature overrides it."""

    def begin(self) -> None:
        """Before the step's first forward."""

    def measure(self, module: nn.Module) -> tuple[object, Tensor | None]:
        """(what module's last forward left to count, or None; its auxiliary loss with autograd, or None).

        The runner passes the first to add once the forward counts (a pipeline's shape inference
        runs a forward that does not), and adds the second, scaled as the loss, to the objective.
        """
        return None, None

    def add(self, record: object) -> None:
        """Count a measure's record in the step's totals."""

    def after_backward(self) -> None:
        """Once the step's gradients are complete (before clipping)."""

    def after_update(self, applied: bool) -> None:
        """After the optimizer step; applied: whether the update was (not skipped)."""

    def record(self, n_targets: int) -> dict:
        """The train record's fields of the last step (collective; syncs). n_targets: its global targets."""
        return {}


def aux_of(hooks: list[StepHook], module: nn.Module, records: list | None = None) -> Tensor | None:
    """The hooks' auxiliary losses of module's last forward, summed (with autograd; None if none). Each hook's
    record is added now, or appended to records as (hook, record) when given (a pipeline adds them later)."""
    aux = None
    for hook in hooks:
        record, loss = hook.measure(module)
        if record is not None:
            if records is None:
                hook.add(record)
            else:
                records.append((hook, record))
        if loss is not None:
            aux = loss if aux is None else aux + loss
    return aux


class MoEHook(StepHook):
    """A mixture of experts' part: each step's token counts per expert and aux losses (device tensors, no host sync),
    reduced over the ranks of distinct tokens after backward (with the MoE gradients over TP), and DeepSeek-V3's bias
    update after an applied update."""

    def __init__(self, model: nn.Module, mesh: Mesh, device, n_experts: int, aux_on: bool, bias_rate: float):
        self.model, self.layers = model, moe_layers(model)
        """This rank's MoE layers (a pipeline stage's; none on a stage without one)."""
        self.mesh, self.device, self.n_experts = mesh, device, n_experts
        self.aux_on = aux_on
        """Whether the model has an aux or router z-loss (model.moe_aux_loss, model.moe_router_z_loss)."""
        self.bias_rate = bias_rate
        self.begin()

    def begin(self) -> None:
        self.counts = torch.zeros(len(self.layers), self.n_experts, dtype=torch.int64, device=self.device)
        """(MoE layers, n_experts) int64: tokens routed to each expert; after_backward: the global batch's."""
        self.aux_sum = torch.zeros((), device=self.device)
        """0-dim fp32: this rank's sum of the layers' aux_loss (coefficients applied; a token sum, see nn/moe.py)."""

    def measure(self, module: nn.Module) -> tuple[object, Tensor | None]:
        layers = moe_layers(module)
        if not layers:
            return None, None
        losses = [m.aux_loss for m in layers if m.aux_loss is not None]
        aux = torch.stack(losses).sum() if losses else None
        rows = [self.layers.index(m) for m in layers]
        return (rows, torch.stack([m.counts for m in layers]), None if aux is None else aux.detach()), aux

    def add(self, record: object) -> None:
        rows, counts, aux = record
        self.counts[rows] += counts
        if aux is not None:
            self.aux_sum += aux

    def after_backward(self) -> None:
        """Sum the counts over the ranks holding their own tokens (the loss ranks, and the TP ranks, which route
        their share of the sequence: parallel/moe_sequence.py): every rank then holds the global batch's. Under TP,
        also sum the MoE parameters' gradients over the TP group."""
        if not self.layers:  # a pipeline stage without MoE layers: so are its data-parallel peers
            return
        for group in self._token_groups():
            dist.all_reduce(self.counts, group=group)
        if self.mesh.tp is not None:
            reduce_over_tp(self.model, self.mesh.tp.get_group(), self.device, "tp" not in self.mesh.layout.ep_takes)

    def _token_groups(self) -> list:
        """The process groups over which per-token sums add up to the global batch's: the loss ranks, then TP."""
        return [self.mesh.loss.get_group()] + ([self.mesh.tp.get_group()] if self.mesh.tp is not None else [])

    def after_update(self, applied: bool) -> None:
        """DeepSeek-V3's aux-loss-free update after an applied update: each expert's bias += rate * sign(mean load -
        its load), from the global counts, so the bias is the same on every rank and at every layout."""
        if not (applied and self.bias_rate):
            return
        with torch.no_grad():
            for layer, c in zip(self.layers, self.counts.float()):
                layer.expert_bias.add_(torch.sign(c.mean() - c), alpha=self.bias_rate)

    def record(self, n_targets: int) -> dict:
        """moe_max_load (the busiest expert's tokens over the mean per expert, the largest over the MoE layers),
        moe_bias_range (largest minus smallest bias over all layers), and moe_aux_loss (the aux and z losses as
        added to the objective, per token) when on; over every stage's layers under pipeline parallelism."""
        c = self.counts.float()
        bias = torch.cat([m.expert_bias for m in self.layers] or [c.new_zeros(0)])
        # [max load, max bias, -min bias]: one reduction over the stages
        top = torch.stack([(c.max(1).values / c.mean(1).clamp(min=1e-9)).max() if len(c) else c.new_zeros(()),
                           bias.max() if len(bias) else c.new_full((), -math.inf),
                           -bias.min() if len(bias) else c.new_full((), -math.inf)])
        aux = self.aux_sum.clone()
        stages = self.mesh.pp.get_group() if self.mesh.pp is not None else None
        if stages is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=stages)
        out = {"moe_max_load": top[0].item(), "moe_bias_range": (top[1] + top[2]).item()}
        if self.aux_on:
            for group in self._token_groups():
                dist.all_reduce(aux, group=group)
            if stages is not None:
                dist.all_reduce(aux, group=stages)
            out["moe_aux_loss"] = aux.item() / n_targets
        return out


class Float8Hook(StepHook):
    """Tensorwise float8: the next step's float8 all-gathers use the updated weights' scales, computed once for all."""

    def __init__(self, model: nn.Module):
        self.model = model

    def after_update(self, applied: bool) -> None:
        float8.precompute_scales(self.model)


class PeakMemoryHook(StepHook):
    """The steps' peak memory on each rank, for the train record: `peak_bytes` (this rank's, rank 0's in the
    record) and `peak_bytes_max` (the largest over the ranks).

    On CUDA torch.cuda.max_memory_allocated: the allocator's peak since the run started, which its
    steps reach (not reset per step: the record's peak_mem_gib and the last line read the same
    counter). On CPU, where no allocator keeps one, the planner's accounting of every tensor of
    the last step (accounting.account_step, memory only): what plan.py predicts, measured alike.
    """

    def __init__(self, model: nn.Module, optimizer, device):
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.tracking: contextlib.ExitStack | None = None
        self.account = None
        self.peak = 0

    def begin(self) -> None:
        self.end()  # a step that raised before its update left its tracker open
        if self.device.type != "cuda":
            self.tracking = contextlib.ExitStack()
            self.account = self.tracking.enter_context(account_step(self.model, self.optimizer, count_comm=False))

    def end(self) -> None:
        if self.tracking is not None:
            self.tracking.close()
            self.tracking = None
            self.peak = self.account.peak_bytes

    def after_update(self, applied: bool) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        self.end()

    def record(self, n_targets: int) -> dict:
        peak = torch.tensor([self.peak], dtype=torch.int64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"peak_bytes": self.peak, "peak_bytes_max": int(peak.item())}


def model_hooks(cfg, model: nn.Module, mesh: Mesh, device, optimizer=None) -> list[StepHook]:
    """The hooks cfg's model features need on this rank (cfg: a config.Config, duck-typed: this module sits below
    config.py); [] for a dense model in bf16 or fp32 on CPU without train.track_memory. optimizer: the model's
    (the peak memory's accounting counts its state; PeakMemoryHook on CUDA, or on CPU with train.track_memory)."""
    m, hooks = cfg.model, []
    if optimizer is not None and (torch.device(device).type == "cuda" or cfg.train.track_memory):
        hooks.append(PeakMemoryHook(model, optimizer, device))
    if m.n_experts:  # on every stage: one without MoE layers still joins the record's reductions
        layers = moe_layers(model)
        aux_on = any(x.aux_coef or x.z_coef for x in layers) or bool(m.moe_aux_loss or m.moe_router_z_loss)
        hooks.append(MoEHook(model, mesh, device, m.n_experts, aux_on, m.moe_bias_update_rate))
    if cfg.train.float8 == "tensorwise":
        hooks.append(Float8Hook(model))
    return hooks
