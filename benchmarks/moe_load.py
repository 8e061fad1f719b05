"""How evenly a trained mixture of experts spreads its tokens: per micro-batch, and over many windows pooled.

    python benchmarks/moe_load.py --run_dir RUN [--checkpoint CKPT] [--windows 4096] [--micro_batch_size 16]

One process. Runs the run's checkpoint forward (no gradients) over --windows training windows drawn at random
(seed 0, the same for every run of one corpus) in micro-batches of --micro_batch_size, and counts the tokens each
MoE layer routes to each expert (the forward's own counts, MoE.counts, with the run's balancing bias). Prints, per
layer:

    per batch  the busiest expert's tokens over the mean, averaged over the micro-batches: what the train
               records' moe_max_load reports at that batch size (over the layers, the largest)
    pooled     the same over all the windows' counts summed, and the idlest expert's: the balance the bias
               update steers toward, without the scatter of which documents one batch happens to hold

A per-batch figure well above the pooled one is batch-to-batch variation (tokens of one document choose alike),
which no per-expert bias removes; the pooled one is the routing's own imbalance.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import load_run  # noqa: E402
from data import PackedCorpus  # noqa: E402
from evaluate import eval_config, load_model, prepared_data, split_windows  # noqa: E402
from nn.moe import moe_layers  # noqa: E402
from parallel import distributed  # noqa: E402
from parallel.layout import build_mesh  # noqa: E402


def load_table(run_dir: str, checkpoint: str = "", windows: int = 4096, micro_batch_size: int = 16) -> list[dict]:
    """[{"layer", "per_batch", "pooled_max", "pooled_min"}] of run_dir's MoE layers (see the module's docstring).
    Raises the trainer's UserError for a run without a checkpoint or an MoE."""
    run_cfg, path, tokenizer = load_run(run_dir, checkpoint)
    cfg = eval_config(run_cfg, run_dir, [])
    if not cfg.model.n_experts:
        raise SystemExit(f"error: {run_dir} is a dense run (model.n_experts 0): there is no expert load to measure")
    rank, world, device = distributed.init_distributed(cfg.train.device)
    try:
        corpus = PackedCorpus(prepared_data(cfg, run_cfg, run_dir, tokenizer), cfg.data)
        pairs = split_windows(corpus, "train")
        random.Random(0).shuffle(pairs)
        model = load_model(cfg, path, build_mesh(device, world), device)
        layers = moe_layers(model)
        per_batch = [[] for _ in layers]
        pooled = torch.zeros(len(layers), cfg.model.n_experts, dtype=torch.int64)
        with torch.no_grad():
            for inputs, _ in corpus.batches(pairs[:windows], micro_batch_size):
                model(inputs.to(device))
                for i, moe in enumerate(layers):
                    counts = moe.counts.cpu()
                    pooled[i] += counts
                    per_batch[i].append((counts.max() / counts.float().mean()).item())
        distributed.finish_distributed()
    finally:
        distributed.abandon_distributed()
    mean = pooled.float().mean(1)
    return [{"layer": i, "per_batch": sum(b) / len(b), "pooled_max": (pooled[i].max() / mean[i]).item(),
             "pooled_min": (pooled[i].min() / mean[i]).item()} for i, b in enumerate(per_batch)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--checkpoint", default="", help="a checkpoint directory (default: the run's newest)")
    parser.add_argument("--windows", type=int, default=4096, help="training windows to route, drawn at random")
    parser.add_argument("--micro_batch_size", type=int, default=16, help="windows per forward (the per-batch figure)")
    args = parser.parse_args(argv)
    for row in load_table(args.run_dir, args.checkpoint, args.windows, args.micro_batch_size):
        print(f"layer {row['layer']}: per batch of {args.micro_batch_size} max/mean {row['per_batch']:.2f}; "
              f"{args.windows} windows pooled max/mean {row['pooled_max']:.2f}, min/mean {row['pooled_min']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
