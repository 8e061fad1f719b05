"""Draw the training curves of one or several runs from RUN_DIR/metrics.jsonl into one PNG.

    python plot.py runs/a [runs/b ...] --out curves.png [--smooth N]

Four panels: train and validation loss against tokens seen (any "val_loss/<name>" key as an extra
dashed line), learning rate, tokens/s and MFU against step; one colour per run. Runs with
downstream tasks (eval/<task>/acc and acc_norm records) get two more: acc and acc_norm
against tokens seen, one marker per task. Mixture-of-experts runs (moe_max_load in their train
records) get a column of two more against step: the load (the busiest expert's tokens over the
mean per expert; 1 is even) and the balancing's state (moe_bias_range, and moe_aux_loss on a
right-hand axis when the run has it). A rollback (train.rollback) is a dotted line at the
step it went back to, on the loss and LR panels, labelled with the data steps it skipped; an
update the spike guard skipped is an x on the loss curve. matplotlib is imported only when
drawing, so `import plot`, read_metrics and marks work without it.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys

from core.cli import ArgumentParser, exit_command, number
from core.errors import UserError, require
from storage.rundir import RunDir

TRAIN_KEYS = ("loss", "lr", "tokens_per_sec", "mfu", "tokens_seen")


class PlotError(UserError):
    """A missing, empty or malformed metrics.jsonl; the message names the file (and line) and the fix."""


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(train records, validation records) of one metrics.jsonl, each a list of dicts sorted by step.

    A train record has "loss" plus TRAIN_KEYS; a validation record has "val_loss" and/or
    "val_loss/<name>" keys, or downstream "eval/<task>/<metric>" keys (a step's validation and
    downstream records are merged into one), and gets "tokens_seen" (tokens) from the train
    record of its step, else step * (tokens per step of the run). Other records are ignored. A
    resumed run logs the steps after its checkpoint again: the later record of a step wins.
    Raises PlotError if the file is missing or empty, a line is not a JSON object with an int
    "step" (or a train record lacks a numeric key), or there is no train record.
    """
    if not os.path.isfile(path):
        raise PlotError(f"{path} not found: pass a run directory written by train_fsdp.py or train_2d.py (--run_dir)")
    train, val, lines = {}, {}, 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            lines += 1
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path} line {n}: not JSON ({e.msg}): fix or delete that line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise PlotError(f"{path} line {n}: not a JSON object with an int 'step': fix or delete that line")
            if "loss" in rec:
                bad = [k for k in TRAIN_KEYS if not _is_number(rec.get(k))]
                if bad:
                    raise PlotError(f"{path} line {n}: train record lacks a number for {bad[0]!r}: "
                                    "fix or delete that line")
                train[rec["step"]] = rec
            elif any(k == "val_loss" or k.startswith(("val_loss/", "eval/")) for k in rec):
                val.setdefault(rec["step"], {}).update(rec)
    if not lines:
        raise PlotError(f"{path} is empty: the run has not logged a step yet; plot it after its first step")
    if not train:
        raise PlotError(f"{path} has no train records: train the run first (or let it reach its first log step)")
    train_list = [train[s] for s in sorted(train)]
    per_step = train_list[-1]["tokens_seen"] / train_list[-1]["step"]
    val_list = [{**val[s], "tokens_seen": train[s]["tokens_seen"] if s in train else s * per_step} for s in sorted(val)]
    return train_list, val_list


def read_rollbacks(path: str) -> list[dict]:
    """The rollback records of a metrics.jsonl, {"step": S, "rollback": {"to_step": C, "skip": [a, b], ...}}, as
    [{"step": S, "to_step": C, "skip": [a, b]}] in the order written. Lines that are not such records are left out
    (read_metrics names a malformed line)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
                back = rec["rollback"]
                a, b = back["skip"]
                out.append({"step": int(rec["step"]), "to_step": int(back["to_step"]), "skip": [int(a), int(b)]})
            except (ValueError, TypeError, KeyError):
                continue
    return out


def marks(train: list[dict], rollbacks: list[dict]) -> dict[str, list[tuple]]:
    """Where draw marks a run's events, from read_metrics' train records and read_rollbacks' records.

    {"rollback": [(tokens seen, step, text)]}: each rollback at the step it went back to (that
    step's tokens_seen; 0 at step 0; from the run's tokens per step when that step was not logged),
    text 'skip a-b' (the data steps it skipped; 'skip a-b, c-d' for two rollbacks to one step). {"skipped": [(tokens seen, loss, step)]}: each
    update the spike guard skipped ("skipped" in its record), at its loss, or at the last finite
    loss before it when that is not finite (None when there is none).
    """
    by_step = {r["step"]: r for r in train}
    per_step = train[-1]["tokens_seen"] / train[-1]["step"] if train else 0.0
    skips: dict[int, list[str]] = {}  # rollbacks to one step share a mark
    for r in rollbacks:
        skips.setdefault(r["to_step"], []).append("{}-{}".format(*r["skip"]))
    backs = [(by_step[c]["tokens_seen"] if c in by_step else c * per_step, c, "skip " + ", ".join(texts))
             for c, texts in skips.items()]
    skipped, last = [], None
    for r in train:
        finite = math.isfinite(r["loss"])
        if r.get("skipped"):
            skipped.append((r["tokens_seen"], r["loss"] if finite else last, r["step"]))
        last = r["loss"] if finite else last
    return {"rollback": backs, "skipped": [m for m in skipped if m[1] is not None]}


def run_labels(run_dirs: list[str]) -> list[str]:
    """A legend label per run directory: its basename, with parent folders added where basenames repeat (x/a, y/a)."""
    paths = [os.path.abspath(d).split(os.sep) for d in run_dirs]
    labels = []
    for p in paths:
        k = 1
        while k < len(p) and any(q[-k:] == p[-k:] for q in paths if q != p):
            k += 1
        labels.append(os.sep.join(p[-k:]))
    return [n if n not in labels[:i] else f"{n} #{labels[:i].count(n) + 1}" for i, n in enumerate(labels)]


def running_mean(values: list[float], n: int) -> list[float]:
    """Trailing mean over the last n values (fewer at the start); same length as values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def _tokens(x: float, _pos=None) -> str:
    """Tick label for a token count: 0, 500K, 1M, 1.5M, 10M, 2B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


MOE_KEYS = ("moe_max_load", "moe_bias_range", "moe_aux_loss")


def moe_keys(runs: list[tuple[str, list[dict], list[dict]]]) -> list[str]:
    """The MoE keys of MOE_KEYS that some train record of runs [(label, train, val)] carries with a number, in that
    order; [] when no run records moe_max_load (dense runs), so draw adds the MoE column only for MoE runs."""
    present = {k for _, train, _ in runs for r in train for k in MOE_KEYS if _is_number(r.get(k))}
    return [k for k in MOE_KEYS if k in present] if "moe_max_load" in present else []


def draw(runs: list[tuple[str, list[dict], list[dict]]], out: str, smooth: int = 1,
         rollbacks: list[list[dict]] | None = None) -> None:
    """Write the 2x2 figure of runs [(label, train records, val records)] to out (format from its suffix);
    a column more for downstream tasks, and one for MoE runs (moe_keys).

    rollbacks: each run's read_rollbacks records (None: none), marked with its skipped updates (see marks).

    smooth > 1: the train loss is a running mean over that many records, the raw loss faint behind.
    Raises MissingPackageError without matplotlib (the plot extra), OSError/ValueError if out
    cannot be written.
    """
    matplotlib = require("matplotlib", "plot", "plot.py")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    tasks = sorted({k.split("/")[1] for _, _, val in runs for r in val for k in r if k.startswith("eval/")})
    moe = moe_keys(runs)
    cols = 2 + bool(tasks) + bool(moe)
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 8), constrained_layout=True)
    (ax_loss, ax_lr, *top), (ax_tps, ax_mfu, *bottom) = axes
    ax_acc, ax_norm = top[:bool(tasks)], bottom[:bool(tasks)]
    ax_load, ax_bal = (top[-1], bottom[-1]) if moe else (None, None)
    ax_aux = ax_bal.twinx() if "moe_aux_loss" in moe else None
    markers = "os^Dv<>p"
    for i, (label, train, val) in enumerate(runs):
        color = f"C{i % 10}"
        steps = [r["step"] for r in train]
        ok = [r for r in train if math.isfinite(r["loss"])]
        tokens, loss = [r["tokens_seen"] for r in ok], [r["loss"] for r in ok]
        if smooth > 1:
            ax_loss.plot(tokens, loss, color=color, alpha=0.3, lw=0.8)
            ax_loss.plot(tokens, running_mean(loss, smooth), color=color, lw=1.6,
                         label=f"{label} train (mean of {smooth})")
        else:
            ax_loss.plot(tokens, loss, color=color, lw=1.4, label=f"{label} train")
        keys = sorted({k for r in val for k in r if k == "val_loss" or k.startswith("val_loss/")})
        for j, key in enumerate(keys):
            pts = [(r["tokens_seen"], r[key]) for r in val if _is_number(r.get(key))]
            if pts:
                ax_loss.plot(*zip(*pts), color=color, ls="--", marker=markers[j % len(markers)],
                             ms=6, mec="white", zorder=3,
                             label=f"{label} {key.replace('val_loss', 'val')}")
        events = marks(train, rollbacks[i] if rollbacks else [])
        for k, (x, step, text) in enumerate(events["rollback"]):
            ax_loss.axvline(x, color=color, ls=":", lw=1.2, label=f"{label} rollback (to the dotted step)" if not k
                            else None)
            ax_loss.annotate(text, (x, 1), xycoords=ax_loss.get_xaxis_transform(), rotation=90, fontsize=7,
                             color=color, ha="right", va="top")
            ax_lr.axvline(step, color=color, ls=":", lw=1.2)
        if events["skipped"]:
            x, y, _ = zip(*events["skipped"])
            ax_loss.scatter(x, y, marker="x", s=40, color=color, zorder=4, label=f"{label} update skipped")
        ax_lr.plot(steps, [r["lr"] for r in train], color=color, label=label)
        ax_tps.plot(steps, [r["tokens_per_sec"] for r in train], color=color, label=label)
        ax_mfu.plot(steps, [100 * r["mfu"] for r in train], color=color, label=label)
        for key, ax, style in (("moe_max_load", ax_load, "-"), ("moe_bias_range", ax_bal, "-"),
                               ("moe_aux_loss", ax_aux, "--")):
            pts = [(r["step"], r[key]) for r in train if _is_number(r.get(key))] if ax is not None else []
            if pts:
                ax.plot(*zip(*pts), color=color, ls=style, label=f"{label} {key}")
        for ax, metric in zip(ax_acc + ax_norm, ("acc", "acc_norm")):
            for j, task in enumerate(tasks):
                pts = [(r["tokens_seen"], 100 * r[key]) for r in val if _is_number(r.get(key := f"eval/{task}/{metric}"))]
                if pts:
                    ax.plot(*zip(*pts), color=color, marker=markers[j % len(markers)], ms=6, mec="white",
                            label=f"{label} {task}")
    ax_loss.set(title="Loss", xlabel="tokens seen", ylabel="cross-entropy (nats/token)")
    ax_loss.xaxis.set_major_formatter(FuncFormatter(_tokens))
    ax_loss.legend(fontsize=8, loc="best")
    ax_lr.set(title="Learning rate", xlabel="step", ylabel="lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_tps.set(title="Throughput", xlabel="step", ylabel="tokens/s (all ranks)")
    ax_tps.yaxis.set_major_formatter(FuncFormatter(_tokens))
    ax_mfu.set(title="MFU", xlabel="step", ylabel="MFU (%)")
    for ax, metric in zip(ax_acc + ax_norm, ("acc", "acc_norm")):
        ax.set(title=f"Downstream {metric}", xlabel="tokens seen", ylabel=f"{metric} (%)")
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.legend(fontsize=8, loc="best")
    if moe:
        ax_load.axhline(1.0, color="gray", ls=":", lw=1.0, label="even load")
        ax_load.set(title="MoE load", xlabel="step", ylabel="busiest expert / mean (max over layers)")
        ax_load.legend(fontsize=8, loc="best")
        ax_bal.set(title="MoE balancing", xlabel="step",
                   ylabel="expert bias range (max - min)" if "moe_bias_range" in moe else "")
        if ax_aux is not None:
            ax_aux.set_ylabel("aux loss per token (dashed)")
        handles = [h for ax in (ax_bal, ax_aux) if ax is not None for h in ax.get_legend_handles_labels()[0]]
        if handles:
            ax_bal.legend(handles=handles, fontsize=8, loc="best")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(", ".join(label for label, _, _ in runs))
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command line: draws the runs into --out, prints 'wrote OUT (...)' and returns 0.

    Bad input (no run, a missing/empty/malformed metrics.jsonl, no matplotlib, an unwritable --out):
    one line 'error: ...' on stderr and status 2 (argparse's errors raise SystemExit(2)).
    """
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", required=True, help="PNG file to write (its folder is created)")
    p.add_argument("--smooth", type=number(int, lambda v: v >= 1, "an int >= 1"), default=1,
                   help="running mean over N train records for the train loss (1: raw)")
    a = p.parse_args(argv)
    if not a.run_dirs:
        p.error("no run directories given: pass one or more RUN_DIRs holding metrics.jsonl")
    try:
        require("matplotlib", "plot", "plot.py")
        runs = [(label, *read_metrics(RunDir(d).metrics))
                for label, d in zip(run_labels(a.run_dirs), a.run_dirs)]
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", a.out):  # s3://b/p.png would become a local folder 's3:'
            raise PlotError(f"--out {a.out!r} is a URL; pass a local file ending in .png")
        if os.path.isdir(a.out):  # matplotlib would write OUT.png beside it
            raise PlotError(f"--out {a.out!r} is a folder; pass a file ending in .png, e.g. {os.path.join(a.out, 'curves.png')}")
        rollbacks = [read_rollbacks(RunDir(d).metrics) for d in a.run_dirs]
        try:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            draw(runs, a.out, a.smooth, rollbacks)
        except (OSError, ValueError) as e:
            raise PlotError(f"cannot write {a.out} ({' '.join(str(e).split())}): pass a writable --out ending in .png")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {a.out} ({len(runs)} runs, {sum(len(t) for _, t, _ in runs)} train records)", flush=True)
    return 0


if __name__ == "__main__":
    exit_command(main())
