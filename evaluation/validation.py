"""Validation: which windows each rank evaluates, and the forward-only loss over them.

One rule serves the trainer's ``val_loss`` and ``evaluate.py``: the windows to evaluate are
split into contiguous rank shares (``rank_share``); every rank runs as many forward passes as
the largest share needs, since FSDP gathers parameters collectively in each, and a rank with
fewer repeats its last batch and discards the loss. Every window is counted exactly once, so
the figure is the same at every world size and layout.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from data import PackedCorpus
from nn.loss import scalar
from parallel.context_parallel import shard_batch


def rank_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi): rank's contiguous share of n items over world ranks (shares differ by at most one)."""
    return n * rank // world, n * (rank + 1) // world


@dataclasses.dataclass
class ValSet:
    """One source's (or one split's) windows to evaluate, as this rank runs them."""

    name: str
    batches: list
    """This rank's [(inputs, labels)], each (<= micro_batch_size, seq_len) int64."""
    n_windows: int
    """Windows over all ranks."""
    n_forward: int = 0
    """Forward passes every rank runs: the largest rank share's batch count."""


def val_set(corpus: PackedCorpus, name: str, windows: list, micro_batch_size: int, dp_rank: int,
            dp_size: int) -> ValSet:
    """This rank's share of windows [(source number, window index)] (see rank_share) as a ValSet."""
    lo, hi = rank_share(len(windows), dp_rank, dp_size)
    largest = -(-len(windows) // dp_size)
    return ValSet(name, corpus.batches(windows[lo:hi], micro_batch_size), len(windows),
                  -(-largest // micro_batch_size))


def val_batches(corpus: PackedCorpus, max_sequences: int, micro_batch_size: int, dp_rank: int,
                dp_size: int) -> list[ValSet]:
    """Training's validation sets: per source, the first max_sequences windows of its held-out tail.

    A source with fewer held-out windows than dp_size is left out (some rank would only
    repeat another's batch).
    """
    out = []
    for s, src in enumerate(corpus.sources):
        n = min(src.n_val, max_sequences)
        if n >= dp_size:
            windows = [(s, i) for i in range(src.n_train, src.n_train + n)]
            out.append(val_set(corpus, src.name, windows, micro_batch_size, dp_rank, dp_size))
    return out


def val_record(losses: dict[str, float], sets: list[ValSet]) -> dict:
    """A validation record from each source's mean token loss: val_loss over the mixture, val_loss/<name> per source.

    val_loss is the mean token loss over every evaluated window of every source (each
    source weighs by its windows, not by its mixture weight, so the figure does not jump at a
    stage). With one source it is that source's loss, and no per-source key is written.
    """
    if len(sets) == 1:
        val = losses[sets[0].name]
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50))}
    val = sum(losses[v.name] * v.n_windows for v in sets) / sum(v.n_windows for v in sets)
    return {"val_loss": val, "val_ppl": math.exp(min(val, 50)), **{f"val_loss/{k}": x for k, x in losses.items()}}


def reshard(roots: list[torch.nn.Module]) -> None:
    """Free the parameters that forward passes left gathered (every FSDP module under roots resharded).

    With parallel.reshard_after_forward false a forward-only pass (validation, downstream
    scoring) keeps them gathered until the next backward, which would hold the unsharded
    model through the training step that follows. roots: a runner's modules (parallel/runner.py):
    the model, and the stages that are FSDP roots of their own when a rank runs several.
    """
    # Stages share the model's blocks (and a single stage is the model): each module once.
    for m in dict.fromkeys(m for root in roots for m in root.modules()):
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def loss_sum_and_count(runner, vs: ValSet, dp_group) -> tuple[float, int]:
    """(sum of token losses in nats, number of targets) over every rank's share of vs (collective over dp_group).

    runner: this rank's (parallel/runner.py), which gives training's loss forward only (fp32
    cross-entropy, chunked as applied; under no_grad the chunked loss computes no gradient).
    Under CP each rank scores its slice of every window (context_parallel.shard_batch), and
    dp_group must be the loss ranks' (layout.Mesh.loss: data-parallel x CP) so that every slice
    is counted once. Every rank runs vs.n_forward passes; with several stages each batch
    runs stage after stage and the last stage's sums reach every stage. Afterwards each FSDP
    module is resharded, so that with parallel.reshard_after_forward false the parameters a
    forward left gathered are freed now, not at the next backward. The model is left in train mode.
    """
    model, mesh, device = runner.model, runner.mesh, runner.device
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    spare = (torch.zeros(1, mesh.size("cp"), dtype=torch.long),) * 2  # for a rank with no window at all
    for i in range(vs.n_forward):
        inputs, labels = vs.batches[min(i, len(vs.batches) - 1)] if vs.batches else spare
        inputs, labels, layout = shard_batch(model, inputs.to(device), labels.to(device), mesh.cp)
        loss = runner.forward_loss(inputs, labels, layout)
        if i < len(vs.batches) and runner.holds_loss:
            total[0] += scalar(loss).double()
            total[1] += labels.numel()
    reshard(runner.modules)
    model.train()
    runner.sum_over_stages(total)
    dist.all_reduce(total, group=dp_group)
    return total[0].item(), int(total[1].item())
