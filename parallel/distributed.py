"""The process group and the small collective helpers every command shares.

torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT)
decides the layout, on one node or many: nothing assumes that RANK equals LOCAL_RANK;
a plain ``python`` run is one rank on a free port. CUDA runs get NCCL for CUDA tensors plus
gloo for CPU ones; CPU runs get gloo.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor

from core.errors import SetupError, UserError
from core.host_memory import keep_freed_blocks

STARTUP_TIMEOUT = datetime.timedelta(minutes=30)
"""Timeout of every collective until the loop's first step is done (loading, compiling); then
train.collective_timeout_s applies (set_collective_timeout)."""
LONG_TIMEOUT = datetime.timedelta(hours=24)
"""Timeout of the groups that tokenize a corpus: it can outlast the default 30 minutes. A hung
peer is still caught, because torchrun stops every rank when one fails."""


def _env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    """The int in environment variable name (default when unset); SetupError unless low <= it <= high."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise SetupError(f"{name} is '{text}', not an integer in {low}..{high if high is not None else ''}; launch "
                         f"with torchrun, which sets it, or unset it for one process")
    return value


def world_size() -> int:
    """WORLD_SIZE from torchrun's environment (1 for a plain python run); SetupError if not a positive int."""
    return _env_int("WORLD_SIZE", 1, 1)


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE from torchrun's environment: the ranks on this node (WORLD_SIZE when unset).

    Raises SetupError unless it is an int in 1..WORLD_SIZE.
    """
    return _env_int("LOCAL_WORLD_SIZE", world_size(), 1, world_size())


def local_rank() -> int:
    """LOCAL_RANK from torchrun's environment: this rank's index on its node (0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """torch.device for train.device ('auto', 'cuda' or 'cpu') on local rank local_rank.

    Raises SetupError for 'cuda' without a visible CUDA device.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise SetupError("train.device is 'cuda' but no CUDA device is visible; use --train.device cpu")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1
"""linux/prctl.h: the signal a process gets when its parent dies."""


def die_with_agent() -> None:
    """Under torchrun on Linux: this worker is SIGKILLed as soon as its agent dies (prctl PR_SET_PDEATHSIG).

    torchrun starts its workers in sessions of their own, so a SIGKILL of the agent's process
    group (a lost agent, a scheduler that kills only the launcher) would leave them training
    and writing checkpoints, and the run directory's lock would refuse the next run. A SIGKILL
    leaves no checkpoint that looks complete: a local one is renamed into place whole, a URL
    one is committed by a marker written last. Call it first thing in a worker; a no-op
    elsewhere. Exits at once when the agent is already gone.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:  # the agent died before the request took effect
        os._exit(1)


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the process group from torchrun's environment; returns (rank, world size, device).

    device: train.device. A plain `python` run (no MASTER_PORT) takes a free port, so two
    runs on one machine never clash on torchrun's default 29500. On CPU the process keeps the
    blocks a step frees for the next one (core/host_memory.py).
    """
    rank = int(os.environ.get("RANK", 0))
    world = world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    dev = resolve_device(device, local_rank())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
        keep_freed_blocks()
    dist.init_process_group(backend=backend, store=_attempt_store(world), rank=rank, world_size=world,
                            timeout=STARTUP_TIMEOUT)
    return rank, world, dev


def _attempt_store(world: int):
    """The store the process group meets in: torchrun's, under a prefix of its own for each restart.

    By default torchrun's workers share the agent's rendezvous TCPStore (TORCHELASTIC_USE_AGENT_STORE),
    and it outlives a restart: the keys gloo and NCCL publish their addresses under would still
    hold the dead workers' values, so a restarted rank could connect to a dead peer and fail or
    hang in init_process_group (pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT keeps each
    attempt's keys apart. Across nodes the agents count restarts each for itself, so
    multi-node launches also set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (scripts/slurm_train.sh),
    which gives every attempt a new store. None (init_process_group's env:// store) otherwise.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=STARTUP_TIMEOUT)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def set_collective_timeout(seconds: float) -> None:
    """Bound every later collective of every process group this rank is in to `seconds` (gloo and NCCL).

    A gloo collective that waits longer raises RuntimeError on this rank (see peer_failure); NCCL's
    watchdog ends the process. torch has no public setter for a live group's timeout; this is
    the private one torchtitan uses, applied to every group (world, mesh dimensions, flattened
    and checkpoint groups), since sub-groups do not inherit the world group's timeout.
    """
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


_PEER_SIGNS = {
    "Timed out waiting": "stopped answering",  # gloo: a peer is alive but not calling the collective
    "Connection closed by peer": "closed its connection (it died or was killed)",
    "Connection reset by peer": "closed its connection (it died or was killed)",
    "Connection refused": "closed its connection (it died or was killed)",
}


def peer_failure(e: BaseException) -> str:
    """What a collective's error says a peer rank did ('stopped answering', ...), or '' for any other error.

    The error may be the cause of e: torch.distributed.pipelining wraps a stage's failed forward or backward (an FSDP
    all-gather, a gradient reduction inside it) in a RuntimeError of its own ('[Stage 0] failed to run forward')
    raised from the collective's.
    """
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError):  # torch.distributed.DistError is one too
            for sign, what in _PEER_SIGNS.items():
                if sign in str(e):
                    return what
        e = e.__cause__
    return ""


def finish_distributed() -> None:
    """Leave the process groups together: a barrier on every group this rank is in, then destroy.

    Without the barriers, a rank that finishes its last gloo collective first can close its
    connections while a peer's gloo thread still uses them, and the peer aborts on exit
    ("terminate called without an active exception") after its work is done. The world's
    barrier alone does not order the other groups' work (the mesh's dp, cp and tp groups run
    their own gloo pairs, and context parallelism's functional all-to-alls complete lazily),
    so each group gets its own, in creation order, which is the same on every rank.
    """
    for group in list(c10d._world.pg_map):
        dist.barrier(group=group)
    dist.destroy_process_group()


def abandon_distributed() -> None:
    """Destroy the process group after an error, without a barrier: a peer may never reach one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def on_rank0(fn, rank: int):
    """Run fn on rank 0 and share its result (collective); every rank raises the same error if it failed.

    A UserError on rank 0 becomes a SetupError with the same message on every rank.
    """
    box = [None, None]
    if rank == 0:
        try:
            box[0] = fn()
        except UserError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise SetupError(box[1])
    return box[0]


def gatherer(group=None):
    """all_gather(obj) -> [every rank's obj] over group (all_gather_object), for data preparation."""
    n = dist.get_world_size(group)

    def all_gather(obj):
        out = [None] * n
        dist.all_gather_object(out, obj, group=group)
        return out

    return all_gather


def long_timeout_group():
    """A new gloo group over every rank with LONG_TIMEOUT (collective); destroy it when done."""
    return dist.new_group(backend="gloo", timeout=LONG_TIMEOUT)


class StopFlag:
    """SIGTERM (preemption) or SIGINT (Ctrl-C) asks the run to stop after the current step.

    Ranks agree on it once per step, so all stop together. A second SIGINT more than
    REPEAT_S after the first aborts at once (KeyboardInterrupt), for a run that must not wait
    for its step; closer ones are the same Ctrl-C, which torchrun's agent forwards to its
    workers again right after the terminal delivered it.
    """

    REPEAT_S = 1.0

    def __init__(self):
        self.signum, self._first_sigint = 0, None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > self.REPEAT_S:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            self._first_sigint = self._first_sigint or now
        self.signum = self.signum or signum

    def any_rank(self) -> int:
        """The signal any rank got (the largest number), or 0 (collective: a CPU all-reduce, never a GPU sync)."""
        flag = torch.tensor([float(self.signum)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 avx512_bf16 or amx_bf16, Arm bf16); False if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def grad_norm_(params, max_norm: float, device: torch.device, across_stages=None) -> torch.Tensor:
    """Global L2 norm of the gradients of params (DTensors on any mesh, or plain tensors); clip in place.

    Each gradient's local squared sum is reduced over the mesh dimensions it is sharded on
    (replicated dimensions hold copies and are not summed), on `device` so CPU-offloaded
    gradients work with NCCL. Returns the pre-clip norm as a 0-dim fp32 tensor on device.
    Clipping (max_norm > 0) scales every gradient by min(1, max_norm / (norm + 1e-6)).
    across_stages: the group of the ranks running the model's other pipeline stages (None with one): they hold
    different parameters, so their squared sums are added up and every stage clips by the whole model's norm.
    """
    groups: dict[tuple, torch.Tensor] = {}
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, local = (g.device_mesh, dims), g.to_local()
        else:
            key, local = (None, ()), g
        sq = local.detach().float().pow(2).sum().to(device)
        groups[key] = groups[key] + sq if key in groups else sq
    total = torch.zeros((), device=device)
    for (mesh, dims), sq in groups.items():
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))
        total = total + sq
    if across_stages is not None:
        dist.all_reduce(total, group=across_stages)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device))
    return norm
