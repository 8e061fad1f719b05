"""A mixture of experts where the sequence is split (TP's sequence parallelism, CP): each rank routes its own tokens.

Between blocks, sequence parallelism already gives each TP rank seq / tp tokens of every window,
and CP gives each CP rank its slice. The MoE feed-forward runs on those tokens as they are: the
router, the shared experts and the routed experts (whole, or split over EP's ranks, which then
exchange only this rank's tokens) see plain tensors, not DTensors, and no token is computed twice.
Before this, train_2d.py all-gathered the MoE's input over TP and ran the whole sequence on every
TP rank: the same numbers, tp times the expert compute.

What the split asks in return, each exact:
- gradients: the MoE's parameters are replicated over TP (FSDP2 shards them over the data-parallel
  ranks only) but each TP rank's backward covers its own tokens, so after the backward their
  (sharded) gradients are summed over the TP group: one all-reduce of this rank's shards, 1 / dp of
  the parameters, before clipping (``reduce_over_tp``, called by parallel/hooks.MoEHook). Under CP,
  FSDP2 already reduces over the CP ranks (they are in its mesh, and the experts' too). An EP group
  that takes in the TP ranks (Layout.ep_takes) splits the routed experts over them instead: each
  expert then receives every TP rank's tokens, and its gradient is left out of that sum;
- the step's token counts and logged aux loss are summed over TP as over the data-parallel ranks
  (MoEHook);
- the sequence-wise balance loss needs each whole sequence's choices: ``MoE.sequence_sum`` sums
  them over the CP and the TP group (no autograd), in that order.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from nn.moe import moe_layers


def local_tokens() -> PrepareModuleInput:
    """The TP plan's entry for an MoE feed-forward: its input, the norm's DTensor sharded on the sequence (dim 1),
    passed on as this rank's local (batch, seq / tp, dim) tensor; its output, a plain tensor of the same shape, is
    the residual stream's local shard as it is."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def split_sequences(model: nn.Module, groups: list[DeviceMesh]) -> None:
    """Give every MoE feed-forward of model the sum over groups (the CP mesh, then the TP mesh; 1-D each) that its
    sequence-wise balance loss needs (MoE.sequence_sum). groups []: nothing to do."""
    if groups:
        fn = functools.partial(_sum_over, groups=tuple(m.get_group() for m in groups))
        for moe in moe_layers(model):
            moe.sequence_sum = fn


def _sum_over(x: Tensor, groups: tuple) -> Tensor:
    """x summed over each group's ranks in turn, no autograd (a new tensor; x is left as it was)."""
    x = x.detach()
    for group in groups:
        x = funcol.all_reduce(x, "sum", group).wait()
    return x


def reduce_over_tp(model: nn.Module, group: dist.ProcessGroup, device: torch.device, experts: bool = True) -> None:
    """Sum the gradients of every MoE layer's parameters of model over group (the TP ranks), in place, with one
    all-reduce on device (the gradients may sit in CPU memory under parallel.cpu_offload); call once the step's
    gradients are complete. experts False leaves the routed experts out: an EP group that takes in the TP ranks
    (Layout.ep_takes) has sent each expert every TP rank's tokens already. A parameter without a gradient is left
    out on every rank alike: the ranks of a TP group hold the same layers and run the same experts' code."""
    grads = [p.grad for moe in moe_layers(model) for name, p in moe.named_parameters()
             if p.grad is not None and (experts or not name.startswith("experts."))]
    if not grads:
        return
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1).to(device) for g in local])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
