"""Pipeline parallelism (``parallel.pp``): the blocks split into stages, micro-batches run by torch.distributed.pipelining.

Which blocks each stage holds and which stages a rank runs: pipeline_stages.py (each rank
builds the whole model on the meta device and prunes it to its stages, so names stay the full
model's). The pipeline group is the mesh's outermost dimension (layout.Layout).

The schedule is PyTorch's own (``torch.distributed.pipelining``): each data-parallel rank's
share of the step's batch is split into parallel.pp_microbatches micro-batches, and the last
stage takes the loss of each (``Pipeline.loss``): the summed token cross-entropy (plus the
z-loss term) times the same factor dp / global targets as without PP, with the schedule's
own gradient scaling off, so the gradients are exactly those of one process. Each stage is
FSDP-sharded over its data-parallel ranks as a whole model is, as its own FSDP root; the
schedule drives FSDP's gradient sync (once per step). Validation runs the stages one after
another on the whole batch (``Pipeline.forward_loss``). A Pipeline is a runner (runner.py): the
step, validation and scoring ask it what they ask of runner.OneStage at pp 1.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from core.errors import SetupError
from model import Transformer
from nn.documents import SequenceLayout, slice_layout
from nn.loss import ChunkedLossHead, logits_loss_sums, loss_context, nll_head
from parallel.context_parallel import shard_batch
from parallel.hooks import StepHook, aux_of
from parallel.layout import Mesh
from parallel.pipeline_stages import (
    MULTI_STAGE,
    SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    rank_stages,
    stage_modules,
    stages_per_rank,
)

# The schedule splits keyword inputs into micro-batches by the tensors they hold: a CP slice's positions (batch,
# slice) split along the batch like the tokens.
pytree.register_dataclass(SequenceLayout)
# Under the chunked loss the last stage takes its micro-batch's labels in its head, split with the batch likewise.
pytree.register_dataclass(ChunkedLossHead)


def check_pp(pp: int, schedule: str, microbatches: int, n_layers: int, local_batch: int, dp: int = 1,
             micro_batch_size: int = 1, per_rank: int = 0) -> None:
    """The PP checks that need no collective; raises SetupError naming the numbers and the fix.

    The schedule must be one of SCHEDULES (checked at pp 1 too), with per_rank
    (parallel.pp_stages_per_rank, 0: its default) stages per rank: 1 for 1F1B and GPipe, exactly
    2 for the V_SHAPED ones, >= 2 for the others; pp x per_rank stages need a block each.
    microbatches (0: default_microbatches) must be one of microbatch_choices: at least pp (at
    least 2 pp for DualPipeV), for the interleaved schedules divisible by their rounds, and
    dividing local_batch, the sequences each data-parallel rank runs per step. Every remedy
    offers only counts that pass all of these; when none does, the refusal names
    train.global_batch_size (dp data-parallel ranks, the loader's train.micro_batch_size
    sequences at a time) and the smallest batch that works.
    """
    if schedule not in SCHEDULES:
        near = [s for s in SCHEDULES if s.lower() == schedule.lower()] or difflib.get_close_matches(schedule, SCHEDULES, 1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SetupError(f"parallel.pp_schedule {schedule!r} is not a schedule here; {hint}use one of "
                         f"{', '.join(SCHEDULES)} (torch.distributed.pipelining's names)")
    if pp == 1:
        return
    v = stages_per_rank(schedule, per_rank)
    if schedule in V_SHAPED and v != 2:
        raise SetupError(f"parallel.pp_schedule {schedule} runs exactly 2 stages per rank, and "
                         f"parallel.pp_stages_per_rank is {v}; use parallel.pp_stages_per_rank 2 (or 0)")
    if schedule in SINGLE_STAGE and v != 1:
        raise SetupError(f"parallel.pp_schedule {schedule} runs one stage per rank, and parallel.pp_stages_per_rank "
                         f"is {v}; use parallel.pp_stages_per_rank 1 (or 0), or Interleaved1F1B for several")
    if schedule in MULTI_STAGE and v < 2:
        raise SetupError(f"parallel.pp_schedule {schedule} runs 2 or more stages per rank, and "
                         f"parallel.pp_stages_per_rank is {v}; use parallel.pp_stages_per_rank 2 (or 0)")
    if pp * v > n_layers:
        what = f"parallel.pp ({pp})" if v == 1 else f"parallel.pp x parallel.pp_stages_per_rank ({pp} x {v})"
        fixes = [f"parallel.pp <= {n_layers}"] if v == 1 else [f"model.n_layers {pp * v} or more"]
        if v > 1 and n_layers // v >= 2:
            fixes.append(f"parallel.pp {n_layers // v}")
        if v > 1 and schedule not in V_SHAPED and n_layers // pp >= 2:
            fixes.append(f"parallel.pp_stages_per_rank {n_layers // pp}")
        raise SetupError(f"{what} is more than model.n_layers ({n_layers}): every stage needs a block; use "
                         f"{', or '.join(fixes)}")
    fits = microbatch_choices(pp, schedule, local_batch)
    if not fits:
        least = min_microbatches(pp, schedule)
        need = f"parallel.pp ({pp})" if least == pp else f"the {least} micro-batches {schedule} needs (2 x parallel.pp)"
        fit = math.lcm(microbatches if microbatch_ok(microbatches, pp, schedule) else least, micro_batch_size) * dp
        why = (f"fewer than {need}: every stage needs a micro-batch" if local_batch < least else
               f"and {schedule} takes none of its divisors as the count of micro-batches")
        raise SetupError(f"train.global_batch_size gives each data-parallel rank {local_batch} sequence(s) per step, "
                         f"{why}; use train.global_batch_size {fit} or a multiple of it")
    if not microbatches or microbatches in fits:
        return
    use = f"use parallel.pp_microbatches in {fits}"
    if microbatches < pp:
        raise SetupError(f"parallel.pp_microbatches ({microbatches}) is fewer than parallel.pp ({pp}): a stage would "
                         f"wait the whole step; {use} (4 x pp keeps the bubble small)")
    if microbatches < min_microbatches(pp, schedule):
        raise SetupError(f"parallel.pp_schedule DualPipeV needs at least as many micro-batches as stages (2 x "
                         f"parallel.pp = {2 * pp}), and parallel.pp_microbatches is {microbatches}; {use}")
    if not microbatch_ok(microbatches, pp, schedule):
        rounds = microbatches // pp
        raise SetupError(f"parallel.pp_schedule {schedule} runs the micro-batches in rounds (parallel.pp_microbatches "
                         f"// parallel.pp = {rounds}), which must divide parallel.pp_microbatches ({microbatches}); "
                         f"{use}")
    raise SetupError(f"parallel.pp_microbatches ({microbatches}) does not divide the {local_batch} sequences each "
                     f"data-parallel rank runs per step; {use} or change train.global_batch_size")


def min_microbatches(pp: int, schedule: str) -> int:
    """The fewest micro-batches schedule runs at pp stages (or ranks): pp, 2 pp for DualPipeV (one per stage)."""
    return 2 * pp if schedule == "DualPipeV" else pp


def microbatch_ok(m: int, pp: int, schedule: str) -> bool:
    """Whether schedule takes m micro-batches at pp: at least min_microbatches, and for the interleaved schedules
    divisible by their rounds, m // pp (torch's check)."""
    if m < min_microbatches(pp, schedule):
        return False
    return schedule not in ("Interleaved1F1B", "InterleavedZeroBubble") or m % (m // pp) == 0


def microbatch_choices(pp: int, schedule: str, local_batch: int) -> list[int]:
    """The micro-batch counts, ascending, that schedule takes at pp and that divide local_batch (the sequences each
    data-parallel rank runs per step)."""
    return [m for m in range(1, local_batch + 1) if local_batch % m == 0 and microbatch_ok(m, pp, schedule)]


@dataclasses.dataclass
class Pipeline:
    """This rank's stages and their schedule, a runner (runner.py); the last stage's loss sums of the step are kept
    in sums."""

    model: Transformer
    schedule: object
    mesh: Mesh
    device: torch.device
    schedule_name: str
    """parallel.pp_schedule."""
    stages: list[tuple[int, nn.Module]]
    """(stage index, module) of each stage this rank runs, ascending (pipeline_stages.stage_modules)."""
    n_stages: int
    z_loss: float = 0.0
    act_dtype: torch.dtype = torch.float32
    """The dtype of the residual stream stages pass on: the blocks' compute dtype (bf16 under mixed precision)."""
    n_microbatches: int = 1
    stage_rank: dict = dataclasses.field(default_factory=dict)
    """Stage index -> the pipeline rank that runs it."""
    loss_chunk_size: int = 0
    """train.loss_chunk_size as applied (0 under TP): the last stage then takes the loss in its forward, chunk by
    chunk (nn.loss.ChunkedLossHead), and never holds a micro-batch's logits."""
    scale: float = 1.0
    """The loss's factor for the step: data-parallel ranks / the global batch's targets (training/step.py)."""
    sums: list = dataclasses.field(default_factory=list)
    """(cross-entropy sum, logsumexp^2 sum) of each loss_fn call of the step, detached."""

    @property
    def across_stages(self) -> dist.ProcessGroup:
        """The pipeline's group: one rank per stage (layout.Mesh.pp)."""
        return self.mesh.pp.get_group()

    @property
    def seq_split(self) -> int:
        """The parts the sequence is split into between stages (tp under sequence parallelism)."""
        return self.mesh.size("tp")

    @property
    def vocab_parallel(self) -> bool:
        """Whether the logits are vocabulary-sharded (TP): the loss and its backward then run under loss_parallel."""
        return self.mesh.tp is not None

    @property
    def context(self) -> Callable:
        """The context the loss and its backward run in (nn.loss.loss_context)."""
        return loss_context(self.vocab_parallel)

    @property
    def modules(self) -> list[nn.Module]:
        """The FSDP roots this rank runs: the model and its stages' modules (one stage is the model)."""
        return [self.model] + [m for _, m in self.stages]

    @property
    def holds_loss(self) -> bool:
        """Whether this rank runs the last stage: its loss sums are the ones that count."""
        return self.is_last

    def sum_over_stages(self, t: Tensor) -> None:
        """t summed over the pipeline's ranks, in place (the last stage's sums, on every stage)."""
        dist.all_reduce(t, group=self.across_stages)

    def describe(self) -> str:
        """' | pipeline ...' for the start-up line: the schedule, its micro-batches and the stages per rank."""
        return (f" | pipeline {self.schedule_name}, {self.n_microbatches} micro-batches per data-parallel rank, "
                f"{len(self.stages)} of {self.n_stages} stages per rank")

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (it feeds the tokens)."""
        return self.stages[0][0] == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it takes the loss)."""
        return self.stages[-1][0] == self.n_stages - 1

    def loss(self, output: Tensor, labels: Tensor) -> Tensor:
        """The schedule's loss_fn on the last stage: output, the logits (mb, seq, vocab) fp32 (or under the chunked
        loss the stage's own (2,) sums, ChunkedLossHead's), labels (mb, seq) -> the objective of the micro-batch times
        scale; its token cross-entropy and logsumexp^2 sums are appended to sums."""
        if self.loss_chunk_size:
            objective, z_sum = output[0], output[1].detach()
        else:
            objective, z_sum = logits_loss_sums(output, labels, self.z_loss)
        # The cross-entropy as training/step.py's forward_backward logs it: the objective less the z term.
        self.sums.append(torch.stack([objective.detach() - self.z_loss * z_sum, z_sum]))
        return objective * self.scale

    def forward_backward(self, micro_batches, n_targets: int, hooks: list[StepHook] = ()) -> tuple[Tensor, Tensor]:
        """runner.OneStage.forward_backward under PP: this data-parallel rank's micro-batches joined (under CP, this
        rank's slice of them: context_parallel.shard_batch), run through the schedule. Returns (summed token
        cross-entropy, summed logsumexp^2) of this rank's part of the batch on every stage (collective over the
        pipeline's group). hooks: measured after each micro-batch's forward of each stage (see aux_hook)."""
        device = self.device
        inputs = torch.cat([i for i, _ in micro_batches]).to(device, non_blocking=True)
        labels = torch.cat([t for _, t in micro_batches]).to(device, non_blocking=True)
        inputs, labels, layout = shard_batch(self.model, inputs, labels, self.mesh.cp)
        layout = self.documents(inputs, layout)
        self.scale, self.sums = self.mesh.size("loss") / n_targets, []
        args = (inputs,) if self.is_first else ()
        # Every stage's blocks take the RoPE positions (and documents); the schedule splits them with the batch.
        kwargs = {"layout": layout} if layout is not None else {}
        if self.loss_chunk_size:
            kwargs["head"] = ChunkedLossHead(labels, self.loss_chunk_size, self.z_loss)
        records: list = []
        handles = [module.register_forward_hook(functools.partial(self.aux_hook, hooks, records, index))
                   for index, module in self.stages] if hooks else []
        try:
            with self.context():
                self.schedule.step(*args, target=labels if self.is_last else None, return_outputs=False, **kwargs)
        finally:
            for h in handles:
                h.remove()
        # The first step's schedule also runs a forward to infer the shapes: each stage's last n_microbatches count.
        for index, _ in self.stages:
            for hook, record in [(h, r) for i, h, r in records if i == index][-self.n_microbatches:]:
                hook.add(record)
        # The first step's schedule also calls loss_fn to infer the shapes of the gradients: the micro-batches'
        # calls are the last n_microbatches.
        mine = self.sums[-self.n_microbatches:] if self.is_last else []
        sums = torch.stack(mine).sum(0) if mine else torch.zeros(2, device=device)
        self.sum_over_stages(sums)  # the last stage's, on every stage
        return sums[0], sums[1]

    def aux_hook(self, hooks: list[StepHook], records: list, index: int, module: nn.Module, args, output: Tensor
                 ) -> Tensor:
        """A forward hook on stage index's module: the step hooks' records of the micro-batch just run, appended to
        records as (index, hook, record); their auxiliary losses' gradient joins the stage output's backward
        (_WithAux), scaled as the loss (the stages after the first cannot add them to the loss the last stage takes)."""
        mine: list = []
        aux = aux_of(hooks, module, mine)
        records.extend((index, hook, record) for hook, record in mine)
        return output if aux is None else _WithAux.apply(output, aux * self.scale)

    def documents(self, inputs: Tensor, layout: SequenceLayout | None) -> SequenceLayout | None:
        """layout, or under model.document_mask without CP the whole windows' (nn/documents.slice_layout of inputs
        (batch, seq) int64): the stages after the first see no tokens to find the documents in."""
        args = self.model.args
        if layout is None and args.document_mask:
            return slice_layout(inputs, 0, inputs.shape[1], True, args.eot_id)
        return layout

    @torch.no_grad()
    def run(self, inputs: Tensor, layout: SequenceLayout | None = None, head=None) -> Tensor | None:
        """The last stage's output (fp32 logits, or head(output, h) as Transformer.forward takes head) of a batch
        (batch, seq) of tokens, on the rank that runs the last stage; None on the others.

        Forward only, the whole batch at once, stage after stage: each rank runs its stages in
        order, receiving from the previous stage's rank and sending to the next one's (point to
        point over the pp group; stages on the same rank hand over directly). layout: under CP,
        the slice's (context_parallel.shard_batch); under the document mask it is found here.
        """
        h, layout = inputs, self.documents(inputs, layout)
        for index, module in self.stages:
            if index > 0 and self.stage_rank[index - 1] != self.stage_rank[index]:
                b, t = inputs.shape
                h = torch.empty(b, t // self.seq_split, self.model.args.dim, dtype=self.act_dtype, device=inputs.device)
                dist.recv(h, group=self.across_stages, group_src=self.stage_rank[index - 1])
            last = index == self.n_stages - 1
            h = module(h, layout=layout, head=head) if last else module(h, layout=layout)
            if not last and self.stage_rank[index + 1] != self.stage_rank[index]:
                dist.send(h.contiguous(), group=self.across_stages, group_dst=self.stage_rank[index + 1])
        return h if self.is_last else None

    def forward_loss(self, inputs: Tensor, labels: Tensor, layout: SequenceLayout | None = None) -> Tensor:
        """Summed token cross-entropy of a batch (batch, seq), fp32 0-dim: on the last stage's rank, 0 on the others
        (run)."""
        with self.context():
            if self.loss_chunk_size:
                sums = self.run(inputs, layout, head=ChunkedLossHead(labels, self.loss_chunk_size))
                return sums[0] if sums is not None else torch.zeros((), device=inputs.device)
            logits = self.run(inputs, layout)
            if logits is None:
                return torch.zeros((), device=inputs.device)
            return logits_loss_sums(logits, labels).objective

    def token_logprobs(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """nn.loss.token_logprobs through the stages: (batch, seq) fp32 on every rank (collective over the pipeline's
        group)."""
        with self.context():
            nll = self.run(inputs, head=nll_head(targets, self.vocab_parallel))
        logp = -nll if nll is not None else torch.zeros(targets.shape, device=targets.device)
        self.sum_over_stages(logp)  # the last stage's, on every stage
        return logp


class _WithAux(torch.autograd.Function):
    """The identity on a stage's output that gives aux (a 0-dim loss term of the stage's layers) a gradient of 1
    when the output's backward runs (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: Tensor, aux: Tensor) -> Tensor:
        ctx.save_for_backward(aux)
        # A copy, not output itself (which autograd would make a view of it): the zero-bubble schedules detach the
        # stage's output in place after its input-gradient pass, which a view refuses.
        return output.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def default_microbatches(pp: int, local_batch: int, schedule: str = "1F1B") -> int:
    """parallel.pp_microbatches 0: the largest of microbatch_choices up to 4 pp (the smallest when none is), or
    min_microbatches when there is none (check_pp then refuses the batch)."""
    fits = microbatch_choices(pp, schedule, local_batch)
    return max([m for m in fits if m <= 4 * pp] or fits[:1] or [min_microbatches(pp, schedule)])


def build_pipeline(model: Transformer, mesh: Mesh, device: torch.device, schedule: str,
                   microbatches: int, z_loss: float, act_dtype: torch.dtype, loss_chunk_size: int = 0) -> Pipeline:
    """The Pipeline of model (pruned to this rank's stages and parallelized) over the pipeline's group, mesh.pp.

    Under TP the stages pass on this rank's part of the sequence (sequence parallelism), and the
    loss and its backward run under loss_parallel (nn.loss.loss_context).
    """
    # Imported here, not at the top: it loads torch._dynamo (0.6 s), which hf.py and generate.py never need.
    from torch.distributed.pipelining import PipelineStage, schedules

    group, pp = mesh.pp.get_group(), mesh.pp.size()
    stages = stage_modules(model)
    n_stages = pp * len(stages)
    stage_rank = {s: r for r in range(pp) for s in rank_stages(r, pp, len(stages), schedule)}
    pipe = Pipeline(model, None, mesh, device, schedule, stages, n_stages, z_loss, act_dtype, microbatches,
                    stage_rank, loss_chunk_size=loss_chunk_size)
    built = [PipelineStage(module, index, n_stages, device, group=group) for index, module in stages]
    # loss_fn on every rank: the schedule runs a backward only when it has one (only the last stage calls it)
    cls = schedules.get_schedule_class(schedule)
    pipe.schedule = (cls(built[0], microbatches, loss_fn=pipe.loss, scale_grads=False) if schedule in SINGLE_STAGE
                     else cls(built, microbatches, loss_fn=pipe.loss, scale_grads=False))
    return pipe
