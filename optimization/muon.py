"""Muon for the blocks' hidden matrices and AdamW for the rest, in one optimizer that composes with every mesh.

Muon (Jordan et al., 2024, https://kellerjordan.github.io/posts/muon/): momentum, Nesterov,
then Newton-Schulz orthogonalisation of the update, with the LR scaled by Moonlight's
0.2 * sqrt(max(m, n)) so the update RMS matches AdamW's (Liu et al., "Muon is Scalable for LLM
Training", 2025; torch.optim.Muon's adjust_lr_fn="match_rms_adamw"). The math per matrix is
torch.optim.Muon's (its Newton-Schulz function and LR rule are called, not copied); on one
process the update equals torch.optim.Muon's. On a CPU the Newton-Schulz iteration runs in fp32
instead of torch's bf16 (newton_schulz_fp32, the same iteration; newton_schulz_for says why).

Distributed: a parameter and its gradient are DTensors (FSDP2 Shard(0); HSDP (Replicate,
Shard(0)); under train_2d.py also sharded over "tp"). Momentum and weight decay are elementwise
on the local shards, so the momentum buffer is a DTensor sharded like the parameter and DCP
saves and reshards it as it does AdamW's moments. Newton-Schulz needs the whole matrix: the
matrices are taken in rounds of W (the world size); in round j rank r owns matrix j*W + r. One
all_to_all_single sends every rank's shard of each matrix to its owner, the owner
orthogonalises the whole matrix, and a second all_to_all_single sends the shards back. A rank
thus holds one full matrix at a time and does 1/W of the Newton-Schulz work; every rank sends
and receives its own shards once each way per step (as much as a reduce-scatter of them).
An MoE's routed experts are one 3-D parameter (n_experts, m, n): n_experts matrices, each
orthogonalised on its own and stepped with its own (m, n) LR factor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.optim.adamw import adamw

from nn.roles import Role

# torch 2.13 renamed all_gather_into_tensor to all_gather_single and warns (FutureWarning, once per
# rank) at the old name; torch 2.9-2.12 (pyproject's range) have only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ADJUST_LR_FN = "match_rms_adamw"
"""torch.optim.Muon's name for Moonlight's 0.2 * sqrt(max(m, n)) LR rule."""


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz's iteration in fp32 instead of bf16; returns fp32 (m, n).

    grad: (m, n), any float dtype; not modified. A matrix with m > n is transposed first (the
    grams are then min(m, n)^2) and back at the end. X = G / max(||G||_F, eps) (so the
    spectral norm is at most 1), then ns_steps times the quintic X <- a X + (b A + c A^2) X with
    A = X X^T and (a, b, c) = ns_coefficients (Keller Jordan's 3.4445, -4.7750, 2.0315:
    https://github.com/KellerJordan/Muon). Raises ValueError for a grad that is not 2-D.
    """
    if grad.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # out of place: grad.float() is grad itself when it is fp32
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def newton_schulz_for(device: torch.device):
    """The Newton-Schulz function for matrices on device: newton_schulz_fp32 on any CPU, torch's bf16 one elsewhere.

    A CPU without bf16 units (no avx512_bf16 or amx_bf16) emulates bf16 matmuls: one 768 x 256
    orthogonalisation on one thread took 1.30 s in bf16 against 0.33 s in fp32 on such a CPU,
    and 0.54 s against 0.03 s here with oneDNN held to AVX2, which made a Muon step 2-5x an
    AdamW step. The rule is the device type, not the CPU's flags: every CPU then computes the
    same iteration (and the tests one path), at a small cost where bf16 units exist (768 x 256:
    about 4 ms bf16 against 12 ms fp32 here, about 4% of a debug-size Muon step). On a GPU
    torch's bf16 iteration runs on the tensor cores.
    """
    return newton_schulz_fp32 if device.type == "cpu" else _zeropower_via_newtonschulz


def is_muon_matrix(role: Role | None) -> bool:
    """Whether a parameter of this declared role (nn/roles.py) is Muon's: the blocks' hidden matrices and routed
    experts (Role.hidden); everything else, and a parameter without a role (None), keeps AdamW."""
    return role is not None and role.hidden


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer: param groups with "muon": True get Muon, the others AdamW (decoupled decay).

    Muon groups: lr, weight_decay, momentum, nesterov, ns_steps, ns_coefficients, eps (all as
    torch.optim.Muon, LR adjusted by ADJUST_LR_FN; Newton-Schulz by newton_schulz_for). AdamW groups: lr, betas, eps, weight_decay
    (torch.optim.adamw's functional kernel, fused when fused=True). Parameters: plain tensors or
    DTensors whose mesh spans the ranks of group (None: the whole default process group; under
    pipeline parallelism the stage's ranks, which hold the same matrices); a Muon step is then
    collective over group.
    State: AdamW "step", "exp_avg", "exp_avg_sq"; Muon "momentum_buffer" (fp32, like the grad).
    """

    def __init__(self, groups: list[dict], lr: float, betas=(0.9, 0.99), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = DEFAULT_NS_STEPS, fused: bool = False, group=None) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "muon": False, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                    "ns_eps": EPS}
        super().__init__(groups, defaults)
        self.fused, self.group = fused, group
        self._index: dict[int, tuple] = {}  # id(param) -> (my flat indices, {owner: all ranks' indices}) once

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (collective when a Muon group holds DTensors)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["muon"] else self._adamw_step)(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], foreach=False, fused=self.fused or None, amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        lr, mu = group["lr"], group["momentum"]
        updates = []
        for p in params:  # torch.optim.Muon's momentum and Nesterov, elementwise (on local shards for a DTensor)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            updates.append(p.grad.lerp(buf, mu) if group["nesterov"] else buf)

        def ns(full: torch.Tensor) -> torch.Tensor:
            f = newton_schulz_for(full.device)
            args = (group["ns_coefficients"], group["ns_steps"], group["ns_eps"])
            if full.ndim == 3:  # an MoE's experts (n_experts, m, n): each expert's matrix on its own
                return torch.stack([f(m, *args) for m in full])
            return f(full, *args)

        local = self._orthogonalise(params, updates, ns)
        for p, o in zip(params, local):
            p.mul_(1 - lr * group["weight_decay"])
            target = p.to_local() if isinstance(p, DTensor) else p
            # A 3-D parameter is n_experts matrices of shape p.shape[-2:]: the LR rule is each matrix's.
            target.add_(o.view(target.shape), alpha=-_adjust_lr(lr, ADJUST_LR_FN, p.shape[-2:]))

    def _orthogonalise(self, params, updates, ns) -> list[torch.Tensor]:
        """Each update orthogonalised as a whole matrix; returns this rank's piece of each (local shape)."""
        if not params or not isinstance(params[0], DTensor):
            return [ns(u) for u in updates]
        g = self.group
        world, me = dist.get_world_size(g), dist.get_rank(g)
        dev = params[0].to_local().device  # NCCL sends CUDA tensors only
        out: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for start in range(0, len(params), world):
            chunk = list(range(start, min(start + world, len(params))))
            mine = start + me if start + me < len(params) else None
            sends = [updates[i].to_local().reshape(-1).float() for i in chunk]
            idx_all = self._owner_indices(params, chunk, mine)  # [per source rank flat indices] of my matrix
            send_split = [s.numel() for s in sends] + [0] * (world - len(chunk))
            recv_split = [len(i) for i in idx_all] if mine is not None else [0] * world
            recv = torch.empty(sum(recv_split), dtype=torch.float32, device=dev)
            dist.all_to_all_single(recv, torch.cat(sends), recv_split, send_split, group=g)
            back = torch.empty(0, device=dev)
            if mine is not None:
                full = torch.empty(params[mine].numel(), dtype=torch.float32, device=dev)
                full[torch.cat(idx_all)] = recv
                o = ns(full.view(params[mine].shape)).float().reshape(-1)
                back = torch.cat([o[i] for i in idx_all])
            got = torch.empty(sum(send_split), dtype=torch.float32, device=dev)
            dist.all_to_all_single(got, back, send_split, recv_split, group=g)
            for i, piece in zip(chunk, got.split(send_split[:len(chunk)])):
                out[i] = piece
        return out

    def _owner_indices(self, params, chunk: list[int], mine: int | None) -> list[torch.Tensor]:
        """Flat global indices of every rank's local shard of params[mine] (once per round, then cached)."""
        key = id(params[chunk[0]])
        if key not in self._index:
            g = self.group
            world, dev = dist.get_world_size(g), params[chunk[0]].to_local().device
            own = []
            for i in chunk:  # this rank's piece, split exactly as DTensor splits (no communication)
                p = params[i]
                if p.device_mesh.size() != world:
                    raise ValueError(f"Muon needs parameters on a mesh over all {world} ranks, got {p.device_mesh}")
                idx = torch.arange(p.numel(), device=dev).view(p.shape)
                own.append(distribute_tensor(idx, p.device_mesh, p.placements, src_data_rank=None).to_local()
                           .reshape(-1))
            sizes = torch.tensor([len(i) for i in own] + [0] * (world - len(chunk)), device=dev)
            all_sizes = torch.empty(world * world, dtype=torch.int64, device=dev)
            _all_gather_single(all_sizes, sizes, group=g)
            recv_split = all_sizes.view(world, world)[:, dist.get_rank(g)].tolist()
            recv = torch.empty(sum(recv_split), dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv, torch.cat(own), recv_split, sizes.tolist(), group=g)
            self._index[key] = list(recv.split(recv_split)) if mine is not None else []
        return self._index[key]

