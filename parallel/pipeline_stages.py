"""Which blocks each pipeline stage holds, and which stages each rank runs (``parallel.pp``).

The model is split into S = pp x v stages of contiguous blocks (v: stages per rank, 1 for
1F1B and GPipe, 2 or more for the interleaved schedules). Stage s of S holds
``stage_layers(n_layers, S, s)``; the first stage also holds the embedding, the last the final
norm and the output projection. A rank of the pipeline group runs the stages
``rank_stages(rank, pp, v, schedule)``: r, r + pp, r + 2 pp, ... ("loop" order, as Interleaved1F1B,
LoopedBFS and InterleavedZeroBubble expect), or r and 2 pp - 1 - r ("V" order, ZBVZeroBubble and
DualPipeV: the last rank runs the two middle stages and hands over between them directly).

Each rank builds the whole Transformer on the meta device and prunes it (``prune``) to the
union of its stages before any other wrapping, so every parameter keeps the full model's name
(``layers.7.attention.wq.weight``) and a DCP checkpoint written at one layout loads at any
other. With one stage per rank the pruned model is the stage's module; with several,
``stage_modules`` gives one ``StageModule`` per stage that shares the model's blocks (the
model keeps its names for checkpoints and the optimizer; each StageModule is what the
schedule and FSDP's root see).
"""
from __future__ import annotations

from torch import Tensor, nn

from model import Transformer

SINGLE_STAGE = ("1F1B", "GPipe")
"""Schedules with one stage per rank."""
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules with several stages per rank (parallel.pp_stages_per_rank, 2 by default)."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split the backward into input and weight gradients (parallelize keeps their stages' parameters
gathered from the forward to the weight gradient)."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Schedules whose 2 stages per rank go down and back up the ranks (rank_stages)."""
SCHEDULES = SINGLE_STAGE + MULTI_STAGE
"""torch.distributed.pipelining's schedules by their names (its get_schedule_class)."""


def stages_per_rank(schedule: str, given: int) -> int:
    """parallel.pp_stages_per_rank as run: given, or 0 -> 1 for a single-stage schedule and 2 for the others."""
    return given or (2 if schedule in MULTI_STAGE else 1)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The blocks of stage (0-based) of n_stages: contiguous, the first n_layers % n_stages stages one block more."""
    q, r = divmod(n_layers, n_stages)
    start = stage * q + min(stage, r)
    return range(start, start + q + (stage < r))


def rank_stages(rank: int, pp: int, per_rank: int, schedule: str = "") -> list[int]:
    """The stage indices (of pp x per_rank) that pipeline rank runs, ascending: rank, rank + pp, ... (the loop order
    of Interleaved1F1B, LoopedBFS and InterleavedZeroBubble), or under a V_SHAPED schedule (per_rank 2) rank and
    2 pp - 1 - rank, as torch's ZBVZeroBubble and DualPipeV place them."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


class PassThrough(nn.Module):
    """A block another stage holds: returns the residual stream unchanged, holds no parameters."""

    def forward(self, h: Tensor, *args, **kwargs) -> Tensor:
        return h


def prune(model: Transformer, stages: list[int], n_stages: int) -> None:
    """Keep only the blocks of stages (of n_stages) in model, on the meta device before any wrapping: the others
    become PassThrough; the embedding stays with stage 0, the final norm and output with the last stage.
    Records (stage, module) of each in model.pp_stages (stage_modules)."""
    n = len(model.layers)
    keep = {i for s in stages for i in stage_layers(n, n_stages, s)}
    for i in range(n):
        if i not in keep:
            model.layers[i] = PassThrough()
    if 0 not in stages:
        model.tok_embeddings = None
    if n_stages - 1 not in stages:
        model.norm = None
        model.output = None
    # Made now, on the meta device: later wrapping (TP, float8, AC, compile) changes the shared blocks in place.
    model.pp_stages = [(stages[0], model)] if len(stages) == 1 else [(s, StageModule(model, s, n_stages))
                                                                     for s in stages]


class StageModule(Transformer):
    """One stage of a pruned model that runs several: the model's own blocks of that stage (shared, not copied),
    with the embedding on the first stage and the norm and output on the last; forward is Transformer's.

    It holds no state of its own: the RoPE tables are read from the model, and its parameters
    are the model's, under the same names.
    """

    def __init__(self, model: Transformer, stage: int, n_stages: int):
        nn.Module.__init__(self)
        object.__setattr__(self, "whole", model)  # not a child: the model is not part of the stage
        self.args, self.logits_scale, self.input_scale = model.args, model.logits_scale, model.input_scale
        keep = stage_layers(len(model.layers), n_stages, stage)
        self.tok_embeddings = model.tok_embeddings if stage == 0 else None
        self.layers = nn.ModuleList(b if i in keep else PassThrough() for i, b in enumerate(model.layers))
        last = stage == n_stages - 1
        self.norm, self.output = (model.norm, model.output) if last else (None, None)

    @property
    def rope_cos(self) -> Tensor:
        return self.whole.rope_cos

    @property
    def rope_sin(self) -> Tensor:
        return self.whole.rope_sin


def stage_modules(model: Transformer) -> list[tuple[int, nn.Module]]:
    """(stage index, module) of each stage this rank runs, ascending: the model itself when it holds one stage
    (or is not pipelined: stage 0), else the StageModule of each (made by prune)."""
    return getattr(model, "pp_stages", [(0, model)])
