"""The loader: the global-cursor mixture loader of training batches, read from data.PackedCorpus.

The held-out windows and their loss are validation.py's.

Determinism across world sizes: the loader keeps a global position (DataState: samples and
batches drawn, and each source's count). The global batch of step k is a function of that
state and the seed alone (mixture.py has the rule), whatever the world size; data-parallel
rank r takes the r-th contiguous slice. The state is all a checkpoint needs.

Skips ([[train.skip]], and the ranges a rollback adds to DataState.skips) name batches by the
data's own step, 1-based: batch k is the one drawn when DataState.steps goes from k - 1 to k.
The loader moves the cursor past a skipped batch as if it had drawn it (its stage's size and
weights, each source's share), so everything after it is the batch a run without the skip
would have drawn there.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from data import DEFAULT_SOURCE, DataError, PackedCorpus
from data_pipeline import mixture


@dataclasses.dataclass
class DataState:
    """Loader position, global and world-size independent (the same on every rank)."""

    consumed_samples: int = 0
    """Samples drawn since the start, all sources together."""
    steps: int = 0
    """Global batches drawn (it picks the stage of the weight schedule and seeds the batch's order)."""
    source_samples: dict[str, int] = dataclasses.field(default_factory=dict)
    """Samples drawn from each source: its cursor through its own epochs."""
    skips: list[list[int]] = dataclasses.field(default_factory=list)
    """[start, end] ranges of batches (data steps, 1-based) that automatic rollbacks skipped, in order."""


def merge_ranges(ranges) -> list[list[int]]:
    """The union of inclusive integer ranges [(start, end)], as sorted, disjoint, non-adjacent [start, end] lists."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class GlobalBatchLoader:
    """Yields this rank's micro-batches of each global step of the mixture (see mixture.py for the rule).

    Global batch k holds mixture.batch_counts(B, weights at step k, k) samples of each
    source, each source's next ones in its own seeded epochs, shuffled by (seed, k). Rank r of
    dp_size takes the contiguous slice [r*B/dp, (r+1)*B/dp) and splits it into micro-batches.
    With one source this is exactly the loader before mixtures: samples [k*B, (k+1)*B) of
    the epochs' permutations (torch.randperm(n_train) seeded with seed + epoch), unshuffled.
    """

    def __init__(self, corpus: PackedCorpus, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, state: DataState | None = None,
                 batch_stages: list[tuple[int, int]] = (), skips: list[tuple[int, int]] = ()):
        """batch_stages: [(start_step, global_batch_size)] after step 0 (train.batch_stages), a batch ramp;
        micro_batch_size 0: each rank's whole share of the step's batch in one micro-batch; skips:
        [(start, end)] batches never drawn (train.skip_ranges(); a rollback adds to state.skips)."""
        self.schedule = [(0, global_batch_size), *batch_stages]
        for _, batch in self.schedule:
            if batch % (dp_size * (micro_batch_size or 1)) or (micro_batch_size == 0 and batch < dp_size):
                raise DataError(
                    f"train.global_batch_size ({batch}) must be divisible by data-parallel size "
                    f"({dp_size}) x train.micro_batch_size ({micro_batch_size})"
                )
        largest = max(batch for _, batch in self.schedule)
        for i, src in enumerate(corpus.sources):
            most = max(mixture.most_per_batch(largest, w)[i] for _, w in corpus.schedule)
            if src.n_train < most:
                what = "data.dataset" if src.name == DEFAULT_SOURCE else f"data.sources[{src.name}]"
                raise DataError(
                    f"{what}: only {src.n_train} training sequences of {corpus.seq_len} tokens, but one global batch "
                    f"of {largest} sequences (train.global_batch_size, or its largest batch stage) draws up to {most} "
                    f"from it; use more text, a shorter data.seq_len, a smaller batch or a smaller weight"
                )
        self.corpus = corpus
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.state = state or DataState()
        self.config_skips = list(skips)
        self._perms: dict[str, tuple[int, np.ndarray]] = {}

    def _upgrade(self) -> None:
        # A checkpoint from before mixtures holds only consumed_samples, all drawn from the one source it had.
        st = self.state
        if st.consumed_samples and not st.steps and not st.source_samples:
            st.source_samples = {DEFAULT_SOURCE: st.consumed_samples}
            st.steps = st.consumed_samples // self.schedule[0][1]  # those runs had no batch stages

    @property
    def global_batch_size(self) -> int:
        """Sequences in the next global batch (the batch stage of the next step)."""
        return mixture.stage_at(self.schedule, self.state.steps)

    def _index(self, source: int, g: int) -> int:
        src = self.corpus.sources[source]
        epoch, i = divmod(g, src.n_train)
        if self._perms.get(src.name, (-1,))[0] != epoch:
            perm = mixture.epoch_permutation(src.n_train, self.seed, src.name, epoch, src.name == DEFAULT_SOURCE)
            self._perms[src.name] = (epoch, perm.numpy())
        return int(self._perms[src.name][1][i])

    def counts(self) -> list[int]:
        """Samples of each source in the next global batch (corpus.sources order)."""
        weights = mixture.stage_at(self.corpus.schedule, self.state.steps)
        return mixture.batch_counts(self.global_batch_size, weights, self.state.steps)

    def skipped(self) -> list[list[int]]:
        """Every skipped range, [[train.skip]] and rollbacks' together, merged: [[start, end]] in order."""
        return merge_ranges([*self.config_skips, *map(tuple, self.state.skips)])

    def next_data_step(self) -> int:
        """The data step (1-based) of the next batch drawn, past every skipped range."""
        step = self.state.steps + 1
        for a, b in self.skipped():
            if a <= step <= b:
                step = b + 1
        return step

    def drawn(self, n: int) -> list[int]:
        """The data steps (1-based) of the last n batches drawn, oldest first (fewer if fewer were drawn)."""
        skipped, out, step = self.skipped(), [], self.state.steps
        while step >= 1 and len(out) < n:
            if not any(a <= step <= b for a, b in skipped):
                out.append(step)
            step -= 1
        return out[::-1]

    def _skip_ahead(self) -> None:
        """Move the cursor past the skipped batches in front of it, each as if drawn (one source: in one jump per
        batch stage; a mixture draws each batch's split, so batch by batch)."""
        self._upgrade()
        st, target = self.state, self.next_data_step() - 1  # the data steps before the next drawn are skipped
        if len(self.corpus.sources) == 1:
            while st.steps < target:
                later = [start for start, _ in self.schedule if start > st.steps]
                n = min([target, *later]) - st.steps  # batches of this stage's size
                name = self.corpus.names[0]
                st.source_samples[name] = st.source_samples.get(name, 0) + n * self.global_batch_size
                st.consumed_samples += n * self.global_batch_size
                st.steps += n
            return
        while st.steps < target:
            for name, count in zip(self.corpus.names, self.counts()):
                st.source_samples[name] = st.source_samples.get(name, 0) + count
            st.consumed_samples += self.global_batch_size
            st.steps += 1

    def global_indices(self) -> list[tuple[int, int]]:
        """The next global batch as [(source number, window index)], in batch order (the cursor does not move
        except past skipped batches)."""
        self._skip_ahead()
        pairs = []
        for s, count in enumerate(self.counts()):
            start = self.state.source_samples.get(self.corpus.names[s], 0)
            pairs += [(s, self._index(s, g)) for g in range(start, start + count)]
        if len(self.corpus.sources) > 1:
            pairs = [pairs[i] for i in mixture.batch_order(len(pairs), self.seed, self.state.steps)]
        return pairs

    def rank_indices(self) -> list[tuple[int, int]]:
        """This rank's slice of the next global batch, [(source number, window index)] (the cursor does not move)."""
        pairs = self.global_indices()  # past the skipped batches first: they set the batch size
        per_rank = len(pairs) // self.dp_size
        return pairs[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches [(inputs, labels)] of the next global step, each (mb, seq_len) int64.

        Advances the global cursor: consumed_samples by global_batch_size, steps by one, each
        source's count by its share of the batch.
        """
        idx = self.rank_indices()  # past the skipped batches first
        batch = self.global_batch_size
        st = self.state
        for name, count in zip(self.corpus.names, self.counts()):
            st.source_samples[name] = st.source_samples.get(name, 0) + count
        st.consumed_samples += batch
        st.steps += 1
        return self.corpus.batches(idx, self.micro_batch_size or len(idx))

    @property
    def epoch(self) -> int:
        """The furthest epoch any source is in (with one source: its epoch)."""
        self._upgrade()
        return max(self.state.source_samples.get(s.name, 0) // s.n_train for s in self.corpus.sources)

    def source_tokens(self) -> dict[str, int]:
        """{'tokens/<name>': training tokens drawn from that source} for a mixture of 2+ sources, else {}."""
        if len(self.corpus.sources) < 2:
            return {}
        return {f"tokens/{n}": self.state.source_samples.get(n, 0) * self.corpus.seq_len for n in self.corpus.names}
