"""Start a training session from a Hugging Face Llama folder, as the trainer's init_from_hf does.

    torchrun --nproc_per_node=N tests/hf_import_worker.py --hf FOLDER --out FILE --config configs/debug.toml \
        --run_dir DIR [--section.field VALUE ...]

Builds the sharded session (build, no resume), loads the folder with
hf.load_hf_into(model, folder, copy_=parallelize.copy_sharded), then rank 0 saves with
torch.save a dict:

    max_diff   float        largest |full parameter - folder tensor| over all weights
    loss       float        mean token loss of the first global batch (forward only)
    inputs     LongTensor   that batch's inputs (global_batch_size, seq_len), all ranks' rows
    labels     LongTensor   its labels, same shape
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf  # noqa: E402
from config import parse_config  # noqa: E402
from nn.loss import token_loss_sum  # noqa: E402
from parallel import distributed  # noqa: E402
from parallel.parallelize import copy_sharded  # noqa: E402
from training.session import build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hf", required=True, help="Hugging Face Llama folder")
    parser.add_argument("--out", required=True, help="file that rank 0 writes")
    args, overrides = parser.parse_known_args()
    cfg = parse_config(overrides)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    s = build(cfg, rank, world, device, resume=False)
    hf.load_hf_into(s.model, args.hf, copy_=copy_sharded)

    params = dict(s.model.named_parameters())
    max_diff = 0.0
    for name, tensor in hf.iter_hf_tensors(args.hf):
        full = params[name].full_tensor().detach().cpu()
        max_diff = max(max_diff, (full - tensor.float()).abs().max().item())
    batches = s.loader.next_step()
    loss_sum = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for inputs, labels in batches:
            loss_sum += token_loss_sum(s.model, inputs, labels).double()
    dist.all_reduce(loss_sum)
    mine = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    every = [None] * world
    dist.all_gather_object(every, mine)
    inputs, labels = torch.cat([e[0] for e in every]), torch.cat([e[1] for e in every])
    if rank == 0:
        torch.save({"max_diff": max_diff, "loss": loss_sum.item() / labels.numel(), "inputs": inputs,
                    "labels": labels}, args.out)
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
