"""Downstream multiple-choice tasks, scored exactly as lm-evaluation-harness scores them.

A task is a list of examples: a context, several choices and the index of the gold one (the
harness's ``multiple_choice`` output type). Each choice is a request: the log-likelihood of
``target_delimiter + choice`` after the context, summed over its tokens. ``acc`` is the
share of examples whose gold choice has the highest log-likelihood; ``acc_norm`` divides
each log-likelihood by the choice's length in characters first, as the harness's acc_norm
does (``len(choice)``, lm_eval/api/task.py; its byte-normalised ``acc_bytes`` is the same
on ASCII text).

Requests are built as the harness's Hugging Face backend builds them (lm_eval/api/model.py
``_encode_pair`` and ``loglikelihood``, models/huggingface.py ``_loglikelihood_tokens``):
the context's trailing whitespace moves to the continuation; the continuation's tokens are
those of tokenize(context + continuation) after tokenize(context); an empty context becomes
[EOT] (the harness's prefix token, the exported eos); context and continuation are cut
from the left to model.max_seq_len + 1 tokens (the export's max_position_embeddings). Each
request is its own row, right-padded with [PAD] in a batch of similar lengths, so no
request attends to another and document_mask changes nothing (a request holds no [EOT]
but the empty context's). Text encodes as plain text (tokenizer.encode_plain): the literal
string "[EOT]" inside a task's text is where the harness, which encodes it as the special
token, would differ.

The requests are spread over the data-parallel ranks like validation (validation.rank_share),
every rank runs as many forward passes as the largest share, and the sums are put together
with one all-reduce, so a score does not depend on the world size or layout.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import torch
import torch.distributed as dist

from core.errors import ConfigError
from data import DataError
from data_pipeline.tokenizer import encode_plain, load_tokenizer, separator_ids
from evaluation.validation import rank_share, reshard


@dataclasses.dataclass
class TaskConfig:
    """One [[eval.tasks]] table: a multiple-choice task from a local file or the hub."""

    name: str = ""
    """The task's name, in records as eval/<name>/acc; a ready task's name (hellaswag, arc_easy, arc_challenge, piqa) without dataset reads its usual hub dataset."""
    dataset: str = ""
    """A local .jsonl/.json or .parquet file, or a Hugging Face hub id (with split and subset); empty: the ready task's hub dataset."""
    context_column: str = "context"
    """Column of the context (the text before the choices)."""
    choices_column: str = "choices"
    """Column of the choices, a list of strings."""
    gold_column: str = "gold"
    """Column of the index of the right choice (0-based int)."""
    target_delimiter: str = " "
    """Text between the context and each choice (lm-evaluation-harness's default, a space)."""
    split: str = ""
    """Split of a hub dataset (empty: the ready task's, else 'validation')."""
    subset: str = ""
    """Configuration of a hub dataset (empty: the ready task's, else none)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"eval.tasks: name {self.name!r} is not a name (letters, digits, _ . -); give each "
                              f"[[eval.tasks]] table a name such as 'hellaswag'")
        if not self.dataset and self.name not in READY:
            raise ConfigError(f"eval.tasks[{self.name}].dataset is empty and '{self.name}' is not a ready task "
                              f"({', '.join(READY)}); give a jsonl/parquet file or a hub id")
        for col in ("context_column", "choices_column", "gold_column"):
            if not getattr(self, col):
                raise ConfigError(f"eval.tasks[{self.name}].{col} is empty; name the column")


@dataclasses.dataclass
class EvalConfig:
    interval: int = 200
    """Score the [[eval.tasks]] every this many steps and at the end of the run (0: only at the end)."""
    limit: int = 100
    """Examples per task: its first N (0: all). 100 HellaSwag-sized examples take about 5 debug-run steps (benchmarks/eval_bench.py); the score's standard error is about 4.6 points at 30% accuracy."""
    tasks: list[TaskConfig] = dataclasses.field(default_factory=list)
    """Multiple-choice tasks scored in the loop and by evaluate.py --tasks (see downstream.py)."""

    def __post_init__(self) -> None:
        for name in ("interval", "limit"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"eval.tasks: two tasks are named {twice[0]!r}; give each its own name")

    def due(self, step: int, steps: int) -> bool:
        """Whether the tasks are scored after step (1-based) of a run of steps."""
        return bool(self.tasks) and (step == steps or (self.interval > 0 and step % self.interval == 0))


@dataclasses.dataclass
class Example:
    context: str
    choices: list[str]
    gold: int


# ---------------------------------------------------------------- ready tasks


def _hellaswag_text(text: str) -> str:
    # lm_eval/tasks/hellaswag/utils.py preprocess: WikiHow's bracketed artifacts out.
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(row: dict) -> Example:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return Example(_hellaswag_text(row["activity_label"] + ": " + ctx), [_hellaswag_text(e) for e in row["endings"]],
                   int(row["label"]))


def _arc(row: dict) -> Example:
    return Example(f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                   list(row["choices"]["label"]).index(row["answerKey"]))


def _piqa(row: dict) -> Example:
    return Example(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


@dataclasses.dataclass(frozen=True)
class ReadyTask:
    dataset: str
    subset: str
    split: str
    columns: frozenset[str]
    example: Callable[[dict], Example]
    """A row of the hub dataset -> Example, as the harness's task YAML (and its utils.py) turns it into a request."""


# The harness's task definitions (lm_eval/tasks/<task>/*.yaml, zero-shot): dataset, the split it
# scores (test_split, else validation_split) and doc_to_text / doc_to_choice / doc_to_target.
_ARC = frozenset({"question", "choices", "answerKey"})
READY = {
    "hellaswag": ReadyTask("Rowan/hellaswag", "", "validation",
                           frozenset({"activity_label", "ctx_a", "ctx_b", "endings", "label"}), _hellaswag),
    "arc_easy": ReadyTask("allenai/ai2_arc", "ARC-Easy", "test", _ARC, _arc),
    "arc_challenge": ReadyTask("allenai/ai2_arc", "ARC-Challenge", "test", _ARC, _arc),
    "piqa": ReadyTask("baber/piqa", "", "validation", frozenset({"goal", "sol1", "sol2", "label"}), _piqa),
}

_LOCAL_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_kind(path: str) -> str | None:
    return _LOCAL_KINDS.get(os.path.splitext(path)[1].lower())


def is_local(task: TaskConfig) -> bool:
    """Whether the task reads a local path (checked before training) rather than a hub id.

    A path that exists, has a file extension, or starts with / . or ~ is local; a hub id is
    "org/name".
    """
    d = task.dataset
    return bool(d) and (os.path.exists(d) or bool(os.path.splitext(d)[1]) or d.startswith(("/", ".", "~")))


def _check_json_lines(task: TaskConfig) -> None:
    """A .jsonl file's own errors named by line (datasets' would name a generated split): none, a bad line."""
    with open(task.dataset, encoding="utf-8", errors="replace") as f:
        n = 0
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            n += 1
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"eval.tasks[{task.name}]: line {i} of '{task.dataset}' is not JSON ({e.msg}); "
                                f"fix or delete that line") from None
    if n == 0:
        raise DataError(f"eval.tasks[{task.name}]: '{task.dataset}' has no rows; give a file with one JSON "
                        f"object per line")


def _rows(task: TaskConfig, limit: int) -> list[dict]:
    import datasets  # a core dependency; imported here so that reading a config does not load it

    ready = READY.get(task.name)
    source = task.dataset or ready.dataset
    try:
        if is_local(task):
            kind = _local_kind(task.dataset)
            if os.path.isdir(task.dataset):
                raise DataError(f"eval.tasks[{task.name}].dataset: '{task.dataset}' is a directory; give the task's "
                                f".jsonl, .json or .parquet file")
            if not os.path.isfile(task.dataset):
                raise DataError(f"eval.tasks[{task.name}].dataset: file '{task.dataset}' not found")
            if kind is None:
                raise DataError(f"eval.tasks[{task.name}].dataset: '{task.dataset}' is not a .jsonl, .json or "
                                f".parquet file")
            if task.dataset.lower().endswith(".jsonl"):
                _check_json_lines(task)
            quiet = datasets.are_progress_bars_disabled()
            datasets.disable_progress_bars()  # a bar per small file would drown the start-up lines
            try:
                rows = datasets.load_dataset(kind, data_files=task.dataset, split="train")  # as the harness reads it
            finally:
                if not quiet:
                    datasets.enable_progress_bars()
        else:
            subset = task.subset or (ready.subset if ready and not task.dataset else "") or None
            split = task.split or (ready.split if ready and not task.dataset else "validation")
            rows = datasets.load_dataset(source, subset, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ArrowInvalid...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"eval.tasks[{task.name}].dataset: cannot read '{source}': {type(e).__name__}: {first}") \
            from None
    n = len(rows) if limit <= 0 else min(limit, len(rows))
    return [rows[i] for i in range(n)]


def read_examples(task: TaskConfig, limit: int = 0) -> list[Example]:
    """The task's first limit examples (0: all), read from its file or hub dataset and checked.

    A ready task (READY) without a dataset, or with a hub or local file in its hub schema,
    is formatted as the harness formats it; any other task takes its three columns as they are.
    Raises DataError naming eval.tasks[NAME] and the fix: an unreadable or empty file, a
    missing column, choices that are not a list of at least two strings, a gold index that
    is not an int in range.
    """
    rows = _rows(task, limit)
    if not rows:
        raise DataError(f"eval.tasks[{task.name}]: '{task.dataset}' has no rows")
    ready = READY.get(task.name)
    if ready and set(rows[0]) >= ready.columns:  # the hub schema, from the hub or a local copy
        try:
            return [ready.example(row) for row in rows]
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise DataError(f"eval.tasks[{task.name}]: a row of '{task.dataset or ready.dataset}' does not fit "
                            f"the ready task's format ({type(e).__name__}: {e}); give its own columns and a "
                            f"name that is not a ready task's") from None
    fields = {"context_column": task.context_column, "choices_column": task.choices_column,
              "gold_column": task.gold_column}
    out = []
    for i, row in enumerate(rows):
        missing = [f for f, column in fields.items() if column not in row]
        if missing:
            raise DataError(f"eval.tasks[{task.name}]: '{task.dataset}' has no column '{fields[missing[0]]}' (it "
                            f"has {', '.join(sorted(row))}); set eval.tasks.{missing[0]}")
        ctx, choices, gold = row[task.context_column], row[task.choices_column], row[task.gold_column]
        where = f"eval.tasks[{task.name}]: row {i + 1} of '{task.dataset}'"
        if not isinstance(ctx, str):
            raise DataError(f"{where}: {task.context_column} is {type(ctx).__name__}, not a string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            # Empty choices too: the harness cannot score them (it reads choice[0]).
            raise DataError(f"{where}: {task.choices_column} must be a list of at least 2 non-empty strings")
        if isinstance(gold, str) and gold.strip().isdigit():  # the harness takes "2" as 2 too
            gold = int(gold)
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise DataError(f"{where}: {task.gold_column} = {gold!r} is not an index into its {len(choices)} "
                            f"choices (0..{len(choices) - 1})")
        out.append(Example(ctx, list(choices), gold))
    return out


def check_tasks(cfg: EvalConfig) -> None:
    """Read and check every local task file (no collective; run on every rank before training).

    Hub tasks are checked when they are loaded (on rank 0, then shared). Raises DataError.
    """
    for task in cfg.tasks:
        if is_local(task):
            read_examples(task, cfg.limit)


# ---------------------------------------------------------------- requests and scores


@dataclasses.dataclass
class Request:
    tokens: list[int]
    """Context then continuation, cut from the left to max_len + 1 tokens."""
    n_continuation: int
    """Its last n_continuation tokens are the continuation, whose log-likelihood is summed."""


def build_requests(examples: list[Example], tok, eot_id: int, max_len: int, delimiter: str = " ") -> list[Request]:
    """One Request per (example, choice), in order, tokenized as the harness's HF backend does (module doc).

    tok: a tokenizers.Tokenizer; eot_id: its [EOT] id (the empty context's prefix); max_len:
    model.max_seq_len, the longest input a forward takes.
    """
    pairs = [(ex.context, delimiter + choice) for ex in examples for choice in ex.choices]
    contexts, continuations = [], []
    for ctx, cont in pairs:
        stripped = ctx.rstrip()
        contexts.append(stripped)
        continuations.append(ctx[len(stripped):] + cont)  # trailing whitespace joins the continuation
    whole = encode_plain(tok, [c + k if c else k for c, k in zip(contexts, continuations)])
    heads = encode_plain(tok, [c for c in contexts if c])
    out, h = [], iter(heads)
    for ctx, ids in zip(contexts, whole):
        if ctx:
            head = next(h)
            cont = ids[len(head):]
        elif ids and ids[0] == eot_id:  # the harness's rule when the continuation itself starts with the prefix
            head, cont = ids[:1], ids[1:]
        else:
            head, cont = [eot_id], ids
        tokens = (head + cont)[-(max_len + 1):]
        out.append(Request(tokens, min(len(cont), len(tokens) - 1)))  # a continuation longer than the model: its tail
    return out


def scores(examples: list[Example], loglikelihoods: list[float]) -> dict[str, float]:
    """{"acc", "acc_norm"} of examples from their choices' summed log-likelihoods (in build_requests' order).

    acc: argmax of the log-likelihoods is gold; acc_norm: argmax of log-likelihood / len(choice)
    (characters, the harness's completion_len). Ties go to the first choice, as numpy's argmax.
    """
    acc = acc_norm = 0
    i = 0
    for ex in examples:
        lls = loglikelihoods[i:i + len(ex.choices)]
        i += len(ex.choices)
        acc += max(range(len(lls)), key=lambda k: (lls[k], -k)) == ex.gold
        norm = [ll / max(len(c), 1) for ll, c in zip(lls, ex.choices)]  # the harness divides by 0 for ""
        acc_norm += max(range(len(norm)), key=lambda k: (norm[k], -k)) == ex.gold
    return {"acc": acc / len(examples), "acc_norm": acc_norm / len(examples)}


def _batches(order: list[int], requests: list[Request], max_tokens: int, multiple: int):
    """Consecutive requests of order (longest first) in batches of at most max_tokens padded tokens."""
    batch, width = [], 0
    for i in order:
        w = -(-(len(requests[i].tokens) - 1) // multiple) * multiple
        if batch and max(width, w) * (len(batch) + 1) > max_tokens:
            yield batch, width
            batch, width = [], 0
        batch.append(i)
        width = max(width, w)
    if batch:
        yield batch, width


@torch.no_grad()
def loglikelihoods(runner, requests: list[Request], dp_rank: int, dp_size: int, dp_group, max_tokens: int,
                   pad_id: int = 0) -> list[float]:
    """Summed log-likelihood (nats, fp32 per token, float64 sums) of each request's continuation (collective).

    The requests, longest first, are shared out over the dp_size data-parallel ranks
    (rank_share); each rank scores its share in right-padded batches of at most max_tokens
    tokens (widths rounded up to a multiple of the tp size, for sequence parallelism), every
    rank runs as many forward passes as the rank with the most, and one all-reduce over
    dp_group gives every rank every sum. runner: this rank's (parallel/runner.py), whose stages
    run each batch in turn when there are several. The model is left in train mode, its FSDP
    modules resharded.
    """
    model, device = runner.model, runner.device
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    lo, hi = rank_share(len(order), dp_rank, dp_size)
    tp = runner.mesh.size("tp")
    mine = list(_batches(order[lo:hi], requests, max_tokens, tp))
    counts = torch.tensor([len(mine)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=dp_group)
    sums = torch.zeros(len(requests), dtype=torch.float64, device=device)
    model.eval()
    for b in range(int(counts.item())):
        batch, width = mine[min(b, len(mine) - 1)] if mine else ([], tp)
        inputs = torch.full((max(len(batch), 1), width), pad_id, dtype=torch.long)
        targets = torch.full_like(inputs, -100)  # ignored: padding and context
        for row, i in enumerate(batch):
            r = requests[i]
            n = len(r.tokens) - 1
            inputs[row, :n] = torch.tensor(r.tokens[:-1])
            targets[row, n - r.n_continuation:n] = torch.tensor(r.tokens[n + 1 - r.n_continuation:])
        logp = runner.token_logprobs(inputs.to(device), targets.to(device)).double().sum(dim=1)
        if b < len(mine):
            sums[batch] = logp[:len(batch)]
    reshard(runner.modules)
    model.train()
    dist.all_reduce(sums, group=dp_group)  # each request was scored by exactly one rank
    return sums.tolist()


@dataclasses.dataclass
class Task:
    name: str
    examples: list[Example]
    requests: list[Request]


def load_tasks(cfg: EvalConfig, tokenizer_path: str, max_len: int) -> list[Task]:
    """Every [[eval.tasks]] task read, checked and tokenized with the run's tokenizer.json (run it on
    one rank and share the result). max_len: model.max_seq_len. Raises DataError as read_examples does.
    """
    tok = load_tokenizer(tokenizer_path)
    eot_id = separator_ids(tokenizer_path, tok=tok)[0]  # the run's EOS ([EOT] for ours): tokenizer_config.json
    out = []
    for t in cfg.tasks:
        examples = read_examples(t, cfg.limit)
        out.append(Task(t.name, examples, build_requests(examples, tok, eot_id, max_len, t.target_delimiter)))
    return out


def evaluate_tasks(runner, tasks: list[Task], dp_rank: int, dp_size: int, dp_group, max_tokens: int
                   ) -> dict[str, float]:
    """{"eval/<task>/acc", "eval/<task>/acc_norm"} of every task (collective over the data-parallel ranks, and the
    stages' ranks when there are several: see loglikelihoods)."""
    record = {}
    for t in tasks:
        lls = loglikelihoods(runner, t.requests, dp_rank, dp_size, dp_group, max_tokens)
        for k, v in scores(t.examples, lls).items():
            record[f"eval/{t.name}/{k}"] = v
    return record
