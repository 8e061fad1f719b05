"""A model ladder: train small proxies of a target at a fixed tokens-per-parameter ratio, fit L(N), predict the target.

    python ladder.py --config TARGET.toml --rungs 32x2,48x2,64x2,96x2 [--check 144x2] [--tokens_per_param 20]
        [--ladder_dir runs/ladder] [--launcher "torchrun --standalone --nproc_per_node=8"] [--section.field VALUE ...]

TARGET.toml is the run to predict, under model.parametrization mup or completep (its base_dim and
base_n_layers name the proxy the hyperparameters were tuned at, so each rung trains with the
same optim.lr and the model's own multipliers). A rung WIDTHxDEPTH is the target's shape at
model.dim WIDTH and model.n_layers DEPTH (head_dim, the n_heads/n_kv_heads ratio and the
ffn_dim/dim ratio kept; ffn_dim rounded up to a multiple of 32), trained for ceil(tokens_per_param
x N / (global_batch_size x seq_len)) steps, N its parameters outside the embedding
(model.num_params), with the target's warmup as the same fraction of the run and its schedule.
Each rung is an ordinary run directory ladder_dir/rung_WIDTHxDEPTH started with the launcher
(any layout: torchrun, srun): a rung that finished is skipped, one that was interrupted resumes.
Then L(N) = E + A N^-alpha is fitted to the rungs' final val_loss (least squares; alpha on a
grid, E and A closed form), the target's loss predicted with an interval (the spread of the
leave-one-out fits), and ladder_dir/ladder.md and ladder.png written. --check sizes are trained
like rungs, kept out of the fit, and reported as predicted against measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np

from config import Config, parse_config
from core import cli
from core.errors import ConfigError, UserError, report
from model import ModelArgs, num_params
from storage.rundir import RunDir, check_local_dir

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class Rung:
    """One size of the ladder: its shape, steps, run directory and (once trained) final val_loss."""

    name: str
    args: ModelArgs
    steps: int
    run_dir: str
    val_loss: float | None = None

    @property
    def n_params(self) -> int:
        return num_params(self.args, exclude_embedding=True)


def parse_size(text: str) -> tuple[int, int]:
    """'WIDTHxDEPTH' -> (width, depth); ConfigError otherwise."""
    try:
        width, depth = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"ladder size '{text}' is not WIDTHxDEPTH (e.g. 64x2)") from None
    if width <= 0 or depth <= 0:
        raise ConfigError(f"ladder size '{text}': width and depth must be > 0")
    return width, depth


def rung_args(target: ModelArgs, width: int, depth: int) -> ModelArgs:
    """The target's shape at dim width and n_layers depth; ConfigError naming the size when it cannot be built."""
    heads = width // target.head_dim
    kv = heads * target.n_kv_heads // target.n_heads
    ffn = 32 * math.ceil(target.ffn_dim / target.dim * width / 32)
    if heads < 1 or width % target.head_dim or kv < 1 or heads % kv:
        raise ConfigError(f"ladder size {width}x{depth}: width must be a multiple of the target's head_dim "
                          f"({target.head_dim}) with whole key/value heads (query heads per key/value head: "
                          f"{target.n_heads // target.n_kv_heads})")
    try:
        return dataclasses.replace(target, dim=width, n_layers=depth, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn)
    except ValueError as e:
        raise ConfigError(f"ladder size {width}x{depth}: {e}") from None


def plan(cfg: Config, sizes: list[str], tokens_per_param: float, ladder_dir: str) -> list[Rung]:
    """The rungs of sizes under the target cfg; ConfigError before anything runs for a size or target that cannot be."""
    if cfg.model.parametrization == "sp":
        raise ConfigError("the ladder transfers the target's hyperparameters to its rungs: set "
                          "--model.parametrization mup (or completep) with --model.base_dim, the width they were "
                          "tuned at")
    if not 0 < tokens_per_param < math.inf:
        raise ConfigError(f"--tokens_per_param must be a finite number > 0, got {tokens_per_param}")
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    rungs = []
    for size in sizes:
        width, depth = parse_size(size)
        size = f"{width}x{depth}"  # one spelling (16X1, 016x1 -> 16x1), so a size given twice is seen as one
        args = rung_args(cfg.model, width, depth)
        steps = math.ceil(tokens_per_param * num_params(args, exclude_embedding=True) / tokens_per_step)
        rungs.append(Rung(size, args, steps, os.path.join(ladder_dir, f"rung_{size}")))
    return rungs


def check_inputs(rungs: list[Rung], launcher: list[str], ladder_dir: str) -> None:
    """ConfigError before anything runs: a size given twice (rungs and checks share run directories), a launcher
    that is not a command, a ladder_dir that is not a local folder this process can create or write (a URL, a file,
    a read-only or impossible location; rundir.check_local_dir)."""
    names = [r.name for r in rungs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"ladder size {twice[0]} is given twice (in --rungs or --check); give each size once")
    if not launcher or shutil.which(launcher[0]) is None:
        raise ConfigError(f"--launcher {shlex.join(launcher)!r}: {launcher[0] if launcher else 'an empty command'} "
                          f"is not a command here; e.g. --launcher \"torchrun --standalone --nproc_per_node=2\"")
    check_local_dir(ladder_dir, "--ladder_dir", "; each rung is a run directory, which is local")


def final_val_loss(run_dir: str, steps: int) -> float | None:
    """The val_loss logged at step `steps` of a finished run directory, or None if it has not finished there."""
    try:
        with open(RunDir(run_dir).exit_record) as f:
            done = json.load(f)
        with open(RunDir(run_dir).metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    if done.get("status") != "finished" or done.get("step") != steps:
        return None
    return next((r["val_loss"] for r in reversed(records) if r.get("step") == steps and "val_loss" in r), None)


def train(rung: Rung, cfg: Config, argv: list[str], launcher: list[str], script: str) -> float:
    """Train (or resume, or skip) one rung; returns its final val_loss. UserError if the run fails."""
    done = final_val_loss(rung.run_dir, rung.steps)
    if done is not None:
        print(f"[ladder] {rung.name}: finished before, val_loss {done:.4f}", flush=True)
        return done
    a = rung.args
    warmup = min(rung.steps, round(cfg.optim.warmup_steps * rung.steps / cfg.train.steps))
    cmd = [*launcher, os.path.join(ROOT, script), *argv, "--run_dir", rung.run_dir,
           "--model.dim", str(a.dim), "--model.n_layers", str(a.n_layers), "--model.n_heads", str(a.n_heads),
           "--model.n_kv_heads", str(a.n_kv_heads), "--model.ffn_dim", str(a.ffn_dim),
           "--train.steps", str(rung.steps), "--optim.warmup_steps", str(warmup),
           "--train.val_interval", str(cfg.train.val_interval or rung.steps)]  # the score: val_loss at the end
    print(f"[ladder] {rung.name}: {rung.n_params:,} parameters, {rung.steps} steps: {shlex.join(cmd)}", flush=True)
    if subprocess.run(cmd).returncode != 0:  # in the caller's directory: its relative paths hold
        raise UserError(f"ladder rung {rung.name} failed (its run directory {rung.run_dir} keeps what it did; "
                        f"run the ladder again to resume it)")
    done = final_val_loss(rung.run_dir, rung.steps)
    if done is None:
        raise UserError(f"ladder rung {rung.name}: {rung.run_dir} has no val_loss at step {rung.steps}")
    return done


def fit(n: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """(E, A, alpha) of L(N) = E + A N^-alpha by least squares over n (parameters) and loss, alpha in [0.01, 2].

    For each alpha the best E >= 0 and A >= 0 are linear least squares; the alpha of the smallest
    squared error wins, searched on a grid of 2000 and then twice on a 100x finer one around it. Needs >= 3 points. Source of the form: Kaplan
    et al. 2020 / Hoffmann et al. 2022 (Chinchilla's L(N) term with an irreducible E).
    """
    def solve(alpha: float) -> tuple[float, float, float]:
        x = n ** -alpha
        (e, a), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), loss, rcond=None)
        if e < 0:  # a loss has a floor >= 0: the best pure power law instead
            e, a = 0.0, float(x @ loss / (x @ x))
        return (float(((e + a * x - loss) ** 2).sum()) if a >= 0 else math.inf), float(e), float(a)

    best = (math.inf, 0.0, 0.0, 0.0)
    grid = np.linspace(0.01, 2.0, 2000)
    for _ in range(3):  # the grid, then twice a finer one around its best alpha
        for alpha in grid:
            err, e, a = solve(float(alpha))
            if err < best[0]:
                best = (err, e, a, float(alpha))
        step = grid[1] - grid[0]
        grid = np.linspace(max(1e-4, best[3] - step), best[3] + step, 201)
    return best[1], best[2], best[3]


def predict(n: np.ndarray, loss: np.ndarray, target: float) -> tuple[float, float, float]:
    """(prediction, low, high) at target parameters: the fit of every point, and the range of leave-one-out fits."""
    e, a, alpha = fit(n, loss)
    loo = [fit(np.delete(n, i), np.delete(loss, i)) for i in range(len(n))] if len(n) > 3 else []
    values = [e + a * target ** -alpha] + [le + la * target ** -lal for le, la, lal in loo]
    return values[0], min(values), max(values)


def write_report(rungs: list[Rung], checks: list[Rung], target: ModelArgs, ladder_dir: str) -> list[str]:
    """ladder.md (the table, the fit, the prediction, the checks) and ladder.png; returns the markdown lines."""
    n = np.array([r.n_params for r in rungs], dtype=float)
    loss = np.array([r.val_loss for r in rungs])
    e, a, alpha = fit(n, loss)
    n_target = num_params(target, exclude_embedding=True)
    pred, lo, hi = predict(n, loss, n_target)
    spread = (f"leave-one-out range {lo:.4f} .. {hi:.4f}" if len(rungs) > 3 else
              "no leave-one-out range: it needs 4 or more rungs")
    lines = ["| rung | dim x n_layers | parameters (non-embedding) | steps | final val_loss | fit |", "|---|---|---|---|---|---|"]
    for r in rungs:
        lines.append(f"| {r.name} | {r.args.dim} x {r.args.n_layers} | {r.n_params:,} | {r.steps} | "
                     f"{r.val_loss:.4f} | {e + a * r.n_params ** -alpha:.4f} |")
    lines += ["", f"Fit: L(N) = {e:.4f} + {a:.4g} N^-{alpha:.4f}.",
              f"Target {target.dim} x {target.n_layers} ({n_target:,} parameters): predicted val_loss {pred:.4f} "
              f"({spread})."]
    for c in checks:
        p, clo, chi = predict(n, loss, c.n_params)
        lines.append(f"Check {c.name} ({c.n_params:,} parameters, not in the fit): predicted {p:.4f} (range "
                     f"{clo:.4f} .. {chi:.4f}), measured {c.val_loss:.4f}: error {100 * (p - c.val_loss) / c.val_loss:+.2f}%.")
    with open(os.path.join(ladder_dir, "ladder.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
    except ImportError:
        return lines + ["(no ladder.png: pip install 'llama-pretrain[plot]' for matplotlib)"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    grid = np.geomspace(n.min() / 1.5, max([n_target, *(c.n_params for c in checks)]) * 1.5, 200)
    ax.plot(grid, e + a * grid ** -alpha, label=f"fit: {e:.3f} + {a:.3g} N^-{alpha:.3f}")
    ax.scatter(n, loss, label="rungs", zorder=3)
    ax.errorbar([n_target], [pred], yerr=[[pred - lo], [hi - pred]], fmt="s", capsize=4, label="target (predicted)")
    if checks:
        ax.scatter([c.n_params for c in checks], [c.val_loss for c in checks], marker="x", s=60, zorder=3,
                   label="checks (measured, not fitted)")
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("final val_loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(ladder_dir, "ladder.png"), dpi=100)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rungs", required=True, help="comma-separated WIDTHxDEPTH sizes to fit (>= 3)")
    parser.add_argument("--check", default="", help="comma-separated sizes trained but kept out of the fit")
    parser.add_argument("--tokens_per_param", type=cli.number(float, lambda v: 0 < v < math.inf, "a finite number > 0"),
                        default=20.0)
    parser.add_argument("--ladder_dir", default="runs/ladder")
    parser.add_argument("--launcher", default=f"{sys.executable} -m torch.distributed.run --standalone "
                                              f"--nproc_per_node=1", help="the command that starts each rung")
    parser.add_argument("--script", default="train_fsdp.py", choices=["train_fsdp.py", "train_2d.py"])
    try:
        a, rest = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or a bad flag already reported as one error line
        return e.code
    try:
        cfg = parse_config(rest, require_file=True)
        sizes = [s for s in a.rungs.split(",") if s]
        if len(sizes) < 3:
            raise ConfigError(f"--rungs needs at least 3 sizes to fit E + A N^-alpha, got {len(sizes)}")
        rungs = plan(cfg, sizes, a.tokens_per_param, a.ladder_dir)
        checks = plan(cfg, [s for s in a.check.split(",") if s], a.tokens_per_param, a.ladder_dir)
        try:
            launcher = shlex.split(a.launcher)
        except ValueError as e:  # an unclosed quote
            raise ConfigError(f"--launcher {a.launcher!r} cannot be read as a command ({e}); close its quotes") from None
        check_inputs(rungs + checks, launcher, a.ladder_dir)
        for r in rungs + checks:
            r.val_loss = train(r, cfg, rest, launcher, a.script)
        print("\n".join(write_report(rungs, checks, cfg.model, a.ladder_dir)), flush=True)
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
