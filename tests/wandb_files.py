"""What a run directory's offline W&B folders hold, read with W&B's own reader of its .wandb transaction logs."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from observability.metrics import scalars
from storage.rundir import RunDir


def offline_runs(run_dir) -> list[tuple[dict, list[dict]]]:
    """(run record, history rows) of each RUN_DIR/wandb/offline-run-*/ folder, in order of start time.

    Read by `wandb leet inspect --json`, which prints a .wandb file's records one JSON
    object a line. A history row is {"step": N, **values} (W&B's own "_" keys left out).
    """
    out = []
    for folder in glob.glob(os.path.join(RunDir(str(run_dir)).wandb, "offline-run-*")):
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", folder], text=True,
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        rows = [{"step": int(r["history"]["step"]["num"]),
                 **{k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}}
                for r in records if r["type"] == "history"]
        out.append((run, rows))
    return sorted(out, key=lambda run_rows: run_rows[0]["start_time"])


def rewound_history(runs: list[tuple[dict, list[dict]]]) -> dict[int, dict]:
    """{step: values} that W&B's server holds once the folders are synced in order: each start's rows replace
    those after its branch point (resume_from's rewind). Fails on a step logged twice by one start."""
    history: dict[int, dict] = {}
    for run, rows in runs:
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)), f"one start logged a step twice or out of order: {steps}"
        point = run.get("branch_point")
        if point:
            assert point["run"] == run["run_id"] and point["metric"] == "_step", point
            history = {s: v for s, v in history.items() if s <= int(point["value"])}
        for r in rows:
            assert r["step"] not in history, f"step {r['step']} would be logged twice: no rewind before it"
            history[r["step"]] = {k: v for k, v in r.items() if k != "step"}
    return history


def by_step(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's records as {step: numeric values}, the records of one step (train, val, eval) merged."""
    out: dict[int, dict] = {}
    for r in records:
        out.setdefault(r["step"], {}).update(scalars(r))
    return out
