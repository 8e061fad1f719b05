"""Pretrain a Llama model on a 2D mesh: tensor + sequence parallel inside a node, FSDP2 across.

    torchrun --standalone --nproc_per_node=N train_2d.py --config configs/debug.toml --run_dir DIR --parallel.tp T

The mesh is ("dp", "tp") of shape (N / T, T), or with --parallel.dp_replicate R (HSDP)
("dp_replicate", "dp_shard", "tp") of (R, N / (R T), T), with a "cp" dimension before "tp" under
--parallel.cp C (each CP rank's slice of the sequence is then split over its TP group, and
Ulysses splits the TP rank's heads over "cp"); consecutive ranks form a TP group,
so with torchrun's node-by-node rank order a TP group stays inside one node (checked against
LOCAL_WORLD_SIZE). Each block is split by the plan below (Megatron-style column/row-parallel
linears, sequence-parallel norms and residual stream), then parallelize.py shards the result
with ``fully_shard`` on the data-parallel sub-mesh,
and training/ runs the same loop as train_fsdp.py (with ``loss_parallel`` on the
vocabulary-sharded logits); checkpoints hold the same keys as train_fsdp.py's and load
into either.

Parameters become DTensors on the "tp" mesh: column-parallel weights Shard(0), row-parallel
ones Shard(1), the embedding Shard(0) (vocabulary rows), norm weights Replicate. The
gradients of replicated norm weights are partial sums over the TP group (each rank saw a
slice of the sequence); FSDP2 redistributes them to Replicate (an all-reduce over TP)
before its reduce-scatter over "dp".
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from config import Config
from core.cli import exit_command
from core.errors import SetupError
from training import command

# Between blocks the residual stream is sharded on the sequence (Shard(1), a plain local
# tensor of shape (batch, seq / tp, dim)); the norms run on that shard and their weights
# are replicated. Attention and the MLP need the whole sequence, so their input is
# all-gathered; wo/w2 reduce-scatter their partial sums back to sequence shards. Attention's
# cos/sin tables and its document mask are plain values every rank holds whole (layout None):
# each TP rank gets the whole token batch and derives them itself.
PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "layers.*.attention_norm": SequenceParallel(),
    "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                             desired_input_layouts=(Replicate(), None, None, None)),
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "layers.*.ffn_norm": SequenceParallel(),
    "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w3": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    # Logits stay sharded on the vocabulary (a DTensor, Shard(-1)): loss_parallel computes
    # the cross-entropy without gathering (batch, seq, vocab) on any rank.
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}


def check_tp_layout(cfg: Config, world_size: int) -> None:
    """Checks of PLAN's layout that need no collective (run before anything is created).

    Raises SetupError, naming the numbers and the fix, when a size the plan splits evenly
    over the TP ranks is not divisible by parallel.tp (model.n_heads, model.n_kv_heads,
    model.ffn_dim, data.seq_len). The mesh's own checks (world size, a TP group inside a
    node) are parallel/layout.Layout.check's, run by config.validate.
    """
    tp, m = cfg.parallel.tp, cfg.model
    # Left unchecked, each of these fails only later, inside a collective or a matmul on one rank.
    split = {
        "model.n_heads": (m.n_heads, "each TP rank must hold whole query heads"),
        "model.n_kv_heads": (m.n_kv_heads, "each TP rank must hold whole key/value heads"),
        "model.ffn_dim": (m.ffn_dim, "w1/w3 columns and w2 rows are split evenly"),
        "data.seq_len": (cfg.data.seq_len, "sequence parallelism splits every sequence evenly"),
    }
    for name, (size, why) in split.items():
        if size % tp:
            valid = [d for d in range(1, m.n_kv_heads + 1) if all(v % d == 0 for v, _ in split.values())]
            raise SetupError(
                f"{name} ({size}) is not divisible by parallel.tp ({tp}): {why}; use parallel.tp in {valid} "
                f"or change {name}"
            )


def main(argv: list[str] | None = None) -> int:
    """Train with PLAN inside each TP group and FSDP2 across; exit status 0, or 2 with one line on bad input."""
    return command.main(argv, tp_plan=PLAN, check_layout=check_tp_layout, description=__doc__)


if __name__ == "__main__":
    exit_command(main())
