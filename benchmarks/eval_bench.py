"""What in-loop downstream evaluation costs: one scoring of N examples against one training step.

    torchrun --standalone --nproc_per_node=2 benchmarks/eval_bench.py --config configs/debug.toml \\
        --run_dir runs/debug [--examples 200] [--repeats 3]

--run_dir: a prepared run directory (its data/tokenizer.json tokenizes the task). The task
is synthetic, shaped like HellaSwag: a 40-word context and 4 choices of 8 to 20 words, from
the standard library's text. Times (wall, medians of --repeats after one warm-up) one
training step of the run's global batch (train_step on random tokens) and one
downstream.evaluate_tasks over the examples, sharded as in the loop, in turn, and prints from
rank 0 their ratio and the share of training time it takes at eval.interval 50, 200 and 1000.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from data import inputs_labels  # noqa: E402
from data_pipeline import sources  # noqa: E402
from evaluation import downstream  # noqa: E402
from parallel import (
    distributed,  # noqa: E402
    layout,  # noqa: E402
)
from storage.rundir import RunDir  # noqa: E402
from training.step import build_trainable, train_step  # noqa: E402


def _flag(argv: list[str], name: str, default: int) -> int:
    if name in argv:
        i = argv.index(name)
        value = int(argv[i + 1])
        del argv[i:i + 2]
        return value
    return default


def _task_file(n: int) -> str:
    words = " ".join(open(f, errors="replace").read() for f in sources.stdlib_files()[:30]).split()
    path = os.path.join(tempfile.mkdtemp(), "bench_task.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            at = i * 211 % (len(words) - 400)
            choices = [" ".join(words[at + 40 + 50 * k:at + 48 + 50 * k + (i + k) % 13]) for k in range(4)]
            f.write(json.dumps({"context": " ".join(words[at:at + 40]), "choices": choices, "gold": i % 4}) + "\n")
    return path


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    argv = sys.argv[1:]
    n, repeats = _flag(argv, "--examples", 200), _flag(argv, "--repeats", 3)
    cfg = config.parse_config(argv, description=__doc__)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = layout.build_mesh(device, world)
    dp = mesh.data
    tr = build_trainable(cfg, rank, mesh, device)
    micro = cfg.train.micro_batch(dp.size())
    accum = cfg.train.global_batch_size // (micro * dp.size())
    batch = [inputs_labels(torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_len + 1)))] * accum
    task = downstream.EvalConfig(limit=n, tasks=[downstream.TaskConfig(name="bench", dataset=_task_file(n))])
    tasks = distributed.on_rank0(lambda: downstream.load_tasks(task, RunDir(cfg.run_dir).tokenizer,
                                                               cfg.model.max_seq_len), rank)

    def score():
        downstream.evaluate_tasks(tr.runner, tasks, dp.get_local_rank(), dp.size(), dp.get_group(),
                                  micro * cfg.data.seq_len)

    # Interleaved, one warm-up of each first: a busy spell of the machine slows both alike.
    times = [(_timed(lambda: train_step(tr, batch)), _timed(score)) for _ in range(repeats + 1)][1:]
    step, scoring = (statistics.median(t[i] for t in times) for i in (0, 1))
    if rank == 0:
        tokens = sum(len(r.tokens) for r in tasks[0].requests)
        print(f"{world} rank(s), {cfg.model.n_layers} layers dim {cfg.model.dim}, global batch "
              f"{cfg.train.global_batch_size} x {cfg.data.seq_len}: training step {step:.3f} s; {n} examples "
              f"({len(tasks[0].requests)} requests, {tokens} tokens): {scoring:.3f} s = {scoring / step:.2f} steps; "
              + ", ".join(f"interval {i}: {scoring / (i * step):.2%} of training time" for i in (50, 200, 1000)))
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
