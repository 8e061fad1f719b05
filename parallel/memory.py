"""Whether a run can fit at all: each rank's parameters, gradients and optimizer state against its memory.

A model that cannot fit used to end in an allocator traceback from build_model, or in the OOM
killer, after the process group and the data were set up. This is the check that needs no model
and no collective: the parameters of the full model spread as thinly as the layout can spread
them (every rank but HSDP's replicas holds a distinct shard), at the bytes that training keeps per
parameter. It is a floor (activations, temporaries, collective buffers and the allocator's
margins come on top), so it refuses only runs that cannot fit; what fits is for a planner that
dry-runs the step.
"""
from __future__ import annotations

import math
import os

import torch

from core.errors import SetupError
from model import ModelArgs, num_params

BYTES_PER_PARAM = {"adamw": 16, "muon": 12}
"""Bytes each parameter keeps for the whole run: the fp32 parameter (FSDP keeps fp32 even when the compute is bf16)
and its fp32 gradient, 4 each, plus AdamW's two fp32 moments (8), or Muon's one momentum (4: the floor, as the
embeddings, output and norms keep AdamW's two under Muon)."""

GIB = 2 ** 30


def resident_floor(args: ModelArgs, optimizer: str, world_size: int, dp_replicate: int = 1) -> int:
    """The fewest bytes the fullest rank keeps for parameters, gradients and optimizer state (an int, bytes).

    num_params(args) x BYTES_PER_PARAM[optimizer] over the world_size / dp_replicate ranks that
    hold distinct shards (FSDP, TP, CP, EP and PP all split; HSDP's replicas repeat). A lower
    bound for every layout: an uneven split (a pipeline's first stage holds the embedding) only
    raises the fullest rank's share.
    """
    shards = max(1, world_size // max(1, dp_replicate))
    return math.ceil(num_params(args) * BYTES_PER_PARAM[optimizer] / shards)


def host_memory() -> int:
    """This machine's memory in bytes: physical RAM, or a smaller cgroup limit (a container's, v2 or v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def rank_memory(device: torch.device, local_world_size: int, cpu_offload: bool = False) -> tuple[int, str, int]:
    """(bytes one rank can hold, what they are, the ranks that share them or 0) for the run's parameters,
    gradients and optimizer state.

    On CUDA the device's own memory (its whole capacity, in bytes; 0 ranks share it). On CPU, or
    with parallel.cpu_offload (the state lives in host memory), the host's memory over the
    local_world_size ranks of this node, which share it.
    """
    if device.type == "cuda" and not cpu_offload:
        return (torch.cuda.get_device_properties(device).total_memory,
                f"the {torch.cuda.get_device_name(device)}'s memory", 0)
    where = "host memory" if device.type == "cuda" else "CPU memory"
    share = f", shared by {local_world_size} ranks" if local_world_size > 1 else ""
    return host_memory() // local_world_size, f"{where}{share}", local_world_size


def check_fits(args: ModelArgs, optimizer: str, world_size: int, dp_replicate: int, memory: int, where: str,
               sharing: int = 0) -> None:
    """Raise SetupError when resident_floor exceeds memory (bytes a rank has; where: what they are; sharing: the
    ranks of a machine that share that machine's memory, 0 for a device of each rank's own).

    The message says how much a rank needs, how much it has, and what would fit: the parameter
    count that fits at this world size, and the GPUs (or, for shared host memory, since more ranks
    on one machine only split it further, the machines like this one) this model needs.
    """
    need = resident_floor(args, optimizer, world_size, dp_replicate)
    if need <= memory:
        return
    n, per = num_params(args), BYTES_PER_PARAM[optimizer]
    rep = max(1, dp_replicate)
    shards = max(1, world_size // rep)
    fits = memory * shards // per
    if sharing:
        more = f"run it on at least {math.ceil(n * per * rep / (memory * sharing))} machines with this memory"
    else:
        more = f"spread it over at least {math.ceil(n * per / memory) * rep} GPUs of {memory / GIB:.1f} GiB each"
    raise SetupError(
        f"the model does not fit: its {n / 1e9:.2f}B parameters need at least {need / GIB:.1f} GiB on a rank for "
        f"parameters, gradients and {optimizer} state ({per} bytes each over {shards} rank(s) holding distinct shards, "
        f"before activations), and a rank has {memory / GIB:.1f} GiB ({where}); at most {fits / 1e9:.2f}B "
        f"parameters fit here: shrink the model (model.dim, model.n_layers, model.n_experts, model.vocab_size) or "
        f"{more}")
