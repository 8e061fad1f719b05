"""Checkpoint save/load time and size, and how long the loop waits with async saves.

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_bench.py --config configs/debug.toml \\
        --run_dir /tmp/ckpt_bench [--model.preset llama_125m --data.seq_len 128] [--repeats 3] \\
        [--url s3://BUCKET/PREFIX ...]

Builds the run's model and optimizer (synthetic step, no data pipeline), then, for the local
disk (RUN_DIR/bench_ckpt) and each --url (an object store, reached through the AWS_*
variables as checkpoint.dir is), per repeat: a synchronous save, a load, and an asynchronous
save of which it times the part the loop blocks for (staging to CPU) and the whole write.
Prints medians (min..max) from rank 0, one line per target. Seconds are wall time; the size
is the bytes of one checkpoint on disk, and MiB/s that size over the synchronous save.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from checkpoint import AppState  # noqa: E402
from data import inputs_labels  # noqa: E402
from data_pipeline.loader import DataState  # noqa: E402
from model import num_params  # noqa: E402
from parallel import (
    distributed,  # noqa: E402
    layout,  # noqa: E402
)
from storage import fs  # noqa: E402
from training.step import build_trainable, train_step  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s ({min(xs):.3f}..{max(xs):.3f})"


def time_target(app: AppState, root: str, repeats: int, gloo, stager) -> tuple[list[float], ...]:
    """(sync save s, load s, async loop-blocked s, async written s), one entry per repeat, under root (path or URL)."""
    saves, loads, blocked, async_total = [], [], [], []
    for r in range(repeats):
        path = fs.join(root, f"sync{r}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"app": app}, checkpoint_id=path, storage_writer=fs.dcp_writer(path))
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load({"app": app}, checkpoint_id=path, storage_reader=fs.dcp_reader(path))
        dist.barrier()
        loads.append(time.perf_counter() - t0)
        path = fs.join(root, f"async{r}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save({"app": app}, checkpoint_id=path, storage_writer=fs.dcp_writer(path),
                             process_group=gloo, async_stager=stager)
        blocked.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
        async_total.append(time.perf_counter() - t0)
    return saves, loads, blocked, async_total


def main() -> None:
    argv = sys.argv[1:]
    repeats, urls = 3, []
    for flag in ("--repeats", "--url"):
        while flag in argv:
            i = argv.index(flag)
            if flag == "--repeats":
                repeats = int(argv[i + 1])
            else:
                urls.append(argv[i + 1])
            del argv[i:i + 2]
    cfg = config.parse_config(argv, description=__doc__)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = layout.build_mesh(device, world)
    tr = build_trainable(cfg, rank, mesh, device)
    # One synthetic step of the trainer's own so the optimizer state exists and is written.
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.data.seq_len + 1), device=device)
    train_step(tr, [inputs_labels(tokens)])
    app = AppState(tr.model, tr.optimizer, tr.scheduler, tr.train_state, DataState(), rank)
    targets = [os.path.join(cfg.run_dir, "bench_ckpt"), *urls]
    gloo = dist.new_group(backend="gloo")
    # As checkpoint.Checkpointer does: one stager whose CPU copy is reused by every save.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    rows = [time_target(app, root, repeats, gloo, stager) for root in targets]
    if rank == 0:
        n_params = num_params(cfg.model)
        size = _dir_bytes(os.path.join(targets[0], "sync0"))
        print(f"model {n_params / 1e6:.1f}M params, world {world}, checkpoint {size / 2 ** 20:.1f} MiB")
        for root, (saves, loads, blocked, async_total) in zip(targets, rows):
            rate = size / 2 ** 20 / statistics.median(saves)
            print(f"{root}: sync save {_fmt(saves)} ({rate:.0f} MiB/s) | load {_fmt(loads)} | async save: loop "
                  f"blocked {_fmt(blocked)}, written after {_fmt(async_total)} "
                  f"({statistics.median(blocked) / statistics.median(saves):.0%} of a sync save)")
    if rank == 0:
        for root in targets:
            fs.remove(root)
    stager.close()
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
