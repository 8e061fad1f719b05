"""A step's predicted time from a dry run's figures: the model, stated, so a prediction can be checked and argued.

  compute      the rank's FLOPs (model FLOPs, plus the forward again under full activation
               checkpointing, a third of it under selective) at gpu.efficiency x the peak (under
               train.float8 the Linear layers torchao converts at the fp8 peak, the rest, from
               attention's scores to an MoE's routed experts, at the bf16 peak), plus
               the host's fixed time per operator dispatched, more for a DTensor's (eager
               PyTorch on a CPU; 0 on a GPU, where the launches run ahead of the device)
  collectives  each one's bytes over the link its group crosses (intra_node when the group's
               ranks share a node, else inter_node), by the ring algorithm: an all-gather or a
               reduce-scatter moves (n-1)/n of the gathered bytes, an all-reduce twice that, an
               all-to-all (n-1)/n of its input, a send or receive all of it; plus a fixed
               latency per call
  overlap      FSDP's gathers and reductions (roles fsdp, experts_fsdp) run behind the compute
               (FSDP2 prefetches the next block's): only what exceeds the compute, plus one block's
               share (the first gather, the last reduction), is exposed. TP's, CP's and EP's
               collectives, the pipeline's transfers and the small all-reduces are exposed.
  pipeline     the bubble of its schedule: (pp - 1) / (micro-batches x stages per rank) of the
               compute for GPipe, 1F1B and the interleaved schedules (Narayanan et al. 2021), a
               third of that for the zero-bubble ones (Qi et al. 2024 remove most of it)
  optimizer    memory-bound: the rank's parameters, gradients and state read and written once
               at the device's memory bandwidth
The step is the sum. MFU counts model FLOPs only (model.flops_per_token), as the trainer's does.
"""
from __future__ import annotations

import dataclasses

import torch

from config import Config
from model import Transformer, flops_per_token
from parallel.float8 import float8_params
from parallel.layout import Layout
from parallel.pipeline_stages import ZERO_BUBBLE, stages_per_rank
from planning.dryrun import RankPlan
from planning.gpus import GPU

OVERLAPPED = ("fsdp", "experts_fsdp")
"""Roles whose collectives FSDP2 runs behind the compute."""
RECOMPUTE = {"none": 0.0, "selective": 1 / 9, "full": 1 / 3}
"""Extra compute over forward + backward (3 forwards' worth) per activation_checkpointing: full recomputes the
forward (+1/3); selective recomputes about a third of it (the attention's inputs and elementwise ops)."""


@dataclasses.dataclass
class StepEstimate:
    """A rank's predicted step (seconds) and the parts it is the sum of."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    optimizer_s: float
    comm_s: dict
    """{'collective role': seconds on the link, before overlap}."""


def link_of(ranks: list[int], gpus_per_node: int) -> str:
    """'intra_node' when all of ranks sit on one node (torchrun numbers ranks node by node), else 'inter_node'."""
    return "intra_node" if len({r // gpus_per_node for r in ranks}) == 1 else "inter_node"


def ring_factor(kind: str, n: int) -> float:
    """Bytes on the link per byte of payload (accounting's) for a ring over n ranks."""
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0


def flops_per_step(cfg: Config) -> float:
    """Model FLOPs of one step of the whole world (model.flops_per_token x the global batch's tokens)."""
    return flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.global_batch_size * cfg.data.seq_len


def float8_share(cfg: Config) -> float:
    """The fraction of model.flops_per_token that runs in float8 under cfg.train.float8 (0 when off): the Linear
    layers parallel.float8.convert swaps, counted on a meta-device model (shapes only)."""
    if cfg.train.float8 == "off":
        return 0.0
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return 6.0 * float8_params(model) / flops_per_token(cfg.model, cfg.data.seq_len)


def estimate(plan: RankPlan, cfg: Config, world_size: int, gpu: GPU, gpus_per_node: int) -> StepEstimate:
    """The step time of plan's rank on gpu, seconds (see the module's docstring for the model)."""
    layout = Layout.of(cfg.parallel, world_size)
    t = cfg.train
    fp8 = float8_share(cfg) if gpu.fp8_flops else 0.0
    rank_flops = flops_per_step(cfg) / world_size * (1 + RECOMPUTE[t.activation_checkpointing])
    per_flop = (1 - fp8) / gpu.bf16_flops + (fp8 / gpu.fp8_flops if fp8 else 0.0)
    compute = rank_flops * per_flop / gpu.efficiency + plan.ops * gpu.op_overhead_s + \
        plan.dtensor_ops * gpu.dtensor_op_overhead_s
    if gpu.cores and gpus_per_node > gpu.cores:  # CPU ranks time-sharing the cores
        compute *= gpus_per_node / gpu.cores
    comm, overlapped, exposed = {}, 0.0, 0.0
    for name, nbytes in plan.comm.items():
        kind, role = name.split(" ", 1)
        ranks = plan.groups.get(role, list(range(world_size)))
        bandwidth = getattr(gpu, link_of(ranks, gpus_per_node))
        seconds = nbytes * ring_factor(kind, len(ranks)) / bandwidth + plan.calls.get(name, 0) * gpu.collective_latency_s
        comm[name] = seconds
        if role in OVERLAPPED and kind in ("all_gather", "reduce_scatter"):
            overlapped += seconds
        else:
            exposed += seconds
    # One block's gather before the first forward and one reduction after the last backward cannot hide.
    blocks = max(1, cfg.model.n_layers // layout.pp)
    exposed += max(0.0, overlapped - compute) + overlapped / blocks
    bubble = 0.0
    if layout.pp > 1:
        v = stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank)
        bubble = compute * (layout.pp - 1) / (plan.micro_batches * v)
        if cfg.parallel.pp_schedule in ZERO_BUBBLE:
            bubble /= 3
    optimizer = 2 * sum(plan.held.values()) / gpu.hbm_bandwidth
    return StepEstimate(compute + exposed + bubble + optimizer, compute, exposed, bubble, optimizer, comm)
