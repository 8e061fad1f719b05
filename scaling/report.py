"""A ladder's report: the law fitted to its points, every prediction with its bootstrap interval, the backtest and
the planner; written as ladder.md (for people), ladder.json (for scripts) and ladder.png.

Units: params are non-embedding parameters N, tokens the training tokens D (steps x global_batch_size x seq_len),
losses nats/token, flops C = 6 N D. Bad points raise law.py's ValueError (one sentence), which ladder.py reports.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from scaling.law import ChinchillaLaw, backtest, bootstrap_interval, fit_chinchilla, fit_for, fit_power

LEVEL = 0.9
"""The intervals' coverage: the 5% and 95% quantiles of the bootstrap's predictions."""


@dataclasses.dataclass
class Point:
    """One trained run of the ladder: a rung at one budget (a point of the fit), or a check."""

    rung: str
    """Its size, WIDTHxDEPTH."""
    params: int
    """Non-embedding parameters N."""
    tokens: int
    """Training tokens D: steps x global_batch_size x seq_len."""
    val_loss: float
    """The run's final val_loss, exactly as its metrics.jsonl holds it."""
    run_dir: str
    budget: float = 1.0
    """Its tokens as a multiple of the ladder's tokens_per_param."""


@dataclasses.dataclass
class Query:
    """A prediction wanted: the target, or a planner's compute (then params and tokens come from the fit)."""

    name: str
    params: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0
    """> 0: the planner's compute C; params and tokens are the compute-optimal ones the fit gives."""


def analyse(points: list[Point], checks: list[Point], queries: list[Query]) -> dict:
    """ladder.json's content: {"form", "fit", "points", "checks", "backtest", "predictions"}.

    The fit is over every point (params, tokens, val_loss), in the form they carry (law.fit_for: L(N, D)
    with several tokens-per-parameter budgets, else L(N)); each check and query is predicted with the
    LEVEL bootstrap interval over the points (law.bootstrap_interval); the backtest fits the smallest k
    rungs and predicts the next larger one, in the same form, for every k it can be fitted on
    (law.backtest). A planner query under L(N), or where the fit has no optimum, gets an "error".
    Raises ValueError (law.py's) when the points cannot determine the form.
    """
    n, d, loss = (np.array([getattr(p, k) for p in points], dtype=float) for k in ("params", "tokens", "val_loss"))
    law = fit_for(n, d, loss)
    fit = fit_chinchilla if isinstance(law, ChinchillaLaw) else fit_power  # every refit and window in this form

    def predict(at_n: float, at_d: float) -> tuple[float, list[float]]:
        lo, hi = bootstrap_interval(n, d, loss, at_n, at_d, fitter=fit, level=LEVEL)
        return float(law.predict(at_n, at_d)), [lo, hi]

    out_checks = []
    for c in checks:
        pred, interval = predict(c.params, c.tokens)
        out_checks.append({"rung": c.rung, "params": c.params, "tokens": c.tokens, "predicted": pred,
                           "interval": interval, "measured": c.val_loss, "run_dir": c.run_dir})
    predictions = []
    for q in queries:
        at_n, at_d = q.params, q.tokens
        if q.flops:
            try:
                if not isinstance(law, ChinchillaLaw):
                    raise ValueError("the points hold one tokens-per-parameter budget: L(N) has no D to plan")
                at_n, at_d, _ = law.optimal(q.flops)
            except ValueError as e:  # no optimum: said in the report, which is still written
                predictions.append({"name": q.name, "flops": q.flops, "planned": True, "error": str(e)})
                continue
        pred, interval = predict(at_n, at_d)
        predictions.append({"name": q.name, "flops": q.flops or 6 * at_n * at_d, "params": at_n, "tokens": at_d,
                            "predicted": pred, "interval": interval, "planned": bool(q.flops)})
    names = {}
    for p in points:
        names.setdefault(p.params, p.rung)
    by_size = sorted(names)
    rungs = [(size, [(p.tokens, p.val_loss) for p in points if p.params == size]) for size in by_size]
    tested = [{**b, "fit_on": [names[s] for s in by_size[:b["fit_on"]]], "predicted_rung": names[b["params"]]}
              for b in backtest(rungs, fitter=fit)]
    return {"form": law.form, "fit": law.as_dict(),
            "points": [{"rung": p.rung, "params": p.params, "tokens": p.tokens, "val_loss": p.val_loss,
                        "run_dir": p.run_dir, "budget": p.budget} for p in points],
            "checks": out_checks, "backtest": tested, "predictions": predictions}


def _interval(x: dict) -> str:
    return f"{x['predicted']:.4f} (90% interval {x['interval'][0]:.4f} .. {x['interval'][1]:.4f})"


def markdown(result: dict, command: str) -> list[str]:
    """ladder.md's lines: the points, the form and fit, the predictions, the checks, the backtest, the command."""
    fit = ", ".join(f"{k} = {v:.4g}" for k, v in result["fit"].items())
    lines = ["| rung | budget | parameters (non-embedding) | tokens | final val_loss | run directory |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {p['rung']} | {p['budget']:g} | {p['params']:,} | {p['tokens']:,} | {p['val_loss']:.4f} | "
              f"{p['run_dir']} |" for p in result["points"]]
    lines += ["", f"Fit ({len(result['points'])} points): {result['form']} with {fit}.", ""]
    for q in result["predictions"]:
        if "error" in q:
            lines.append(f"Planner at C = {q['flops']:.3g} FLOPs (6 N D): no plan, {q['error']}.")
            continue
        what = f"Planner at C = {q['flops']:.3g} FLOPs (6 N D): the compute-optimal" if q["planned"] else \
            f"Target {q['name']}:"
        lines.append(f"{what} N = {q['params']:,.0f} parameters, D = {q['tokens']:,.0f} tokens "
                     f"({q['tokens'] / q['params']:.3g} per parameter): predicted val_loss {_interval(q)}.")
    if result["checks"]:
        lines += ["", "| check (not in the fit) | parameters | tokens | predicted | 90% interval | measured | error |",
                  "|---|---|---|---|---|---|---|"]
        for c in result["checks"]:
            err = (c["predicted"] - c["measured"]) / c["measured"]
            inside = "inside" if c["interval"][0] <= c["measured"] <= c["interval"][1] else "outside"
            lines.append(f"| {c['rung']} | {c['params']:,} | {c['tokens']:,} | {c['predicted']:.4f} | "
                         f"{c['interval'][0]:.4f} .. {c['interval'][1]:.4f} | {c['measured']:.4f} ({inside}) | "
                         f"{100 * err:+.2f}% |")
    lines += ["", "Backtest (expanding window: fit on the smallest rungs, predict the next larger one):"]
    if result["backtest"]:
        lines += ["", "| fit on | predicted rung | tokens | predicted | measured | error |", "|---|---|---|---|---|---|"]
        lines += [f"| {', '.join(b['fit_on'])} | {b['predicted_rung']} | {b['tokens']:,.0f} | {b['predicted']:.4f} | "
                  f"{b['measured']:.4f} | {100 * b['rel_error']:+.2f}% |" for b in result["backtest"]]
        mean = float(np.mean([abs(b["rel_error"]) for b in result["backtest"]]))
        lines.append(f"\nMean |error| over the {len(result['backtest'])} backtest predictions: {100 * mean:.2f}%.")
    else:
        lines.append("none: no smaller set of rungs can be fitted with this form (add rungs).")
    lines += ["", f"Made by: `{command}`"]
    return lines


def write(result: dict, ladder_dir: str, command: str) -> list[str]:
    """ladder.md, ladder.json and ladder.png (when matplotlib is installed) into ladder_dir; returns ladder.md's
    lines (and a line saying why there is no figure)."""
    lines = markdown(result, command)
    with open(os.path.join(ladder_dir, "ladder.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(ladder_dir, "ladder.json"), "w") as f:
        json.dump({**result, "command": command}, f, indent=1)
    try:
        import matplotlib  # optional: the [plot] extra
    except ImportError:
        return lines + ["(no ladder.png: pip install 'llama-pretrain[plot]' for matplotlib)"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = result["fit"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    planned = [q for q in result["predictions"] if "error" not in q]
    pts, extra = result["points"], result["checks"] + planned
    grid = np.geomspace(min(p["params"] for p in pts) / 1.5,
                        max(p["params"] for p in pts + extra) * 1.5, 200)
    for i, budget in enumerate(sorted({p["budget"] for p in pts})):
        mine = [p for p in pts if p["budget"] == budget]
        ratio = float(np.mean([p["tokens"] / p["params"] for p in mine]))
        curve = law["E"] + law["A"] * grid ** -law["alpha"] + \
            (law["B"] * (ratio * grid) ** -law["beta"] if "B" in law else 0.0)
        ax.plot(grid, curve, color=f"C{i}", lw=1)
        ax.scatter([p["params"] for p in mine], [p["val_loss"] for p in mine], color=f"C{i}", zorder=3,
                   label=f"budget {budget:g} ({ratio:.3g} tokens/param)")
    for c in result["checks"]:
        ax.scatter([c["params"]], [c["measured"]], marker="x", s=60, color="k", zorder=4,
                   label=f"check {c['rung']} (measured)")
    for i, q in enumerate(result["checks"] + planned):
        y = q["predicted"]
        ax.errorbar([q["params"]], [y], yerr=[[y - q["interval"][0]], [q["interval"][1] - y]], capsize=4,
                    fmt="*" if q.get("planned") else "s", zorder=4, color=f"C{i + 5}",
                    label=(f"planner: C = {q['flops']:.2g}" if q.get("planned") else
                           f"{q.get('name', q.get('rung'))} (predicted, 90%)"))
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("final val_loss")
    ax.set_title(result["form"], fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(ladder_dir, "ladder.png"), dpi=100)
    plt.close(fig)
    return lines
