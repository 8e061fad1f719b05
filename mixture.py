"""The sampling rule of a data mixture: which source and which of its windows each global sample is.

Everything here is a pure function of the seed, the weight schedule and counters that the
loader's DataState holds, so a global batch is the same at every world size and a resume
needs nothing but that state:

- Counts: global batch k takes ``largest_remainder(B, weights at k)`` samples of each
  source: the integers nearest the weights (each within one sample of B * w / sum(w)),
  the same in every batch of a stage; never a coin per sample.
- Within a source: the source's own sample cursor walks its epochs, each a permutation
  of its training windows seeded by (seed, source name, epoch), so a source that runs out
  starts its next epoch, reshuffled, on its own, whatever the other sources do.
- Order: the batch's samples (sources in order) are shuffled by a permutation seeded by
  (seed, k), so every micro-batch and every rank's slice mixes the sources.
"""
from __future__ import annotations

import hashlib
from fractions import Fraction

import torch


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Split total (an int >= 0) into integers proportional to weights (floats >= 0, sum > 0).

    Each count is floor(total * w / sum) or one more; the leftover units go to the largest
    remainders, ties to the lower index (Hamilton's method). Exact rational arithmetic, so
    the split is the same on every machine. Returns a list of ints summing to total.
    """
    exact = [Fraction(w) for w in weights]
    norm = sum(exact)
    shares = [total * w / norm for w in exact]
    counts = [int(s) for s in shares]  # floor: shares are >= 0
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def weights_at(schedule: list[tuple[int, list[float]]], step: int) -> list[float]:
    """The weights of the last stage in schedule [(start_step, weights)] (sorted, the first at 0) with start_step <= step."""
    current = schedule[0][1]
    for start, weights in schedule:
        if start <= step:
            current = weights
    return current


def derived_seed(*parts) -> int:
    """A 63-bit seed from any tuple of ints and strings (blake2b of its repr): independent streams per purpose."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def epoch_permutation(n: int, seed: int, name: str, epoch: int, legacy: bool = False) -> torch.Tensor:
    """Epoch `epoch`'s order of a source's n training windows: a torch.randperm(n) (int64).

    legacy: the one-source order of the code before mixtures (randperm seeded with seed +
    epoch), kept for the default source so a run prepared and checkpointed then resumes onto
    the very batches it would have drawn.
    """
    gen = torch.Generator().manual_seed(seed + epoch if legacy else derived_seed(seed, "epoch", name, epoch))
    return torch.randperm(n, generator=gen)


def batch_order(size: int, seed: int, step: int) -> list[int]:
    """The shuffle of global batch `step` (0-based): a permutation of range(size) seeded by (seed, step)."""
    gen = torch.Generator().manual_seed(derived_seed(seed, "batch", step))
    return torch.randperm(size, generator=gen).tolist()
