"""Downstream tasks against lm-evaluation-harness itself: its request encoding, its task definitions,
and its scores of our Hugging Face export, which the loop and evaluate.py must equal exactly."""
import json
import os
import sys

import lm_eval.tasks
import numpy as np
import pytest
import transformers
from lm_eval._cli import HarnessCLI  # `python -m lm_eval`'s command line
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks._yaml_loader import load_yaml  # the loader of the harness's task YAML (!function, include)

import evaluate
import hf
import train_fsdp
from data_pipeline import tokenizer
from evaluation import downstream
from launch import DEBUG, ROOT, metrics, prepared_data_dir, refused, run, train_in_process
from scripts.stdlib_tasks import write_tasks

TASKS = ("stdlib_next", "stdlib_long")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    words = "the cat sat on a mat while dogs ran past the old red barn and sang".split()
    tokenizer.train_tokenizer([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, 400,
                              10 ** 6).save(str(path))
    return str(path)


class _Harness(TemplateLM):
    """The harness's own request encoding (TemplateLM.loglikelihood, _encode_pair, HFLM.tok_encode), no model."""

    tok_encode = HFLM.tok_encode

    def __init__(self, hf_tok):
        super().__init__()
        self.tokenizer, self.add_bos_token, self.backend = hf_tok, None, "causal"

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kw):
        return [(ctx, cont) for _, ctx, cont in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError


def test_requests_are_encoded_as_the_harness_encodes_them(tok_file):
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_file, eos_token="[EOT]")
    examples = [downstream.Example("the cat sat", ["on a mat", "ran past"], 0),
                downstream.Example("dogs ran  ", ["past the barn", " sang"], 1),  # trailing spaces move over
                downstream.Example("", ["the old red barn", "a cat"], 0),  # empty context: [EOT] before it
                downstream.Example("the old red barn and the cat " * 6, ["sat", "sang and sang"], 1)]
    for delimiter in (" ", ""):
        ours = downstream.build_requests(examples, tokenizer.load_tokenizer(tok_file), hf_tok.eos_token_id,
                                         max_len=24, delimiter=delimiter)
        pairs = [(ex.context, delimiter + c) for ex in examples for c in ex.choices]
        theirs = _Harness(hf_tok).loglikelihood([Instance("loglikelihood", {}, p, 0) for p in pairs])
        for r, (ctx, cont) in zip(ours, theirs, strict=True):
            # HFLM._loglikelihood_tokens then feeds (context_enc + continuation_enc)[-(max_length + 1):][:-1]
            assert r.tokens == (ctx + cont)[-25:] and r.n_continuation == len(cont), (r, ctx, cont)
    assert any(len(ctx + cont) > 25 for ctx, cont in theirs)  # the left cut was exercised


def test_scores_take_the_first_best_choice_as_numpy_argmax():
    rng = np.random.default_rng(0)
    examples, lls, acc, acc_norm = [], [], 0, 0
    for i in range(200):
        choices = ["x" * int(n) for n in rng.integers(1, 9, size=4)]
        ll = rng.integers(-6, 0, size=4).astype(float)  # whole numbers: ties are common
        gold = int(rng.integers(0, 4))
        examples.append(downstream.Example("c", choices, gold))
        lls += ll.tolist()
        lens = np.array([len(c) for c in choices], dtype=float)  # the harness's completion_len
        acc += int(np.argmax(ll) == gold)
        acc_norm += int(np.argmax(ll / lens) == gold)
    assert downstream.scores(examples, lls) == {"acc": acc / 200, "acc_norm": acc_norm / 200}


HUB_ROWS = {
    "hellaswag": [{"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow "
                   "covering the window of a car, and a woman wearing winter clothes smiles.", "ctx_b": "then",
                   "ctx": "", "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a "
                   "ski lift, while two men supporting the head of the person wearing winter clothes snow as the we "
                   "girls sled.", ", the man puts on a christmas coat, knitted with netting.", ", the man continues "
                   "removing the snow on his car."], "source_id": "activitynet~v_-1IBHYS3L-Y", "split": "val",
                   "split_type": "indomain", "label": "3"},
                  {"ind": 9, "activity_label": "Home and Garden", "ctx_a": "[header] How to grow tomatoes [title] "
                   "Pick a spot.", "ctx_b": "you need", "ctx": "", "endings": ["sun [step] Lots of it.", "water.",
                   "a [title] shovel.", "nothing at all"], "source_id": "wikihow~1", "split": "val",
                   "split_type": "zeroshot", "label": "0"}],
    "arc_easy": [{"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster after a "
                  "meteorite impact. Which is the most likely effect of this increase in rotation?",
                  "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                                       "Planetary days will become shorter.", "Planetary gravity will become stronger."],
                              "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
                 {"id": "x2", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"],
                                                                         "label": ["1", "2", "3"]}, "answerKey": "2"}],
    "piqa": [{"goal": "How do I ready a guinea pig cage for it's new occupants?", "sol1": "Provide the guinea pig "
              "with a cage full of a few inches of bedding made of ripped paper strips.", "sol2": "Provide the guinea "
              "pig with a cage full of a few inches of bedding made of ripped jeans material.", "label": 0}],
}
HARNESS_YAML = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml",
                "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml"}


@pytest.mark.parametrize("name", sorted(downstream.READY))
def test_ready_tasks_format_rows_as_the_harness_task_does(name, tmp_path):
    rows = HUB_ROWS["arc_easy" if name == "arc_challenge" else name]
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_yaml(os.path.join(os.path.dirname(lm_eval.tasks.__file__), HARNESS_YAML[name]))
    scored = "test_split" if config.get("test_split") else "validation_split"  # what the harness scores
    split = config[scored]
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {split: str(data)}},
                  training_split=None, validation_split=None, test_split=None)
    config[scored] = split
    task = ConfigurableTask(config=config)
    docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())
    ours = downstream.read_examples(downstream.TaskConfig(name=name, dataset=str(data)))
    assert len(ours) == len(docs) == len(rows)
    for ex, doc in zip(ours, docs):
        assert (ex.context, ex.choices, ex.gold) == (task.doc_to_text(doc), task.doc_to_choice(doc),
                                                     task.doc_to_target(doc))


def _write_tasks(d) -> tuple[str, str]:
    """scripts/stdlib_tasks.py's two tasks in d, and configs/debug_eval.toml pointed at them: (config, YAML folder).

    stdlib_next: 4 choices of different lengths (acc and acc_norm differ), the default columns;
    stdlib_long: 3 choices in other columns, some contexts ending in spaces and some longer
    than model.max_seq_len (cut from the left).
    """
    write_tasks(str(d))
    cfg = d / "eval.toml"
    cfg.write_text(open(os.path.join(ROOT, "configs", "debug_eval.toml")).read().replace("runs/tasks/", f"{d}/")
                   .replace("interval = 50", "interval = 5"))
    return str(cfg), str(d / "yaml")


def _scores(records: list[dict], step: int) -> dict:
    return {k: v for r in records if r["step"] == step for k, v in r.items() if k.startswith("eval/")}


@pytest.mark.slow
def test_scores_equal_the_harness_on_the_export_at_1_and_2_ranks_and_under_tp_and_pp(tmp_path, capsys,
                                                                                      monkeypatch):
    cfg, yaml_dir = _write_tasks(tmp_path)
    # Scored at steps 2 and 4 (a short warmup, so the scores move between them), a batch of 8: the comparisons need
    # two scorings of a trained export, not a long run.
    mid, end = 2, 4
    args = ["--config", cfg, "--train.steps", str(end), "--checkpoint.interval", str(end), "--train.val_interval", "0",
           "--eval.interval", str(mid), "--optim.warmup_steps", str(mid), "--train.global_batch_size", "8"]
    # In the loop at 1 rank, dp 1 x tp 2 and pp 2; the 2 data-parallel ranks' share of the requests is evaluate.py's
    # below (the same scorer on the training code's FSDP model).
    one, tp2, pp2 = tmp_path / "ws1", tmp_path / "dp1tp2", tmp_path / "pp2"
    for rd in (one, tp2, pp2):
        prepared_data_dir(rd)  # the session's tokenized debug corpus: no tokenizer training per run
    train_in_process(monkeypatch, capsys, *args, "--run_dir", one)  # 1 rank: train_fsdp.main in this process
    run(2, "train_2d.py", *args, "--run_dir", str(tp2), "--parallel.tp", "2")  # vocabulary-parallel logits
    run(2, "train_fsdp.py", *args, "--run_dir", str(pp2), "--parallel.pp", "2")  # scored stage after stage
    ours = {step: _scores(metrics(one), step) for step in (mid, end)}
    assert set(ours[end]) == {f"eval/{t}/{m}" for t in TASKS for m in ("acc", "acc_norm")}, ours
    assert ours[mid] and ours[mid] != ours[end]
    assert {step: _scores(metrics(tp2), step) for step in (mid, end)} == ours
    assert {step: _scores(metrics(pp2), step) for step in (mid, end)} == ours

    export = tmp_path / "export"
    assert hf.main(["export", "--run_dir", str(one), "--out", str(export)]) == 0  # in this process: no start-up
    out = tmp_path / "lm_eval"
    # The harness's own command line (`python -m lm_eval ...`: HarnessCLI, which runs simple_evaluate and writes the
    # results file), called in this process: the test's imports already hold lm_eval and transformers, which a fresh
    # process spends most of its time importing. Our evaluate.py lies on sys.path ahead of Hugging Face's evaluate, as
    # it did from the checkout's root.
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
                                      "--tasks", ",".join(TASKS), "--include_path", yaml_dir, "--device", "cpu",
                                      "--batch_size", "8", "--output_path", str(out)])
    cli = HarnessCLI()
    cli.execute(cli.parse_args())
    results = json.load(open(sorted(str(p) for p in out.rglob("results*.json"))[-1]))["results"]
    harness = {f"eval/{t}/{m}": results[t][f"{m},none"] for t in TASKS for m in ("acc", "acc_norm")}
    assert harness["eval/stdlib_next/acc"] != harness["eval/stdlib_next/acc_norm"]  # length normalisation exercised
    assert ours[end] == harness

    proc = run(2, "evaluate.py", "--run_dir", str(one), "--tasks", ",".join(TASKS), "--eval.limit", "0")
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in printed.items() if k in harness} == harness
    assert printed["eval/stdlib_next/examples"] == 48 and printed["eval/stdlib_long/examples"] == 18
    line = refused(evaluate.main, ["--run_dir", str(one), "--tasks", "stdlib_next,nope"], capsys)
    assert "unknown task 'nope'; give one of the run's [[eval.tasks]] (stdlib_next, stdlib_long), a ready" in line
    assert "--tasks is empty" in refused(evaluate.main, ["--run_dir", str(one), "--tasks", ""], capsys)
    assert "names no file after '='" in refused(evaluate.main, ["--run_dir", str(one), "--tasks", "t="], capsys)


def _train_refused(tmp_path, monkeypatch, capsys, table: str) -> str:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(open(DEBUG).read() + "\n" + table)
    monkeypatch.setenv("WORLD_SIZE", "1")
    return refused(train_fsdp.main, ["--config", str(cfg), "--run_dir", str(tmp_path / "run")], capsys)


@pytest.mark.parametrize("rows, table, msg", [
    ([{"context": "a", "choices": ["b", "c"]}], "", "has no column 'gold' (it has choices, context); set "
                                                    "eval.tasks.gold_column"),
    ([{"context": "a", "choices": ["b", "c"], "gold": 2}], "", "row 1 of"),
    ([{"context": "a", "choices": "b c", "gold": 0}], "", "choices must be a list of at least 2 non-empty strings"),
    ([{"q": "a", "choices": ["b", "c"], "gold": 0}], 'context_column = "question"\n', "has no column 'question'"),
    ([{"context": "a", "choices": ["b", ""], "gold": 0}], "", "choices must be a list of at least 2 non-empty"),
    ([], "", "has no rows; give a file with one JSON object per line"),
    (['{"context": "a", "choices": ["b", "c"], "gold": 0}', '{"context": "a",'], "", "line 2 of '"),
])
def test_bad_task_files_are_refused_before_any_collective(tmp_path, monkeypatch, capsys, rows, table, msg):
    path = tmp_path / "task.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) or "\n\n")
    line = _train_refused(tmp_path, monkeypatch, capsys, f'[[eval.tasks]]\nname = "t"\ndataset = "{path}"\n{table}')
    assert msg in line and "eval.tasks[t]" in line, line
    if "row 1" in msg:
        assert "gold = 2 is not an index into its 2 choices (0..1)" in line, line
    assert not (tmp_path / "run" / "data").exists()


def test_unknown_tasks_are_named(tmp_path, monkeypatch, capsys):
    line = _train_refused(tmp_path, monkeypatch, capsys, '[[eval.tasks]]\nname = "helaswag"\n')
    assert "'helaswag' is not a ready task (hellaswag, arc_easy, arc_challenge, piqa)" in line, line
    line = _train_refused(tmp_path, monkeypatch, capsys, f'[[eval.tasks]]\nname = "t"\ndataset = "{tmp_path}/no.jsonl"\n')
    assert "eval.tasks[t].dataset: file '" in line and "no.jsonl' not found" in line, line
    line = _train_refused(tmp_path, monkeypatch, capsys, f'[[eval.tasks]]\nname = "t"\ndataset = "{DEBUG}"\n')
    assert "debug.toml' is not a .jsonl, .json or .parquet file" in line, line
    line = _train_refused(tmp_path, monkeypatch, capsys, f'[[eval.tasks]]\nname = "t"\ndataset = "{tmp_path}"\n')
    assert "is a directory; give the task's .jsonl, .json or .parquet file" in line, line
    line = _train_refused(tmp_path, monkeypatch, capsys, '[[eval.tasks]]\nname = "t"\ndataset = "tasks/mine.csv"\n')
    assert "file 'tasks/mine.csv' not found" in line, line  # a path, not a hub id

