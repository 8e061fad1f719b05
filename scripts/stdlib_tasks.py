"""Two offline multiple-choice tasks from this Python's standard-library sources, and their harness YAML.

    python scripts/stdlib_tasks.py --out runs/tasks

Writes OUT/stdlib_next.jsonl and OUT/stdlib_long.jsonl, the [[eval.tasks]] files of
configs/debug_eval.toml, and OUT/yaml/<task>.yaml, the same tasks in lm-evaluation-harness's
task format (``lm_eval --include_path OUT/yaml --tasks stdlib_next,stdlib_long``), so a
run's in-loop scores can be set beside the harness's on its export. The text is the debug
run's own corpus (sources.stdlib_files), so a model trained on it learns to pick the words
that follow.

- stdlib_next: a 12-word context and 4 choices of 3 to 5 words, one of them the words that
  follow it, the others from elsewhere (their lengths differ, so acc and acc_norm do).
  Default columns.
- stdlib_long: a context of 20 words or (one in three) 900 words, longer than the debug model's
  512 positions (so it is cut from the left), ending in a space in every other example; 3
  choices of 3 to 5 words. Columns question, options and answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_pipeline import sources  # noqa: E402

HARNESS_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{{context}}}}}"
doc_to_choice: "{{{{{choices}}}}}"
doc_to_target: "{{{{{gold}}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _words() -> list[str]:
    text = " ".join(" ".join(open(f, errors="replace").read().split()) for f in sources.stdlib_files()[:40])
    return text.split(" ")


def _gold_first(choices: list[str], gold: int) -> list[str]:
    """choices with the true one (first) moved to index gold."""
    choices[0], choices[gold] = choices[gold], choices[0]
    return choices


def write_tasks(out: str, n_next: int = 48, n_long: int = 18) -> dict[str, str]:
    """Write both tasks and their YAML under out; returns {task name: jsonl path}."""
    words = _words()
    os.makedirs(os.path.join(out, "yaml"), exist_ok=True)
    paths = {name: os.path.abspath(os.path.join(out, f"{name}.jsonl")) for name in ("stdlib_next", "stdlib_long")}
    with open(paths["stdlib_next"], "w") as f:
        for i in range(n_next):
            at = 200 + i * 97
            choices = [" ".join(words[at + 12:at + 15 + i % 3])] + \
                [" ".join(words[at + 500 * k:at + 500 * k + 3 + (i + k) % 3]) for k in (1, 2, 3)]
            f.write(json.dumps({"context": " ".join(words[at:at + 12]), "choices": _gold_first(choices, i % 4),
                                "gold": i % 4}) + "\n")
    with open(paths["stdlib_long"], "w") as f:
        for i in range(n_long):
            at, n = 9000 + i * 331, 900 if i % 3 == 0 else 20
            choices = [" ".join(words[at + n:at + n + 4]), " ".join(words[at + 2000:at + 2005]),
                       " ".join(words[at + 4000:at + 4003])]
            f.write(json.dumps({"question": " ".join(words[at:at + n]) + (" " if i % 2 else ""),
                                "options": _gold_first(choices, i % 3), "answer": i % 3}) + "\n")
    for name, columns in (("stdlib_next", ("context", "choices", "gold")),
                          ("stdlib_long", ("question", "options", "answer"))):
        with open(os.path.join(out, "yaml", f"{name}.yaml"), "w") as f:
            f.write(HARNESS_YAML.format(name=name, path=paths[name], **dict(zip(("context", "choices", "gold"),
                                                                                 columns))))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/tasks", help="folder to write the tasks into (created)")
    a = p.parse_args(argv)
    for name, path in write_tasks(a.out).items():
        print(f"wrote {path} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
