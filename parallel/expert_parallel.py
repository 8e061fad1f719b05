"""Expert parallelism (``parallel.ep``): each rank holds n_experts / ep routed experts, and tokens travel to them.

The ep ranks of an EP group are data-parallel ranks (EP borrows the FSDP shard dimension, as
torchtitan does), with the CP, then also the TP ranks where those are too few (Layout.ep_takes;
docs/cluster.md): each routes its own tokens, then one all-to-all with uneven splits sends every
(token, expert) row to the rank holding that expert, the experts run on what arrived, and a
second all-to-all brings the results back in the sender's order (``all_to_all_single``, the
collective Ulysses uses, so gloo runs it too). The router, the shared experts and the rest of the
block stay data-parallel. Exact: each row meets the same weights as
on one process; only the order of rows inside an expert's group differs.

The experts' 3-D parameters become DTensors Shard(0) on the "ep" mesh (whole experts per rank),
and FSDP2 then shards each on its dim 1 over the ranks that hold the same experts
("dp_mod_ep", with "dp_replicate" under HSDP), so DCP saves them under their full names and
shapes: a checkpoint loads at any ep. Their gradient sums the contributions of every rank's
tokens, and FSDP averages it over dp / ep ranks only, so the backward scales it by 1 / ep: the
mean over all data-parallel ranks, as every other parameter's (tp / ep where EP takes in the TP
ranks: apply_expert_parallel).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nn.moe import moe_layers, swiglu_experts
from nn.rows import gather_rows, inverse_permutation


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by scale."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _expert_major(recv_counts: Tensor) -> Tensor:
    """Row indices that reorder received rows from (source rank, expert) blocks to (expert, source rank) blocks.

    recv_counts: (ep, local experts) int64, rows sent by rank j for local expert e, the rows
    arriving source-major (all of rank 0's, by expert, then rank 1's ...). Returns (rows,) int64.
    """
    ep, n_local = recv_counts.shape
    sizes = recv_counts.flatten()
    starts = sizes.cumsum(0) - sizes  # where block (j, e) begins among the received rows
    blocks = torch.arange(ep * n_local, device=sizes.device).view(ep, n_local).T.flatten()  # (e, j) order
    sizes, starts = sizes[blocks], starts[blocks]
    first = sizes.cumsum(0) - sizes  # where each block begins in the new order
    total = int(sizes.sum())
    return torch.repeat_interleave(starts - first, sizes, output_size=total) + torch.arange(total, device=sizes.device)


def ep_forward(experts: nn.Module, x: Tensor, counts: Tensor, *, ep: int, group, grad_scale: float) -> Tensor:
    """GroupedExperts.forward under expert parallelism (collective over group, the EP ranks).

    x (tokens, dim) sorted by global expert, counts (n_experts,) int64 of this rank's rows per
    expert -> (tokens, dim), each row through its expert on the rank that holds it, in x's order.
    The split sizes come to the host (one sync per MoE layer and direction, as in torchtitan).
    """
    n_local = counts.numel() // ep
    # wait_tensor, not .wait(): under fake tensors (plan.py) the collective returns a plain tensor
    recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group)).view(ep, n_local)
    send = counts.view(ep, n_local).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    rows = funcol.all_to_all_single_autograd(x, recv, send, group)
    order = _expert_major(recv_counts)
    weights = [_ScaleGrad.apply(w.to_local() if isinstance(w, DTensor) else w, grad_scale)
               for w in (experts.w1, experts.w2, experts.w3)]
    back = inverse_permutation(order)
    out = swiglu_experts(gather_rows(rows, order, back), recv_counts.sum(0), *weights)
    return funcol.all_to_all_single_autograd(gather_rows(out, back, order), send, recv, group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_in_ep: int = 1) -> None:
    """Split every MoE layer's routed experts over ep_mesh (1-D, "ep"): parameters Shard(0), forward by all-to-all.

    tp_in_ep: the TP ranks the EP group takes in (Layout.ep_takes; 1: none). The experts' gradient is then
    complete without the sum over TP that the MoE's other parameters get (moe_sequence.reduce_over_tp), so the
    backward scales it by tp_in_ep / ep instead of 1 / ep. On the meta device, before FSDP (no communication:
    init_weights fills the shards later).
    """
    ep = ep_mesh.size()
    for moe in moe_layers(model):
        experts = moe.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
        experts.forward = functools.partial(ep_forward, experts, ep=ep, group=ep_mesh.get_group(),
                                            grad_scale=tp_in_ep / ep)


def shard_experts(model: nn.Module, mesh: DeviceMesh, **fsdp_kwargs) -> None:
    """fully_shard each MoE layer's experts over mesh (the ranks holding the same experts) on their dim 1.

    Dim 1 (expert_ffn_dim for w1/w3, dim for w2), not 0, which EP already splits: DTensor then
    needs no strided placement. Call before fully_shard of the blocks, which then leave them out.
    """
    for moe in moe_layers(model):
        fully_shard(moe.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1), **fsdp_kwargs)
