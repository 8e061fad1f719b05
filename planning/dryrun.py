"""One rank's training step, run by the trainer's own code at any world size in this one CPU process.

PyTorch's fake process group (backend "fake": every collective returns at once and moves no
data) stands in for the world, and FakeTensorMode for the tensors (shapes, dtypes and storage
sizes, no data and no compute), so the real build (training.step.build_trainable: the mesh,
the TP/CP/EP/PP plans, activation checkpointing, float8, FSDP2, the optimizer) and the real
step (training.step.train_step) run for any layout: a plan is of the code that will run, not
of a model of it. parallel/accounting.py measures the step as the trainer measures a real one.

What fakes cannot do, the dry run does explicitly (HostValues, static_stages, dry_run): the
host reads a tensor (the gradient norm's finiteness, a count) -> a stated value; a mixture of
experts routes by data -> a planned load; a pipeline stage learns its neighbours' shapes by
send/recv, which moves nothing here -> the shapes are given up front, and each stage's rank
is planned in turn.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _sharding_prop as sharding_prop
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from config import Config
from nn import moe
from parallel import parallelize
from parallel.accounting import account_step, held_bytes
from parallel.layout import ROLES, Layout
from parallel.parallelize import TPPlan
from parallel.pipeline import default_microbatches
from training.step import build_trainable, train_step

ROLE_ORDER = ("tp", "cp", "ep", "pp", "experts_fsdp", "fsdp", "loss", "data", "same_params")
"""The role a group is named by when several roles have the same ranks (the most specific first)."""
assert set(ROLE_ORDER) == set(ROLES)


@dataclasses.dataclass
class RankPlan:
    """What one rank's step holds and moves, from a dry run (bytes; a step is train.global_batch_size windows)."""

    rank: int
    stage: int
    """Its first pipeline stage (0 without PP)."""
    micro_batches: int
    """Forward/backward passes of this rank per step: its gradient accumulation, or the pipeline schedule's
    micro-batches."""
    held: dict
    """{'params', 'grads', 'optimizer': bytes}: the rank's shards of the parameters, of their gradients once whole,
    and the optimizer's state (accounting.held_bytes, read after the backward of the accounted step)."""
    peak_bytes: int
    at_peak: dict
    """{category: bytes} at the peak (accounting.CATEGORIES)."""
    comm: dict
    """{'collective role' (e.g. 'all_gather fsdp'): bytes per step}."""
    calls: dict
    """{'collective role': calls per step}."""
    groups: dict
    """{group name (a role or a mesh dimension): its ranks} of the groups the rank's collectives used."""
    ops: int = 0
    """Operators the rank's step dispatches (forward, backward, optimizer): each costs the host a fixed time."""
    dtensor_ops: int = 0
    """Of those, the ones on DTensors: each costs the host its sharding propagation too."""


class HostValues(TorchDispatchMode):
    """The answers a real step reads from its tensors, which fake tensors do not have.

    A scalar read by the host (the gradient norm's finiteness check, a loss read for a log line)
    is 1: the step proceeds as a finite one. A mixture of experts' token counts per expert
    (nn.moe.expert_counts, replaced by planned_counts) are the planned load: the mean on every expert, the first
    one at max_load times the mean, the rest shared by the others, as real (not fake) tensors, so
    the sizes the layer splits by are real; under expert parallelism every rank is taken to
    route alike, so the counts an all-to-all exchanges come back as sent. An op whose inputs are
    all real tensors (a device mesh's rank table, those counts) runs for real, and so does an
    integer arange (the index arithmetic on the counts).
    """

    SPECIAL = (torch.ops.aten._local_scalar_dense.default,)

    def __init__(self, max_load: float = 1.0):
        super().__init__()
        self.max_load = max_load

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.SPECIAL and any(isinstance(a, FakeTensor) for a in args):
            return func(*args, **kwargs)  # the common case, first: an op on fake tensors
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and all(a.is_meta and not isinstance(a, FakeTensor) for a in tensors) \
                and str(kwargs.get("device", "meta")) == "meta":
            with unset_fake_temporarily():  # the meta device's own ops (FSDP splitting a model built on it)
                return func(*args, **kwargs)
        if tensors and not any(isinstance(a, FakeTensor) or a.is_meta for a in tensors):
            with unset_fake_temporarily():
                if func is torch.ops._c10d_functional.all_to_all_single.default:
                    return args[0].clone()
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        if func.overloadpacket is torch.ops.aten.arange and not (kwargs.get("dtype") or torch.int64).is_floating_point:
            with unset_fake_temporarily():  # index arithmetic on those real counts (expert_parallel._expert_major)
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def planned_counts(self, choice: torch.Tensor, n_experts: int) -> torch.Tensor:
        """(n_experts,) int64 counts summing to n = choice.numel(): the first expert at min(max_load x mean, n), the
        rest even (nn.moe.expert_counts's stand-in)."""
        n = choice.numel()
        with unset_fake_temporarily():
            first = min(n, math.ceil(self.max_load * n / n_experts)) if n_experts > 1 else n
            rest = torch.full((n_experts - 1,), (n - first) // max(1, n_experts - 1), dtype=torch.int64)
            rest[:(n - first) - int(rest.sum())] += 1
            return torch.cat([torch.tensor([first]), rest])


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """The process group of a world of world_size ranks, this process as rank, with the fake backend; destroyed
    on exit, with what DTensor cached of its meshes (so the next rank can be planned in the same process)."""
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


@contextlib.contextmanager
def own_propagation():
    """DTensor's sharding propagation in a fake mode of its own, as in a real run.

    It runs each op once more on fake tensors of the global shapes, in the active fake mode
    when there is one (torch.distributed.tensor._sharding_prop.detect_fake_mode). In a real
    run that is a mode of its own, which PyTorch's memory tracker recognises and leaves out;
    under the dry run's it would be ours, and the tracker would count those global tensors
    (a whole vocabulary's logits under loss_parallel) as memory the step holds.
    """
    with mock.patch.object(sharding_prop, "detect_fake_mode", lambda *args: None):
        yield


def forget_meshes() -> None:
    """Clear every cache of torch.distributed.tensor (sharding decisions, redistribution plans, mesh topologies).

    They are keyed by DeviceMesh, and a mesh compares equal to another of the same shape and
    names whatever its process groups: after one plan's world is destroyed, the next plan's
    meshes would be handed the old ones' decisions, and with them groups that no longer exist.
    """
    seen = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.tensor") or module is None:
            continue
        for holder in [module, *[v for v in vars(module).values() if isinstance(v, type)]]:
            for value in list(vars(holder).values()):
                value = getattr(value, "__func__", value)  # staticmethod, classmethod
                if isinstance(value, functools._lru_cache_wrapper) and id(value) not in seen:
                    seen.add(id(value))
                    value.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's


@contextlib.contextmanager
def static_stages(cfg: Config, layout: Layout):
    """Pipeline stages told their tensors' shapes up front (PipelineStage's static mode), for the dry run.

    On its first step a pipeline stage learns the shapes it receives from its neighbours by
    send/recv, which a fake world does not deliver. Their shapes are known from the config:
    a micro-batch of the schedule (the rank's batch over its micro-batches) of the rank's part
    of the sequence (split over CP, and over TP where sequence parallelism passes on a rank's
    part), the token ids into the first stage, the hidden states (dim, in the blocks' dtype)
    between stages; the last stage's output is not sent (its logits' shape stands for it).
    """
    import torch.distributed.pipelining as pipelining  # loads torch._dynamo: only where a pipeline is planned


    t, p, m = cfg.train, cfg.parallel, cfg.model
    local = t.global_batch_size // layout.data
    micro = local // (p.pp_microbatches or default_microbatches(p.pp, local, p.pp_schedule))
    tokens = cfg.data.seq_len // p.cp
    seq = tokens // p.tp if p.tp > 1 else tokens
    act = torch.bfloat16 if t.dtype == "bfloat16" else torch.float32
    real = pipelining.PipelineStage

    def stage(module, index, n_stages, device, group=None):
        hidden = torch.empty(micro, seq, m.dim, dtype=act, device=device, requires_grad=True)  # gradients flow back
        inputs = torch.zeros(micro, tokens, dtype=torch.int64, device=device) if index == 0 else hidden
        outputs = torch.empty(micro, seq, m.vocab_size, device=device) if index == n_stages - 1 else hidden
        return real(module, index, n_stages, device, input_args=inputs, output_args=outputs, group=group)

    schedules = pipelining.schedules
    issue = schedules._batch_p2p

    def batch_p2p(ops, desc=None):  # a work per op, or one for a mixed batch (batch_isend_irecv)
        works = issue(ops, desc)
        return [HeldWork(w, [op.tensor for op in (ops if len(works) != len(ops) else [ops[i]])])
                for i, w in enumerate(works)]

    with mock.patch.object(pipelining, "PipelineStage", stage), mock.patch.object(schedules, "_batch_p2p", batch_p2p):
        yield


class HeldWork:
    """A fake world's send or receive that keeps its tensors until it is waited on, as NCCL's work does (its
    tensors are stashed until wait(), for the caching allocator's safety) and gloo's does at least until the peer
    has them: the fake one completes at once and keeps none, which left the sends that an interleaved schedule
    waits on late out of its plan's peak (3.8-4.8% under the real one's; 0.6-2.1% over, with this)."""

    def __init__(self, work, tensors: list[torch.Tensor]):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        self.tensors = []
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


FSDP_KINDS = ("all_gather", "reduce_scatter")
"""FSDP's collectives, named by an FSDP role first where their group is also another's: its gathers and reductions
over ranks that are also the EP group (ep = the data-parallel ranks) or the CP group (one data-parallel rank) are
FSDP's (overlapped, planning/estimate.py), where the ranks alone would name them 'ep' or 'cp' (exposed); under HSDP
they run over the shard dimensions of FSDP's mesh alone. TP's gathers never share FSDP's ranks (their dimensions are
disjoint). An all-to-all is Ulysses' or EP's, never TP's ('cp' where EP's group is the CP group: the same ranks);
HSDP's all-reduce between replicas is named 'dp_replicate' whatever other group has its ranks."""


def _along(layout: Layout, dims, rank: int) -> tuple[int, ...]:
    """The ranks whose coordinates differ from rank's only along the mesh dimensions dims (row-major, as
    Layout.members)."""
    mine, ranks = layout.coords(rank), [0]
    for name, size in layout.dims():
        ranks = [r * size + c for r in ranks for c in (range(size) if name in dims else (mine[name],))]
    return tuple(ranks)


def role_of(layout: Layout, ranks: tuple[int, ...], rank: int, kind: str = "") -> str:
    """The name of rank's group ranks for a collective of kind ('all_gather', ...): FSDP's role for its collectives
    (FSDP_KINDS), 'dp_replicate' for HSDP's all-reduce, else the role whose group it is (ROLE_ORDER's first), else
    the mesh dimension along which its ranks differ, else 'world' or 'other'."""
    if kind in FSDP_KINDS:
        for role in ("experts_fsdp", "fsdp"):
            shard = [d for d in layout.role_dims(role) if d != "dp_replicate"]
            if shard and _along(layout, shard, rank) == ranks:
                return role
    if kind == "all_reduce" and layout.dp_replicate > 1 and _along(layout, ["dp_replicate"], rank) == ranks:
        return "dp_replicate"
    for role in (("cp", "ep") if kind == "all_to_all" else ()) + ROLE_ORDER:
        if layout.role_dims(role) and tuple(layout.members(role, rank)) == ranks:
            return role
    for dim, _ in layout.dims():
        if _along(layout, [dim], rank) == ranks:
            return dim
    return "world" if len(ranks) == layout.world_size else "other"


def planned_ranks(layout: Layout) -> list[int]:
    """The ranks a plan runs: one per pipeline rank (its first data-parallel, CP and TP rank); every other rank
    holds and moves what one of these does (the same shapes: FSDP's, TP's and EP's splits are even)."""
    return [layout.members("pp", 0)[s] for s in range(layout.pp)] if layout.pp > 1 else [0]


def dry_run(cfg: Config, world_size: int, rank: int, tp_plan: TPPlan | None = None, max_load: float = 1.0
            ) -> RankPlan:
    """Build the run on rank of world_size fake ranks and account one step (cfg already checked and resolved).

    The step's data are drawn token ids (no corpus is read). The optimizer's state is created
    first (optimizer_state), as a real run's first step creates it, then one step runs as the
    trainer runs it, accounted. It takes two micro-batches where the run accumulates more:
    every micro-batch but the last repeats the first's collectives (the last reduces the
    gradients), so the step's bytes are the two's plus the first's for each one more, and its
    peak is the second's (the gradients already exist). Under a pipeline it runs all of the
    schedule's micro-batches. max_load: HostValues' planned expert load. The weights keep
    their fake shards uninitialised (keep_shard). Raises what the trainer's build raises.
    """
    layout = Layout.of(cfg.parallel, world_size)
    device = torch.device("cpu")
    t = cfg.train
    with fake_world(world_size, rank):
        mesh = layout.build(device)  # before the fake mode: DeviceMesh reads its rank table
        dp = mesh.size("data")
        micro, per_rank = t.micro_batch(dp), t.global_batch_size // dp
        n_micro = per_rank // micro
        host = HostValues(max_load)
        with FakeTensorMode(allow_non_fake_inputs=True), host, own_propagation(), \
                mock.patch.object(parallelize, "copy_sharded", keep_shard), \
                mock.patch.object(moe, "expert_counts", host.planned_counts), \
                static_stages(cfg, layout) if layout.pp > 1 else contextlib.nullcontext():
            tr = build_trainable(cfg, rank, mesh, device, tp_plan)
            optimizer_state(tr.optimizer, tr.model)
            n = n_micro if layout.pp > 1 else min(2, n_micro)
            batches = [(torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len)),
                        torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len))) for _ in range(n)]
            held = {}
            with account_step(tr.model, tr.optimizer) as step:
                train_step(tr, batches, lambda model: held.update(held_bytes(model, tr.optimizer)))
    # Gradient accumulation: each micro-batch not run repeats the first's collectives and operators (the last one's
    # end the step).
    more = n_micro - n
    first_comm, first_calls, first_ops, first_dtensor_ops = step.marks[1] if more and len(step.marks) > 1 \
        else ({}, {}, 0, 0)
    ops, dtensor_ops = step.ops + more * first_ops, step.dtensor_ops + more * first_dtensor_ops
    comm, calls, groups = {}, {}, {}
    for key in step.comm:
        kind, ranks = key
        group = role_of(layout, ranks, rank, kind)
        groups[group] = list(ranks)
        name = f"{kind} {group}"
        comm[name] = comm.get(name, 0) + step.comm[key] + more * first_comm.get(key, 0)
        calls[name] = calls.get(name, 0) + step.calls[key] + more * first_calls.get(key, 0)
    passes = getattr(tr.runner, "n_microbatches", n_micro)
    return RankPlan(rank, layout.stages(rank)[0], passes, held, step.peak_bytes, step.at_peak, comm, calls, groups,
                    ops, dtensor_ops)


def keep_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """parallelize.copy_sharded in a dry run: the parameter keeps the shard to_empty gave it. Fake values need no
    initialising, and splitting each full tensor into world-size pieces was a third of a dry run at 512 ranks."""


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Create the optimizer's state as its first step does (an update of zero gradients), without a training step:
    the accounted step is then one of the steady state, as a real run's second."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
