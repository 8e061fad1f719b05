"""Validation loss and perplexity, or downstream task scores, of a checkpoint, sharded with FSDP2 over torchrun ranks.

    torchrun --standalone --nproc_per_node=N evaluate.py --run_dir DIR [--checkpoint CKPT] \\
        [--split val|train|all] [--max_sequences N] [--micro_batch_size B] [--source NAME] [--data.dataset SRC ...]
    python evaluate.py --run_dir DIR            # one process
    python evaluate.py --run_dir DIR --tasks hellaswag,mine=tasks/mine.jsonl [--eval.limit 0]

Prints one JSON line: {"loss": mean token loss (nats), "ppl": exp(loss), "tokens": targets
counted, "sequences", "split", "checkpoint"}. The windows are data.py's: each source's packed
stream cut into seq_len + 1 tokens at stride seq_len; "val" is the held-out tail that training
validates on (--max_sequences = train.val_batches x train.global_batch_size, which applies to
each source, gives training's val_loss exactly), "train"
the rest, "all" both. Every window of the split of every source of the run's mixture (or of
--source NAME alone) is counted once.

Without --data.* overrides the run's prepared corpus is read as it is; with them (another
source, e.g. --data.dataset notes.jsonl --split all, which replaces a run's [[data.sources]])
that source is tokenized with the run's tokenizer, as plain text, into DIR/eval_data/<hash>/.
The model is built, sharded and loaded with the training code (parallelize.build_model,
checkpoint.read_model_weights), and the windows are spread over ranks and scored by
training's validation (validation.py). Only model weights are read, and the run
directory's checkpoints are never touched.

With --tasks it prints {"eval/<task>/acc", "eval/<task>/acc_norm", "eval/<task>/examples",
"checkpoint"} instead: the multiple-choice tasks scored as lm-evaluation-harness scores them
(downstream.py), their requests spread over the ranks; in a training run the same scores are
the eval/<task>/* records of metrics.jsonl.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import tempfile

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from checkpoint import read_model_weights
from config import compute_dtype, load_run, parse_config
from core import cli
from core.cli import ArgumentParser, exit_command, number
from core.errors import SetupError, UserError, report
from data import PackedCorpus
from evaluation.downstream import READY, TaskConfig, check_tasks, evaluate_tasks, load_tasks
from evaluation.validation import loss_sum_and_count, val_set
from parallel import distributed
from parallel.layout import build_mesh
from parallel.parallelize import build_model
from parallel.runner import OneStage
from prepare import prepare
from storage.rundir import RunDir


def split_windows(corpus: PackedCorpus, split: str, max_sequences: int = 0, source: str = "") -> list[tuple[int, int]]:
    """Windows [(source number, window index)] of a split ('val', 'train' or 'all') of each source (or of
    the one named source), the first max_sequences of each (0: all).

    Raises SetupError for an unknown split or source, or an empty split.
    """
    if source and source not in corpus.names:
        raise SetupError(f"--source: the run has no source '{source}'; use one of {', '.join(corpus.names)}")
    if split not in ("train", "val", "all"):
        raise SetupError(f"--split must be 'val', 'train' or 'all', got '{split}'")
    out = []
    for s, src in enumerate(corpus.sources):
        n_train, n_val = src.n_train, src.n_val
        start, end = {"train": (0, n_train), "val": (n_train, n_train + n_val), "all": (0, n_train + n_val)}[split]
        if max_sequences > 0:
            end = min(end, start + max_sequences)
        if not source or source == src.name:
            out += [(s, i) for i in range(start, end)]
    if not out:
        raise SetupError(f"split '{split}' is empty ({corpus.n_train} train / {corpus.n_val} val windows of "
                         f"{corpus.seq_len + 1} tokens); use --split all or raise --data.val_fraction")
    return out


def prepared_data(cfg, run_cfg, run_dir: str, tokenizer: str) -> str:
    """Folder of the tokens to evaluate (run on rank 0): the run's own prepared corpus when the
    source is the run's and its tokens are there, else run_dir/eval_data/<hash of the source>
    tokenized with the run's tokenizer (the run's own source too, when its tokens were removed).

    Raises DataError when the source cannot be read.
    """
    own = RunDir(run_dir).data
    if cfg.data.prepared_settings() == run_cfg.data.prepared_settings() and os.path.isfile(
            os.path.join(own, "meta.json")):
        return own
    data_cfg = dataclasses.replace(cfg.data, tokenizer=tokenizer)
    digest = hashlib.sha1(json.dumps(data_cfg.prepared_settings(), sort_keys=True).encode()).hexdigest()[:12]
    out = RunDir(run_dir).eval_data(digest)
    prepare(data_cfg, out)
    return out


def check_inputs(max_sequences: int, micro_batch_size: int) -> None:
    """Checks of evaluate's own flags before the process group exists; raise SetupError naming the flag."""
    if max_sequences < 0:
        raise SetupError(f"--max_sequences must be >= 0 (0: the whole split), got {max_sequences}")
    if micro_batch_size < 0:
        raise SetupError(f"--micro_batch_size must be >= 0 (0: the run's), got {micro_batch_size}")


def eval_config(run_cfg, run_dir: str, overrides: list[str]):
    """The run's config with overrides; one naming data.dataset replaces the run's mixture by that one source."""
    base = RunDir(run_dir).config
    if run_cfg.data.sources and any(o.split("=")[0] == "--data.dataset" for o in overrides):
        one = dataclasses.replace(run_cfg, data=dataclasses.replace(run_cfg.data, sources=[], stages=[]))
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(cli.to_toml(one))
        try:
            return parse_config(["--config", f.name, *overrides])
        finally:
            os.remove(f.name)
    return parse_config(["--config", base, *overrides])


def task_configs(cfg, spec: str) -> list[TaskConfig]:
    """The tasks that --tasks names (comma-separated): the run's [[eval.tasks]] by name, a ready task
    (downstream.READY) or NAME=FILE (a jsonl/parquet file with the default columns).

    Raises SetupError (or ConfigError for a bad name) naming the unknown task and the choices.
    """
    own = {t.name: t for t in cfg.eval.tasks}
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, path = item.partition("=")
        if eq and not path:
            raise SetupError(f"--tasks: '{item}' names no file after '='; give NAME=FILE.jsonl")
        if path:
            out.append(TaskConfig(name=name, dataset=path))
        elif name in own or name in READY:
            out.append(own.get(name) or TaskConfig(name=name))
        else:
            known = ", ".join(own) or "none"
            raise SetupError(f"--tasks: unknown task '{name}'; give one of the run's [[eval.tasks]] ({known}), a "
                             f"ready task ({', '.join(READY)}), or NAME=FILE.jsonl")
    if not out:
        raise SetupError("--tasks is empty; name the tasks, e.g. --tasks hellaswag,arc_easy")
    return out


def load_model(cfg, path: str, mesh, device):
    """The run's model built and sharded on mesh as in training (no recompute or compile; the run's
    dtype), with the weights of checkpoint path (collective)."""
    model = build_model(cfg.model, mesh, device, cfg.train.seed, cfg.parallel,
                        dtype=compute_dtype(cfg.train, device))
    state = get_model_state_dict(model)
    read_model_weights(path, state, no_dist=False)
    set_model_state_dict(model, state)
    return model


def evaluate_run(run_dir: str, checkpoint: str = "", split: str = "val", max_sequences: int = 0,
                 micro_batch_size: int = 0, overrides: list[str] = (), source: str = "",
                 tasks: str | None = None) -> dict:
    """Loss and perplexity, or downstream task scores, of a run's checkpoint (collective: every torchrun rank calls it).

    source: one source of the run's mixture ('' : all). tasks: --tasks (task_configs); then the
    result is {"eval/<task>/acc", "eval/<task>/acc_norm", "eval/<task>/examples", "checkpoint"}
    (the first eval.limit examples of each; --eval.limit 0: all), else {"loss", "ppl", "tokens",
    "sequences", "split", "checkpoint"}. Raises a UserError (one line) for a bad run,
    checkpoint, data source or task, before the process group starts where it can be known then.
    """
    run_cfg, path, tokenizer = load_run(run_dir, checkpoint)
    cfg = eval_config(run_cfg, run_dir, list(overrides))
    check_inputs(max_sequences, micro_batch_size)
    task_cfg = dataclasses.replace(cfg.eval, tasks=task_configs(cfg, tasks)) if tasks is not None else None
    if task_cfg is not None:
        check_tasks(task_cfg)
    rank, world, device = distributed.init_distributed(cfg.train.device)
    try:
        micro = micro_batch_size or max(1, cfg.train.micro_batch(world))
        mesh = build_mesh(device, world)
        dp = mesh.data
        if task_cfg is not None:
            loaded = distributed.on_rank0(lambda: load_tasks(task_cfg, tokenizer, cfg.model.max_seq_len), rank)
            runner = OneStage(load_model(cfg, path, mesh, device), mesh, device)
            result = evaluate_tasks(runner, loaded, dp.get_local_rank(), dp.size(), dp.get_group(),
                                    micro * cfg.data.seq_len)
            result.update({f"eval/{t.name}/examples": len(t.examples) for t in loaded})
            result["checkpoint"] = path
        else:
            data_dir = distributed.on_rank0(lambda: prepared_data(cfg, run_cfg, run_dir, tokenizer), rank)
            corpus = PackedCorpus(data_dir, cfg.data)
            windows = split_windows(corpus, split, max_sequences, source)
            runner = OneStage(load_model(cfg, path, mesh, device), mesh, device, cfg.train.loss_chunk_size)
            vs = val_set(corpus, split, windows, micro, rank, world)  # sharded as training's validation
            loss_sum, count = loss_sum_and_count(runner, vs, dp.get_group())
            loss = loss_sum / count
            result = {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf"), "tokens": int(count),
                      "sequences": len(windows), "split": split, "checkpoint": path}
        distributed.finish_distributed()
    finally:
        distributed.abandon_distributed()
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: prints the result as one JSON line on rank 0; bad input exits with status 2."""
    distributed.die_with_agent()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_dir", required=True, help="training run directory")
    p.add_argument("--checkpoint", default="",
                   help="checkpoint directory or URL (default: the run's newest complete one, in its checkpoint.dir)")
    p.add_argument("--split", default="val", choices=("val", "train", "all"),
                   help="'val' (the held-out tail), 'train' or 'all' windows")
    count = number(int, lambda v: v >= 0, "an int >= 0")
    p.add_argument("--max_sequences", type=count, default=0, help="only the split's first N windows (0: all)")
    p.add_argument("--micro_batch_size", type=count, default=0, help="windows per forward pass (0: the run's)")
    p.add_argument("--source", default="", help="one source of the run's [[data.sources]] (default: all)")
    p.add_argument("--tasks", default=None, help="score these downstream tasks instead of the loss: comma-separated "
                   "names of the run's [[eval.tasks]], ready tasks (" + ", ".join(READY) + ") or NAME=FILE.jsonl; "
                   "the first eval.limit examples of each (--eval.limit 0: all)")
    a, overrides = p.parse_known_args(argv)
    try:
        result = evaluate_run(a.run_dir, a.checkpoint, a.split, a.max_sequences, a.micro_batch_size, overrides,
                              a.source, a.tasks)
    except UserError as e:
        report(e)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    exit_command(main())
