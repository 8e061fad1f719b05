"""What one training step holds and moves on this rank: memory at its peak by category, and bytes per collective.

The one accounting the planner (plan.py, which runs the step on fake tensors at any world size)
and the trainer (train.track_memory on CPU, the `peak_bytes` of its train records) share, so a
plan and a real run are measured alike. Memory is PyTorch's own tracker of every tensor's
storage (torch.distributed._tools: FSDPMemTracker for an FSDP root, MemTracker otherwise); the
collectives are counted at the dispatcher, where both FSDP2's process-group calls (c10d) and
DTensor's functional collectives pass, each by the ranks of its group.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.pipeline_stages import stage_modules

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "collectives", "inputs")
"""The step's memory by what it is, bytes: parameters (and buffers) as held between steps, gradients, optimizer
state, activations kept for backward, temporaries, collective buffers (FSDP's gathered parameters and unreduced
gradients, the all-gather and reduce-scatter buffers), the step's inputs."""

_TRACKER_CATEGORY = {
    "Sharded Param": "params", "Parameter": "params", "Buffer": "params",
    "Sharded Grad": "grads", "Gradient": "grads", "Unsharded Grad": "collectives",
    "Unsharded Param": "collectives", "All Gather": "collectives", "Reduce Scatter": "collectives",
    "OptState": "optimizer", "Optstate": "optimizer", "Activation": "activations", "Temp": "temporaries",
    "Inputs": "inputs", "Input": "inputs",
}

COLLECTIVES = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv",
}
"""Dispatcher op names (c10d's in-place ops and _c10d_functional's) -> the collective they are."""


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _group_ranks(args, kwargs) -> tuple[int, ...]:
    """The global ranks of the process group a collective op names (a ProcessGroup, or a functional op's group
    name); () when it names none (the default group is then the world's)."""
    for a in list(args) + list(kwargs.values()):
        pg = None
        if isinstance(a, str):
            with contextlib.suppress(Exception):  # a string that is not a group name (a reduce op's)
                pg = c10d._resolve_process_group(a)
        elif isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):
                pg = dist.ProcessGroup.unbox(a)
        elif isinstance(a, dist.ProcessGroup):
            pg = a
        if pg is not None:
            return tuple(dist.get_process_group_ranks(pg))
    return tuple(range(dist.get_world_size()))


def _payload(namespace: str, kind: str, args, n: int) -> int:
    """CommCounter's bytes of one call: c10d's ops take (output, input, ...) for reduce-scatter and all-to-all and the
    gathered output first for an all-gather; the functional ops take this rank's input first."""
    if namespace == "_c10d_functional":
        return _nbytes(args[0]) * (n if kind == "all_gather" else 1)
    return _nbytes(args[1] if kind in ("reduce_scatter", "all_to_all") else args[0])


class CommCounter(TorchDispatchMode):
    """Counts the bytes of every collective this rank starts while active: {(collective, group ranks): bytes}.

    The bytes of one call are its payload on this rank: the gathered output of an all-gather,
    the input of a reduce-scatter, the tensor of an all-reduce or broadcast, the input of an
    all-to-all, the tensor sent or received. A group of one rank moves nothing and is not counted.
    """

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.ops = 0
        """Operators dispatched while active (every aten op of the step, a collective among them)."""
        self.dtensor_ops = 0
        """Of those, the ones on DTensors (each propagates its sharding before its local op runs)."""
        self.marks: list[tuple[dict, dict, int, int]] = []
        """(bytes, calls, ops, dtensor_ops) so far at each mark(): account_step marks each forward of the root (a
        micro-batch)."""

    def mark(self) -> None:
        self.marks.append((dict(self.bytes), dict(self.calls), self.ops, self.dtensor_ops))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if DTensor in types:
            self.dtensor_ops += 1
        kind = COLLECTIVES.get(func.__name__.split(".")[0]) if func.namespace in ("c10d", "_c10d_functional") \
            else None
        if kind is not None:
            ranks = _group_ranks(args, kwargs)
            if len(ranks) > 1:
                self.bytes[(kind, ranks)] += _payload(func.namespace, kind, args, len(ranks))
                self.calls[(kind, ranks)] += 1
        return func(*args, **kwargs)


@dataclasses.dataclass
class StepAccount:
    """One step's accounting on one rank."""

    peak_bytes: int = 0
    """The most bytes live at once during the step (every tensor's storage, rounded as the tracker rounds)."""
    at_peak: dict = dataclasses.field(default_factory=dict)
    """{category (CATEGORIES): bytes} at that moment."""
    comm: dict = dataclasses.field(default_factory=dict)
    """{(collective, group ranks): bytes} this rank moved (CommCounter)."""
    calls: dict = dataclasses.field(default_factory=dict)
    """{(collective, group ranks): calls}."""
    ops: int = 0
    """Operators the step dispatched on this rank (CommCounter.ops)."""
    dtensor_ops: int = 0
    """Of those, the ones on DTensors (CommCounter.dtensor_ops)."""
    marks: list = dataclasses.field(default_factory=list)
    """(comm, calls, ops, dtensor_ops) so far when each forward of the root began: marks[1] is the first
    micro-batch's."""


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{'params', 'grads', 'optimizer': bytes} this rank holds between steps: its shards of the parameters (as the
    optimizer holds them: a DTensor's local tensor), of their gradients where they exist, and the optimizer's state."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(_nbytes(local(p)) for p in params),
            "grads": sum(_nbytes(local(p.grad)) for p in params if p.grad is not None),
            "optimizer": sum(_nbytes(local(v)) for v in state)}


class StepMemTracker(FSDPMemTracker):
    """FSDPMemTracker keeping the step's peak only: after every op it would also update the peak of each module
    being run, over all the modules it has seen (a fifth of a dry run's time at 80 layers); nothing reads those."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


@contextlib.contextmanager
def account_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count_comm: bool = True,
                 memory: bool = True):
    """Account the step run inside: yields a StepAccount, filled on exit.

    model: the rank's root module (an FSDP root is tracked by FSDPMemTracker, whose categories
    tell gathered parameters and collective buffers apart; any other by MemTracker). The
    optimizer's existing state is counted from the start, so account a step after the first
    (the first creates the state). count_comm: count the collectives (CommCounter); memory:
    track the memory (tracking every tensor slows a step).
    """
    if not memory:
        tracker = contextlib.nullcontext()
    elif isinstance(model, FSDPModule):
        tracker = StepMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    counter = CommCounter() if count_comm else contextlib.nullcontext()
    account = StepAccount()

    roots = {id(model)} | {id(stage) for _, stage in stage_modules(model)}

    def before_forward(module, _):
        if id(module) not in roots:
            return
        if memory:
            # PyTorch's trackers refuse a second forward of a top module in one step (gradient accumulation, a
            # pipeline's micro-batches) while they hold its statistics, which nothing here reads: drop that
            # module's (only: an interleaved schedule's other micro-batches are still in their backward).
            tracker.memory_tracking.pop(module, None)
        if count_comm and module is model:
            counter.mark()
    handle = register_module_forward_pre_hook(before_forward)  # global: it runs before the root's own (FSDP's)
    try:
        with tracker, counter:
            yield account
    finally:
        handle.remove()
    peak = tracker.get_tracker_snapshot("peak") if memory else {}
    for snap in peak.values():  # one device: the rank's
        account.peak_bytes = max(account.peak_bytes, int(snap.get("Total", 0)))
        at = dict.fromkeys(CATEGORIES, 0)
        for name, nbytes in snap.items():
            key = _TRACKER_CATEGORY.get(str(getattr(name, "value", name)))
            if key:
                at[key] += int(nbytes)
        account.at_peak = at
    if count_comm:
        account.comm, account.calls, account.marks = dict(counter.bytes), dict(counter.calls), counter.marks
        account.ops, account.dtensor_ops = counter.ops, counter.dtensor_ops
