"""Pipeline parallelism (``parallel.pp``): the blocks split into pp stages, micro-batches run by torch.distributed.pipelining.

Each rank of a "pp" group (the mesh's outermost dimension, parallelize.build_mesh) holds one
stage: the Transformer is built whole on the meta device and pruned (``prune``) before any
other wrapping. The first stage keeps the embedding, the last the final norm and the output
projection, and each keeps its own contiguous blocks; the other blocks become PassThrough
modules without parameters. Names stay the full model's (``layers.7.attention.wq.weight``),
so a DCP checkpoint written at one pp loads at any other. With n_layers = q pp + r, the first
r stages hold q + 1 blocks and the others q (``stage_layers``).

The schedule is PyTorch's own (``torch.distributed.pipelining``): each data-parallel rank's
share of the step's batch is split into parallel.pp_microbatches micro-batches, and the last
stage takes the loss of each (``Pipeline.loss``): the summed token cross-entropy (plus the
z-loss term) times the same factor dp / global targets as without PP, with the schedule's
own gradient scaling off, so the gradients are exactly those of one process. Each stage is
FSDP-sharded over its data-parallel ranks as a whole model is; the stage reduces its
gradients once per step (the schedule drives FSDP's gradient sync). Validation runs the
stages one after another on the whole batch (``Pipeline.forward_loss``).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from core.errors import SetupError
from model import Transformer
from nn.loss import logits_loss_sums

SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
"""The schedules run here, by torch.distributed.pipelining's names: one stage per rank."""
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch.distributed.pipelining's schedules with several stages per rank: refused until built (docs/pipeline.md)."""


def check_pp(pp: int, schedule: str, microbatches: int, n_layers: int, local_batch: int, dp: int = 1,
             micro_batch_size: int = 1) -> None:
    """The PP checks that need no collective; raises SetupError naming the numbers and the fix.

    pp stages need at least one block each; the schedule must be one of SCHEDULES; the
    micro-batches must be at least pp (fewer leave a stage idle for the whole step; 1F1B needs
    them) and divide local_batch, the sequences each data-parallel rank runs per step; a
    local_batch below pp is refused naming train.global_batch_size (dp data-parallel ranks, the
    loader's train.micro_batch_size sequences at a time) and the smallest batch that works.
    """
    if pp == 1:
        return
    given, microbatches = microbatches, microbatches or default_microbatches(pp, local_batch)
    if schedule in MULTI_STAGE:
        raise SetupError(f"parallel.pp_schedule {schedule} runs several stages per rank, which is not built yet "
                         f"(docs/pipeline.md); use one of {', '.join(SCHEDULES)}")
    if schedule not in SCHEDULES:
        raise SetupError(f"parallel.pp_schedule {schedule!r} is not a schedule here; use one of "
                         f"{', '.join(SCHEDULES)} (torch.distributed.pipelining's names)")
    if pp > n_layers:
        raise SetupError(f"parallel.pp ({pp}) is more than model.n_layers ({n_layers}): every stage needs a block; "
                         f"use parallel.pp <= {n_layers}")
    if microbatches < pp:
        raise SetupError(f"parallel.pp_microbatches ({microbatches}) is fewer than parallel.pp ({pp}): a stage would "
                         f"wait the whole step; use parallel.pp_microbatches >= {pp} (4 x pp keeps the bubble small)")
    if local_batch < pp:
        fit = math.lcm(given or pp, micro_batch_size) * dp
        raise SetupError(f"train.global_batch_size gives each data-parallel rank {local_batch} sequence(s) per step, "
                         f"fewer than parallel.pp ({pp}): every stage needs a micro-batch; use "
                         f"train.global_batch_size {fit} or a multiple of it")
    if local_batch % microbatches:
        fits = [m for m in range(pp, local_batch + 1) if local_batch % m == 0]
        raise SetupError(f"parallel.pp_microbatches ({microbatches}) does not divide the {local_batch} sequences each "
                         f"data-parallel rank runs per step; use one of {fits} or change train.global_batch_size")


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The blocks of stage (0-based) of pp: contiguous, the first n_layers % pp stages one block more."""
    q, r = divmod(n_layers, pp)
    start = stage * q + min(stage, r)
    return range(start, start + q + (stage < r))


class PassThrough(nn.Module):
    """A block another stage holds: returns the residual stream unchanged, holds no parameters."""

    def forward(self, h: Tensor, *args, **kwargs) -> Tensor:
        return h


def prune(model: Transformer, stage: int, pp: int) -> None:
    """Keep only stage's part of model (on the meta device, before any wrapping): see the module docstring."""
    keep = stage_layers(len(model.layers), pp, stage)
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = PassThrough()
    if stage > 0:
        model.tok_embeddings = None
    if stage < pp - 1:
        model.norm = None
        model.output = None


@dataclasses.dataclass
class Pipeline:
    """This rank's stage and its schedule; the loss of the last stage is kept in ce_sum and z_sum."""

    model: Transformer
    schedule: object
    group: dist.ProcessGroup
    stage: int
    n_stages: int
    z_loss: float = 0.0
    act_dtype: torch.dtype = torch.float32
    """The dtype of the residual stream stages pass on: the blocks' compute dtype (bf16 under mixed precision)."""
    n_microbatches: int = 1
    scale: float = 1.0
    """The loss's factor for the step: data-parallel ranks / the global batch's targets (training/step.py)."""
    sums: list = dataclasses.field(default_factory=list)
    """(cross-entropy sum, logsumexp^2 sum) of each loss_fn call of the step, detached."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The schedule's loss_fn on the last stage: logits (mb, seq, vocab) fp32, labels (mb, seq) -> the objective
        of the micro-batch times scale; its token cross-entropy and logsumexp^2 sums are appended to sums."""
        objective, z_sum = logits_loss_sums(logits, labels, self.z_loss)
        # The cross-entropy as training/step.py's forward_backward logs it: the objective less the z term.
        self.sums.append(torch.stack([objective.detach() - self.z_loss * z_sum, z_sum]))
        return objective * self.scale

    def forward_backward(self, micro_batches, n_targets: int, dp_size: int, device) -> tuple[Tensor, Tensor]:
        """training/step.forward_backward under PP: this data-parallel rank's micro-batches joined, run through the
        schedule. Returns (summed token cross-entropy, summed logsumexp^2) of this data-parallel rank's batch on
        every stage (collective over the pp group)."""
        inputs = torch.cat([i for i, _ in micro_batches]).to(device, non_blocking=True)
        labels = torch.cat([t for _, t in micro_batches]).to(device, non_blocking=True)
        self.scale, self.sums = dp_size / n_targets, []
        if self.is_first:
            self.schedule.step(inputs, target=labels if self.is_last else None)
        elif self.is_last:
            self.schedule.step(target=labels)
        else:
            self.schedule.step()
        # The first step's schedule also calls loss_fn to infer the shapes of the gradients: the micro-batches'
        # calls are the last n_microbatches.
        mine = self.sums[-self.n_microbatches:] if self.is_last else []
        sums = torch.stack(mine).sum(0) if mine else torch.zeros(2, device=device)
        dist.all_reduce(sums, group=self.group)  # the last stage's, on every stage
        return sums[0], sums[1]

    @torch.no_grad()
    def forward_loss(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """Summed token cross-entropy of a batch (batch, seq), fp32 0-dim: on the last stage, 0 on the others.

        Forward only, the whole batch at once, stage after stage (point-to-point over the pp group).
        """
        h = inputs
        if not self.is_first:
            h = torch.empty(*inputs.shape, self.model.args.dim, dtype=self.act_dtype, device=inputs.device)
            dist.recv(h, group=self.group, group_src=self.stage - 1)
        out = self.model(h)
        if not self.is_last:
            dist.send(out.contiguous(), group=self.group, group_dst=self.stage + 1)
            return torch.zeros((), device=inputs.device)
        return logits_loss_sums(out, labels).objective


def default_microbatches(pp: int, local_batch: int) -> int:
    """parallel.pp_microbatches 0: the largest divisor of local_batch up to 4 pp (pp itself when none is >= pp)."""
    return max([m for m in range(1, min(4 * pp, local_batch) + 1) if local_batch % m == 0 and m >= pp] or [pp])


def build_pipeline(model: Transformer, pp_mesh: DeviceMesh, device: torch.device, schedule: str,
                   microbatches: int, z_loss: float, act_dtype: torch.dtype) -> Pipeline:
    """The Pipeline of model (pruned to this rank's stage and parallelized) over pp_mesh (1-D, "pp")."""
    stage, n = pp_mesh.get_local_rank(), pp_mesh.size()
    group = pp_mesh.get_group()
    pipe = Pipeline(model, None, group, stage, n, z_loss, act_dtype, microbatches)
    pipeline_stage = PipelineStage(model, stage, n, device, group=group)
    # loss_fn on every stage: the schedule runs a backward only when it has one (only the last calls it)
    pipe.schedule = SCHEDULES[schedule](pipeline_stage, microbatches, loss_fn=pipe.loss,
                                        scale_grads=False)
    return pipe
