"""The training loss: fp32 next-token cross-entropy, summed over tokens.

With tensor parallelism the output projection leaves the logits sharded on the vocabulary
(a DTensor, Shard(-1)); ``loss_parallel`` then computes the cross-entropy without gathering
(batch, seq, vocab) on any rank. ``loss_context`` picks it from the mesh.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def loss_context(mesh: DeviceMesh | None):
    """The context the loss and its backward run in: loss_parallel when mesh has a "tp" dimension, else none."""
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return loss_parallel
    return contextlib.nullcontext


def token_loss_sum(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the fp32 cross-entropy of next-token prediction.

    inputs, labels: (batch, seq) int64 on the model's device. Returns a 0-dim fp32 tensor (a
    replicated DTensor under loss_parallel: see scalar). Call inside loss_context(mesh).
    """
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def scalar(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a replicated DTensor scalar (loss_parallel's result), else t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
