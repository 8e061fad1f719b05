"""The sampling rule of a data mixture: which source and which of its windows each global sample is.

Everything here is a pure function of the seed, the weight schedule and counters that the
loader's DataState holds, so a global batch is the same at every world size and a resume
needs nothing but that state:

- Counts: global batch k takes ``batch_counts(B, weights at k, k)`` samples of each source:
  floor(B * w / sum(w)) or one more, the units left over after the floors going to the
  sources by their remainders as in the largest-remainder method, but in turn rather than
  always to the same ones (systematic apportionment with a golden-ratio offset per batch,
  no coin per sample). So every batch is within one sample of the weights, and the shares
  over many batches converge to the weights (the largest-remainder rule alone would give
  a remainder of 0.8 the extra sample in every batch: 5 of 16 for a weight of 0.3).
- Within a source: the source's own sample cursor walks its epochs, each a permutation
  of its training windows seeded by (seed, source name, epoch), so a source that runs out
  starts its next epoch, reshuffled, on its own, whatever the other sources do.
- Order: the batch's samples (sources in order) are shuffled by a permutation seeded by
  (seed, k), so every micro-batch and every rank's slice mixes the sources.
"""
from __future__ import annotations

import hashlib
from fractions import Fraction
from typing import TypeVar

import torch

GOLDEN = Fraction(6180339887498949, 10 ** 16)
"""(sqrt(5) - 1) / 2 to 16 digits: the offsets k * GOLDEN mod 1 spread evenly over [0, 1) for k = 0, 1, 2, ..."""


def batch_counts(total: int, weights: list[float], step: int) -> list[int]:
    """Split total (an int >= 0) into integers proportional to weights (floats >= 0, sum > 0) for batch `step`.

    Each count is floor(q) or floor(q) + 1 of its quota q = total * w / sum(w), and they sum
    to total. The L units left after the floors go to the sources whose remainder intervals
    (laid end to end on [0, L)) hold the points u, u + 1, ..., u + L - 1, with u = step *
    GOLDEN mod 1 (systematic sampling): a source with remainder r gets its extra unit in a
    fraction r of the batches, evenly spread, so the realised shares converge to the weights
    (after n batches each source is off by O(log n) samples in all). Exact rational
    arithmetic, so the split is the same on every machine. Returns a list of ints.
    """
    exact = [Fraction(w) for w in weights]
    norm = sum(exact)
    quotas = [total * w / norm for w in exact]
    counts = [int(q) for q in quotas]  # floor: quotas are >= 0
    point, edge = (step * GOLDEN) % 1, Fraction(0)
    for i, q in enumerate(quotas):
        edge += q - counts[i]  # source i's remainder is [edge - r, edge)
        if point < edge:  # at most one point in an interval shorter than 1
            counts[i] += 1
            point += 1
    return counts


def weight_shares(weights: list[float]) -> list[float]:
    """Each weight's share of their sum (floats >= 0, one > 0): w / sum(weights), summing to 1.

    Divides by the largest weight first, so weights near the largest float (whose sum
    overflows to inf) still give finite shares.
    """
    top = max(weights)
    scaled = [w / top for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


def most_per_batch(total: int, weights: list[float]) -> list[int]:
    """The most samples of each source one batch_counts(total, weights, step) can hold: ceil of its quota."""
    norm = sum(Fraction(w) for w in weights)
    return [-(-total * Fraction(w) // norm) for w in weights]


T = TypeVar("T")


def stage_at(schedule: list[tuple[int, T]], step: int) -> T:
    """The value of the last stage in schedule [(start_step, value)] (sorted, the first at 0) with start_step <= step.

    The rule of [[data.stages]] (value: the weights) and [[train.batch_stages]] (value: the global
    batch): start_step counts the optimizer steps done before the stage.
    """
    current = schedule[0][1]
    for start, value in schedule:
        if start <= step:
            current = value
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
