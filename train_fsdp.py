"""Pretrain a Llama model with FSDP2 (``fully_shard``) on one data-parallel mesh.

    torchrun --standalone --nproc_per_node=N train_fsdp.py --config configs/debug.toml --run_dir DIR

Every rank holds a 1/N shard of each parameter, gradient and optimizer state; each block's
parameters are gathered for its forward and backward. With --parallel.dp_replicate R (HSDP,
for R nodes) the mesh is ("dp_replicate", "dp_shard"): parameters are sharded over the N / R
ranks of a node and replicated across nodes, so the all-gathers stay inside a node and only
the gradients' all-reduce crosses nodes. With --parallel.cp C each sequence is split over C
ranks (Ulysses attention, parallel/context_parallel.py) and FSDP shards over the data-parallel and CP
ranks together (docs/long_context.md). Running the same command again
resumes from the newest complete checkpoint in DIR/checkpoints, at any world size.
`--help` lists every config field. The loop itself is in training/ (loop.py; the step is step.py).
"""
from __future__ import annotations

from core.cli import exit_command
from training import command


def main(argv: list[str] | None = None) -> int:
    """Train with FSDP2 only; exit status 0, or 2 with one line 'error: ...' on bad input."""
    return command.main(argv, description=__doc__)


if __name__ == "__main__":
    exit_command(main())
