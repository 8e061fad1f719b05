"""A model ladder: train small proxies of a target at several token budgets, fit a scaling law, predict and plan.

    python ladder.py --config TARGET.toml --rungs 32x2,48x2,64x2,96x2 [--check 144x2] [--budgets 0.5,1,2]
        [--tokens_per_param 20] [--flops C] [--target] [--ladder_dir runs/ladder]
        [--launcher "torchrun --standalone --nproc_per_node=8"] [--section.field VALUE ...]

TARGET.toml is the run to predict, under model.parametrization mup or completep (each rung trains with
its optim.lr). A rung WIDTHxDEPTH is the target's shape at that dim and n_layers. With one budget each
rung is one run and L(N) is fitted; with several, each rung trains one constant-LR trunk and a WSD
cooldown branch per budget, and L(N, D) is fitted (scaling/law.py). Every run directory is ordinary
(finished: skipped; interrupted: resumed); the data is prepared once. docs/transfer.md tells the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

from checkpoint import complete_checkpoints
from config import Config, parse_config
from core import cli
from core.cli import exit_command
from core.errors import ConfigError, UserError, report
from model import ModelArgs, num_params
from observability.progress import duration
from optimization.optimizers import OptimConfig, decayed
from parallel import compose, composition, pipeline_stages
from prepare import prepare
from scaling import report as ladder_report
from scaling.law import SAME_RATIO, check_points
from storage.rundir import RunDir, check_local_dir

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class Run:
    """One run directory of the ladder: a rung at one budget (a branch, or the rung's one plain run), or a check."""

    budget: float
    steps: int
    start: int
    """The trunk's step it loads (where its decay begins); 0: it starts from scratch (a plain run)."""
    run_dir: str
    val_loss: float | None = None


@dataclasses.dataclass
class Rung:
    """One size of the ladder: its shape, warmup, folder and runs (one per budget)."""

    name: str
    args: ModelArgs
    warmup: int
    run_dir: str
    runs: list[Run]

    @property
    def n_params(self) -> int:
        return num_params(self.args, exclude_embedding=True)

    @property
    def trunk(self) -> str:
        return os.path.join(self.run_dir, "trunk")


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


def decay_start(optim: OptimConfig, steps: int) -> int:
    """The steps of a WSD run of `steps` steps before its decay (optimizers.decayed at the peak), which a trunk at
    constant LR runs alike: the largest k with decayed(k) == 1, so step k + 1 is the first one decayed."""
    lo, hi = 0, steps
    while lo < hi:
        mid = (lo + hi + 1) // 2
        peak = decayed(mid, 0, steps, 0.0, "wsd", optim.decay_fraction, optim.decay_shape) == 1.0
        lo, hi = (mid, hi) if peak else (lo, mid - 1)
    return lo


def budgets_arg(text: str) -> list[float]:
    """argparse type of --budgets: increasing finite numbers > 0, comma-separated."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0 in increasing order (multiples of "
                                         f"--tokens_per_param, e.g. 0.5,1,2,4), got {text!r}")
    return values


def plan(cfg: Config, sizes: list[str], tokens_per_param: float, ladder_dir: str,
         budgets: tuple[float, ...] = (1.0,)) -> list[Rung]:
    """The rungs of sizes under the target cfg, each with a run per budget; ConfigError before anything runs for a
    size, target or budget that cannot be."""
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
        n = num_params(args, exclude_embedding=True)
        steps = [math.ceil(b * tokens_per_param * n / tokens_per_step) for b in budgets]
        if max(steps) >= 2 ** 63:  # train.steps is a 64-bit int: no run could be launched, and the plan overflows
            b = budgets[steps.index(max(steps))]
            raise ConfigError(f"--budgets {b:g} gives rung {size} {max(steps):.3g} steps, more than train.steps can "
                              f"hold (2**63 - 1); use smaller budgets")
        if len(set(steps)) < len(steps):
            raise ConfigError(f"--budgets {','.join(f'{b:g}' for b in budgets)} give rung {size} the same steps "
                              f"twice ({', '.join(map(str, steps))}): space the budgets further apart")
        base = math.ceil(tokens_per_param * n / tokens_per_step)
        warmup = min(base, round(cfg.optim.warmup_steps * base / cfg.train.steps))
        folder = os.path.join(ladder_dir, f"rung_{size}")
        runs = [Run(budgets[0], steps[0], 0, folder)] if len(budgets) == 1 else \
            [Run(b, s, decay_start(cfg.optim, s), os.path.join(folder, f"budget_{b:g}")) for b, s in zip(budgets, steps)]
        rungs.append(Rung(size, args, warmup, folder, runs))
    return rungs


def check_inputs(rungs: list[Rung], launcher: list[str], ladder_dir: str, cfg: Config | None = None,
                 script: str = "train_fsdp.py") -> None:
    """ConfigError before anything runs: a size given twice (rungs and checks share run directories), a launcher
    that is not a command, a ladder_dir that is not a local folder this process can write (rundir.check_local_dir);
    and the trainer's refusals that need no world size (a SetupError), which every run would meet only after the
    data: what does not run together under script (docs/cluster.md), compose.check_moe's, a rung under parallel.pp."""
    if cfg is not None:
        composition.check_composition(cfg, script)
        compose.check_moe(cfg)
        shallow = min(rungs, key=lambda r: r.args.n_layers)
        p, v = cfg.parallel, pipeline_stages.stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank)
        if p.pp > 1 and p.pp * v > shallow.args.n_layers:  # every stage of a rung (v per rank) needs a block
            raise ConfigError(f"ladder size {shallow.name}: parallel.pp x its stages per rank ({p.pp} x {v}) is more "
                              f"than its {shallow.args.n_layers} layers; use parallel.pp <= {shallow.args.n_layers // v} or deeper sizes")
    names = [r.name for r in rungs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"ladder size {twice[0]} is given twice (in --rungs or --check); give each size once")
    if not launcher or shutil.which(launcher[0]) is None:
        raise ConfigError(f"--launcher {shlex.join(launcher)!r}: {launcher[0] if launcher else 'an empty command'} "
                          f"is not a command here; e.g. --launcher \"torchrun --standalone --nproc_per_node=2\"")
    check_local_dir(ladder_dir, "--ladder_dir", "; each rung is a run directory, which is local")


def check_form(n_rungs: int, budgets: list[float], cfg: Config) -> None:
    """ConfigError unless the points can carry the form, with more points than its parameters: L(N) (one budget)
    needs 4 sizes; L(N, D) (several, under WSD) 3 sizes and 6 points."""
    if len(budgets) == 1:
        if n_rungs < 4:
            raise ConfigError(f"--rungs: L(N) = E + A/N^alpha has 3 parameters and needs more points than that: "
                              f"give 4 or more sizes, got {n_rungs}")
        return
    if n_rungs < 3 or n_rungs * len(budgets) < 6:
        raise ConfigError(f"--rungs x --budgets: L(N, D) = E + A/N^alpha + B/D^beta has 5 parameters and needs 3 or "
                          f"more sizes and more points than that (rungs x budgets >= 6), got {n_rungs} x "
                          f"{len(budgets)}")
    close = [(x, y) for x, y in zip(budgets, budgets[1:]) if y / x < SAME_RATIO]
    if close:
        raise ConfigError(f"--budgets {close[0][0]:g} and {close[0][1]:g} are less than {SAME_RATIO:g}x apart: the fit "
                          f"counts them as one tokens-per-parameter budget; space the budgets further apart")
    if cfg.optim.schedule != "wsd":
        raise ConfigError(f"--budgets {','.join(f'{b:g}' for b in budgets)} branches WSD cooldowns off one "
                          f"constant-LR trunk per rung: set --optim.schedule wsd (it is '{cfg.optim.schedule}')")


def check_flags(rest: list[str], ladder_flags: list[str]) -> None:
    """ConfigError for a flag that is neither the ladder's nor the trainer's (--section.field, --config, ...),
    naming the ladder's flags and the nearest one: argparse leaves an unknown flag to the trainer's parser."""
    top = {"config", *(f.name for f in dataclasses.fields(Config))}
    for arg in rest:
        key = arg[2:].split("=", 1)[0]
        if arg.startswith("--") and "." not in key and key not in top:
            near = difflib.get_close_matches(f"--{key}", ladder_flags, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ConfigError(f"unknown flag --{key}: {hint}the ladder's flags are {', '.join(ladder_flags)}; the "
                              f"trainer's are --config and --section.field (see --help)")


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


def launch(cmd: list[str]) -> int:
    """Run cmd to its end (in the caller's directory: its relative paths hold); its exit status.

    Ctrl-C signals the terminal's whole foreground group, so the child stops by itself (saving its
    step): wait for it, then raise KeyboardInterrupt. subprocess.run would kill it after 0.25 s.
    """
    proc = subprocess.Popen(cmd)
    interrupted = False
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    return rc


class Ladder:
    """The runs of a ladder, in order, each launched as an ordinary run directory with the launcher."""

    def __init__(self, cfg: Config, argv: list[str], launcher: list[str], script: str, data_flags: list[str]):
        self.cfg, self.argv, self.launcher, self.script, self.data_flags = cfg, argv, launcher, script, data_flags

    def command(self, rung: Rung, run_dir: str, steps: int, *extra: str) -> list[str]:
        a = rung.args
        return [*self.launcher, os.path.join(ROOT, self.script), *self.argv, *self.data_flags, "--run_dir", run_dir,
                "--model.dim", str(a.dim), "--model.n_layers", str(a.n_layers), "--model.n_heads", str(a.n_heads),
                "--model.n_kv_heads", str(a.n_kv_heads), "--model.ffn_dim", str(a.ffn_dim),
                "--train.steps", str(steps), "--optim.warmup_steps", str(rung.warmup), *extra]

    def start(self, what: str, cmd: list[str], run_dir: str) -> None:
        print(f"[ladder] {what}: {shlex.join(cmd)}", flush=True)
        if launch(cmd) != 0:
            raise UserError(f"ladder {what} failed (its run directory {run_dir} keeps what it did; run the ladder "
                            f"again to resume it)")

    def trunk_at(self, rung: Rung, run: Run) -> str:
        """The trunk's checkpoint of step run.start, trained up to there (resumed) if it is not yet."""
        root = RunDir(rung.trunk).checkpoints
        done = dict(complete_checkpoints(root))
        if run.start not in done:
            if max(done, default=0) > run.start:
                raise UserError(f"ladder rung {rung.name}: its trunk {rung.trunk} has no checkpoint of step "
                                f"{run.start}, where budget {run.budget:g} branches off (pruned after step "
                                f"{max(done)}); delete {rung.trunk} to train the trunk again")
            self.start(f"rung {rung.name} trunk to step {run.start} (constant LR)",
                       self.command(rung, rung.trunk, run.start, "--train.val_interval", "0",
                                    "--optim.min_lr_ratio", "1"), rung.trunk)
            done = dict(complete_checkpoints(root))
        if run.start not in done:
            raise UserError(f"ladder rung {rung.name}: the trunk {rung.trunk} finished without a checkpoint of step "
                            f"{run.start}")
        return done[run.start]

    def train(self, rung: Rung, run: Run, what: str) -> float:
        """Train (or resume, or skip) one run of rung; returns its final val_loss. UserError if the run fails."""
        done = final_val_loss(run.run_dir, run.steps)
        if done is not None:
            print(f"[ladder] {what}: finished before, val_loss {done:.4f}", flush=True)
            return done
        extra = ["--train.val_interval", str(self.cfg.train.val_interval or run.steps)]  # the score: at the end
        if run.start:
            extra += ["--checkpoint.load_from", self.trunk_at(rung, run)]
        self.start(f"{what}, {run.steps} steps", self.command(rung, run.run_dir, run.steps, *extra), run.run_dir)
        done = final_val_loss(run.run_dir, run.steps)
        if done is None:
            raise UserError(f"ladder {what}: {run.run_dir} has no val_loss at step {run.steps}")
        return done


def runs_cost(rung: Rung) -> int:
    """Optimizer steps the rung trains in all: its trunk to the last branch point, then each branch's own decay."""
    return max(r.start for r in rung.runs) + sum(r.steps - r.start for r in rung.runs)


def measured_rate(rungs: list[Rung]) -> tuple[float, str] | None:
    """(6 N D FLOP/s, run directory) from the median tokens_per_sec of the largest rung's first run logged, or None."""
    for rung in sorted(rungs, key=lambda r: r.n_params, reverse=True):
        for run_dir in [rung.trunk, *(r.run_dir for r in rung.runs)]:
            try:
                with open(RunDir(run_dir).metrics) as f:
                    rates = sorted(r["tokens_per_sec"] for line in f if line.strip()
                                   for r in [json.loads(line)] if "tokens_per_sec" in r)
            except (OSError, ValueError):
                continue
            if rates:
                return 6 * rung.n_params * rates[len(rates) // 2], run_dir
    return None


def describe(rungs: list[Rung], checks: list[Rung], tokens_per_step: int, rate) -> list[str]:
    """The plan's lines: each rung's runs and steps, the totals in steps, tokens and FLOPs (6 N D), and the time that
    what is left would take at rate (measured_rate), or 'unknown until the first run'."""
    lines, steps, flops, left = [], 0, 0.0, 0.0
    for kind, group in (("rung", rungs), ("check", checks)):
        for r in group:
            cost = runs_cost(r)
            if len(r.runs) == 1:
                what = f"{r.runs[0].steps} steps (budget {r.runs[0].budget:g}, one run)"
            else:
                what = (f"trunk to step {max(x.start for x in r.runs)}, then " +
                        ", ".join(f"budget {x.budget:g}: {x.steps} steps, branched at {x.start}" for x in r.runs) +
                        f": {cost} steps, {cost / max(x.steps for x in r.runs):.2f}x its longest run")
            lines.append(f"  {kind} {r.name}: {r.n_params:,} parameters, warmup {r.warmup}; {what}")
            steps, flops = steps + cost, flops + 6 * r.n_params * cost * tokens_per_step
            todo = [x for x in r.runs if final_val_loss(x.run_dir, x.steps) is None]
            trunk = max(dict(complete_checkpoints(RunDir(r.trunk).checkpoints)), default=0) if todo else 0
            todo_steps = max([0, *(x.start - trunk for x in todo)]) + sum(x.steps - x.start for x in todo)
            left += 6 * r.n_params * todo_steps * tokens_per_step
    eta = "unknown until the first run" if rate is None else \
        f"about {duration(left / rate[0])} of training left at the {rate[0]:.3g} FLOP/s (6 N D) measured in {rate[1]}"
    return lines + [f"  total: {steps:,} steps, {steps * tokens_per_step:,} tokens, {flops:.3g} FLOPs; {eta}"]


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # --rung must not pass for --rungs
    parser.add_argument("--rungs", default="", help="comma-separated WIDTHxDEPTH sizes to fit (required)")
    parser.add_argument("--check", default="", help="comma-separated sizes trained at budget 1, kept out of the fit")
    parser.add_argument("--budgets", type=budgets_arg, default=[1.0],
                        help="increasing multiples of --tokens_per_param; several: cooldowns branched off one trunk "
                             "per rung and the L(N, D) fit (default 1: one run per rung, L(N))")
    parser.add_argument("--tokens_per_param", type=cli.number(float, lambda v: 0 < v < math.inf, "a finite number > 0"),
                        default=20.0)
    parser.add_argument("--flops", type=cli.number(float, lambda v: 0 < v < math.inf, "a finite number > 0"),
                        help="plan: the compute-optimal N and D at C = 6 N D FLOPs, and their predicted loss")
    parser.add_argument("--target", action="store_true", help="plan at the target config's own compute (6 N D)")
    parser.add_argument("--ladder_dir", default="runs/ladder")
    parser.add_argument("--launcher", default=f"{sys.executable} -m torch.distributed.run --standalone "
                                              f"--nproc_per_node=1", help="the command that starts each run")
    parser.add_argument("--script", default="train_fsdp.py", choices=["train_fsdp.py", "train_2d.py"])
    try:
        a, rest = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or a bad flag already reported as one error line
        return e.code
    command = shlex.join(["python", *(sys.argv if argv is None else ["ladder.py", *argv])])
    try:
        check_flags(rest, [s for act in parser._actions for s in act.option_strings if s.startswith("--") and s != "--help"])
        if not a.rungs:  # after check_flags, so that a near miss (--rung) is named as one
            raise ConfigError("--rungs is required: the sizes to fit, e.g. --rungs 32x2,48x2,64x2,96x2")
        cfg = parse_config(rest, require_file=True)
        sizes = [s for s in a.rungs.split(",") if s]
        check_form(len(sizes), a.budgets, cfg)
        rungs = plan(cfg, sizes, a.tokens_per_param, a.ladder_dir, tuple(a.budgets))
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        try:  # law.py's own rule for the points planned (e.g. token counts that follow the sizes on one curve)
            check_points([r.n_params for r in rungs for _ in r.runs],
                         [x.steps * tokens_per_step for r in rungs for x in r.runs])
        except ValueError as e:
            raise ConfigError(f"--rungs x --budgets: {e}") from None
        checks = plan(cfg, [s for s in a.check.split(",") if s], a.tokens_per_param, a.ladder_dir)
        queries = plan_queries(cfg, a, min(rungs, key=lambda r: r.n_params))
        try:
            launcher = shlex.split(a.launcher)
        except ValueError as e:  # an unclosed quote
            raise ConfigError(f"--launcher {a.launcher!r} cannot be read as a command ({e}); close its quotes") from None
        check_inputs(rungs + checks, launcher, a.ladder_dir, cfg, a.script)
        for flag in ("dir", "load_from"):
            if getattr(cfg.checkpoint, flag):  # every run keeps its own checkpoints; branches load the trunk's
                raise ConfigError(f"--checkpoint.{flag}: each run of the ladder keeps its checkpoints in its own run "
                                  f"directory (its branches load their trunk's from there); drop it")
        rate = measured_rate(rungs + checks)
        print(f"[ladder] plan, {len(a.budgets)} budget(s) of {a.tokens_per_param:g} tokens per parameter x "
              f"{', '.join(f'{b:g}' for b in a.budgets)}:", flush=True)
        print("\n".join(describe(rungs, checks, tokens_per_step, rate)), flush=True)
        data_flags = []
        if not cfg.data.prepared:  # one tokenizer and one tokenization for every run, as each would have made them
            data_flags = ["--data.prepared", RunDir(a.ladder_dir).data]
            print(f"[ladder] data: prepared once into {data_flags[1]} for every run", flush=True)
            prepare(cfg.data, data_flags[1])
        ladder = Ladder(cfg, rest, launcher, a.script, data_flags)
        for r in rungs + checks:
            for run in r.runs:
                label = f"{'check' if r in checks else 'rung'} {r.name}" + \
                    (f" budget {run.budget:g}" if len(r.runs) > 1 else "")
                run.val_loss = ladder.train(r, run, f"{label} ({r.n_params:,} parameters)")
                if (now := measured_rate(rungs + checks)) and now[1] != (rate or (0, ""))[1]:  # small rungs run slower
                    print("[ladder] " + describe(rungs, checks, tokens_per_step, rate := now)[-1].strip(), flush=True)
        points = [ladder_report.Point(r.name, r.n_params, run.steps * tokens_per_step, run.val_loss, run.run_dir,
                                      run.budget) for r in rungs for run in r.runs]
        measured = [ladder_report.Point(c.name, c.n_params, c.runs[0].steps * tokens_per_step, c.runs[0].val_loss,
                                        c.runs[0].run_dir) for c in checks]
        try:
            result = ladder_report.analyse(points, measured, queries)
        except ValueError as e:  # law.py's sentence: the points cannot determine the form
            raise UserError(f"the ladder's fit: {e}") from None
        except ArithmeticError as e:  # a refit that overflows: the runs stay, the report is not written
            raise UserError(f"the ladder's fit failed ({type(e).__name__}: {e}); every run is kept, run the ladder "
                            f"again once the fit is fixed") from None
        print("\n".join(ladder_report.write(result, a.ladder_dir, command)), flush=True)
    except UserError as e:
        report(e)
        return 2
    except KeyboardInterrupt:  # every run saved its step (or is left as a crash leaves it): all resume
        print("[ladder] interrupted; run the same command again to resume", flush=True)
        return 130
    return 0


def plan_queries(cfg: Config, a: argparse.Namespace, smallest: Rung) -> list[ladder_report.Query]:
    """The predictions wanted: the target's, and the planner's (--flops, --target). ConfigError for a planner with
    one budget (L(N) has no D to plan) or a --flops below the smallest rung's compute at budget 1."""
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    n = num_params(cfg.model, exclude_embedding=True)
    own = cfg.train.steps * tokens_per_step  # the target's tokens: under L(N), its fit's tokens per parameter
    queries = [ladder_report.Query(f"{cfg.model.dim}x{cfg.model.n_layers} (the target)", n,
                                   own if len(a.budgets) > 1 else a.budgets[0] * a.tokens_per_param * n)]
    planned = ([("--flops", a.flops)] if a.flops else []) + ([("--target", 6 * n * own)] if a.target else [])
    for flag, flops in planned:
        if len(a.budgets) == 1:
            raise ConfigError(f"{flag} plans N and D with the L(N, D) fit, which needs several budgets (e.g. --budgets "
                              f"0.5,1,2); with one budget the ladder fits L(N) only")
        floor = 6 * smallest.n_params * math.ceil(a.tokens_per_param * smallest.n_params / tokens_per_step) \
            * tokens_per_step
        if flops < floor:
            raise ConfigError(f"{flag} {flops:.3g} FLOPs is below the compute of the smallest rung {smallest.name} at "
                              f"budget 1 ({floor:.3g} = 6 N D): the ladder plans upward; give at least {floor:.3g}")
        queries.append(ladder_report.Query(flag, flops=flops))
    return queries


if __name__ == "__main__":
    exit_command(main())
