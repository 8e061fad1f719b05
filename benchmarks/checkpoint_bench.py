"""Checkpoint save/load time and size, and how long the loop waits with async saves.

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_bench.py --config configs/debug.toml \\
        --run_dir /tmp/ckpt_bench [--model.preset llama_125m --data.seq_len 128] [--repeats 3]

Builds the run's model and optimizer (synthetic step, no data pipeline), then per repeat:
a synchronous save, a load, and an asynchronous save of which it times the part the loop
blocks for (staging to CPU) and the whole write. Prints medians (min..max) from rank 0.
Seconds are wall time; sizes are bytes on disk of one checkpoint.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import distributed  # noqa: E402
import parallelize  # noqa: E402
import trainer  # noqa: E402
from checkpoint import AppState  # noqa: E402
from data import inputs_labels  # noqa: E402
from loader import DataState  # noqa: E402
from model import num_params  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}..{max(xs):.3f})"


def main() -> None:
    argv = sys.argv[1:]
    repeats = 3
    if "--repeats" in argv:
        i = argv.index("--repeats")
        repeats = int(argv[i + 1])
        del argv[i:i + 2]
    cfg = config.parse_config(argv, description=__doc__)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = parallelize.build_mesh(device, world)
    tr = trainer.build_trainable(cfg, rank, mesh, device)
    # One synthetic step of the trainer's own so the optimizer state exists and is written.
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.data.seq_len + 1), device=device)
    trainer.train_step(tr, [inputs_labels(tokens)])
    app = AppState(tr.model, tr.optimizer, tr.scheduler, tr.train_state, DataState(), rank)
    root = os.path.join(cfg.run_dir, "bench_ckpt")
    gloo = dist.new_group(backend="gloo")
    # As checkpoint.Checkpointer does: one stager whose CPU copy is reused by every save.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    saves, loads, blocked, async_total, size = [], [], [], [], 0
    for r in range(repeats):
        path = os.path.join(root, f"sync{r}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"app": app}, checkpoint_id=path)
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        size = _dir_bytes(path)
        t0 = time.perf_counter()
        dcp.load({"app": app}, checkpoint_id=path)
        dist.barrier()
        loads.append(time.perf_counter() - t0)
        path = os.path.join(root, f"async{r}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save({"app": app}, checkpoint_id=path, process_group=gloo, async_stager=stager)
        blocked.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
        async_total.append(time.perf_counter() - t0)
    if rank == 0:
        n_params = num_params(cfg.model)
        print(f"model {n_params / 1e6:.1f}M params, world {world}, checkpoint {size / 2 ** 20:.1f} MiB on disk")
        print(f"sync save   {_fmt(saves)}")
        print(f"load        {_fmt(loads)}")
        print(f"async save  loop blocked {_fmt(blocked)}, written after {_fmt(async_total)}")
        frac = statistics.median(blocked) / statistics.median(saves)
        print(f"async: the loop waits {frac:.0%} of a synchronous save")
        shutil.rmtree(root, ignore_errors=True)
    stager.close()
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
