"""Mixture of experts against the dense model of the same active size: tokens to loss, step time, balance, EP.

    python benchmarks/moe_bench.py --out benchmarks/results/FILE.md [--shape small] [--experts 4,8,16]
        [--arms 8/2/128,64/7/32+1] [--lrs 0.5,1,2] [--fractions 0.5,0.7] [--jobs 2] [--workdir DIR] [--reuse]

A dense model against MoEs of E experts, top-2, each of half the dense ffn_dim (so 2 experts are the
dense width), every block MoE, the default balancing (sigmoid scores, bias update 0.01). --arms
names other MoEs as E/k/WIDTH[+SHARED] (fine-grained ones: many narrow experts, a larger k, shared
experts of the same width; keep (k + SHARED) x WIDTH at the dense ffn_dim for equal active width).
--lrs sweeps optim.lr (multipliers of the debug config's, in increasing order, each model stopping
after the first that ends above the one before) on the first corpus's full runs, and every model
then keeps its own best LR. --reuse reads runs an earlier invocation finished (the same
command in the same run dir) instead of training them again. Every
process runs with OMP_NUM_THREADS=1, and each section prints the command it ran:

- tokens to loss (--shape): "small" (dim 64, 2 layers, ffn_dim 256, a 1,024-token vocabulary,
  1,500 steps: about 16 tokens per parameter besides the input embedding), "wide" (dim 256, 4 layers,
  ffn_dim 768, 1,000 steps: 0.46 tokens per parameter) or "debug" (the debug
  config, 150 steps: 0.23 tokens per parameter besides the input embedding, where a model of more
  parameters has little to gain). One process per run
  (torchrun --nproc_per_node=1 train_fsdp.py), the same seed and data order, validation every
  --val_interval steps, --jobs runs at a time; on two corpora: the debug config's (the Python
  standard library) and prose that is not code (--prose, default Vim's help files, the English
  manual every Debian Vim install carries). Each MoE trains the full --steps and also at each of
  --fractions of them (only a MoE whose full run reaches the dense final val_loss: a shorter run
  has always ended above its full run here), every run with the whole schedule annealed at its own
  end, as the dense reference is. The score is the tokens at which these annealed MoE runs reach
  the dense run's final val_loss (linear between their final losses; "<=" when the shortest run already does)
  over the dense run's tokens (goal <= 0.7); beside it, the same read off the full MoE run's
  validation curve (mid-schedule, where the cosine has already taken the LR most of the way down;
  on the small shape it reads 0.05-0.08 lower than the annealed runs);
- balance: from the same runs' train records, and from a run of --balance_steps steps with 8
  experts on the debug model and corpus, moe_max_load (the busiest expert's tokens over the
  mean per expert, the largest over the layers): the first step from which its trailing 10-step
  mean stays below 1.3, and its mean over the last 10 steps;
- step time (the --shape model): benchmarks/bench.py with the dense model and each MoE as variants in
  one process, their steps in turns (paired ratios), on random tokens;
- EP (the debug model): this script as a 4-rank torchrun worker (--ep_worker) at parallel.ep 1, 2, 4
  with 8 experts: each rank's bytes of the experts (parameters and AdamW state; gradients as
  parameters) from the local shards, the experts one rank gathers for its compute, and the share of
  the step's wall time spent inside the all-to-alls (dispatch and combine, forward and backward;
  torch.profiler's intervals of the collective and its wait, merged), on gloo over CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEBUG = os.path.join(ROOT, "configs", "debug.toml")
PROSE = "/usr/share/vim/vim90/doc/*.txt"
LOAD_GOAL = 1.3


# The tokens-to-loss shapes: (train flags of the dense model, its ffn_dim, steps, val_interval). "debug" is the
# debug config as is (1.31M parameters besides the input embedding, 150 steps: 0.23 tokens per parameter, so
# limited by its steps, not its size). "small" is past that regime: 197k parameters besides the input embedding over 1,500
# steps (3.1M tokens, about 16 per parameter, one pass over the prose corpus), where more parameters at
# the same compute can pay. "wide" (dim 256, 4 layers) is issue 54's wider shape: 4.46M parameters besides the input
# embedding over 1,000 steps (2.05M tokens, 0.46 per parameter), back in the regime where tokens, not parameters, limit.
SHAPES = {
    "debug": ([], 384, 150, 10),
    "small": (["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "4",
               "--model.ffn_dim", "256", "--model.vocab_size", "1024", "--data.tokenizer_vocab_size", "1024",
               "--data.max_documents", "0", "--optim.warmup_steps", "100", "--train.val_batches", "16"],
              256, 1500, 100),
    "wide": (["--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "4",
              "--model.ffn_dim", "768", "--data.max_documents", "0", "--optim.warmup_steps", "100",
              "--train.val_batches", "16"],
             768, 1000, 100),
}


class Arm(NamedTuple):
    """One model of the comparison: e routed experts (0: the dense model), top-k of width each, plus shared
    always-on experts of the same width (nn/moe_args.py ties their width to expert_ffn_dim). Its active
    feed-forward width is (k + shared) x width."""

    e: int
    k: int = 0
    width: int = 0
    shared: int = 0

    @classmethod
    def parse(cls, spec: str) -> Arm:
        """'E/k/WIDTH' or 'E/k/WIDTH+SHARED', e.g. '8/2/128' or '64/7/32+1'."""
        routed, _, shared = spec.partition("+")
        e, k, width = (int(x) for x in routed.split("/"))
        return cls(e, k, width, int(shared or 0))

    @property
    def name(self) -> str:
        return "dense" if not self.e else f"moe{self.e}k{self.k}w{self.width}" + (f"s{self.shared}" if self.shared else "")

    def label(self, ffn_dim: int) -> str:
        if not self.e:
            return f"dense, ffn_dim {ffn_dim}"
        return f"{self.e} experts, top-{self.k} of {self.width}" + (f" + {self.shared} shared" if self.shared else "")

    def flags(self) -> list[str]:
        if not self.e:
            return []
        return ["--model.n_experts", str(self.e), "--model.experts_per_token", str(self.k), "--model.expert_ffn_dim",
                str(self.width), *(["--model.n_shared_experts", str(self.shared)] if self.shared else [])]


DENSE = Arm(0)


def top2(e: int, ffn_dim: int = 384) -> Arm:
    """An MoE of e experts, top-2 of width ffn_dim / 2: the dense model's active feed-forward width."""
    return Arm(e, 2, ffn_dim // 2)


def moe_flags(e: int, ffn_dim: int = 384) -> list[str]:
    return top2(e, ffn_dim).flags()


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def show(cmd: list[str]) -> str:
    """The command as a user would type it (paths relative to the checkout)."""
    return " ".join(shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in cmd)


# ---------------------------------------------------------------- tokens to loss

def train(run_dir: str, extra: list[str], data: str | None, log, reuse: bool = False) -> tuple[list[dict], float, str]:
    """One 1-process training run; (its metrics.jsonl records, wall seconds, the command). log: a file or a path.
    reuse: when run_dir holds a finished run of the same command (done.json, written last), read it instead."""
    cmd = ["torchrun", "--standalone", "--nproc_per_node=1", os.path.join(ROOT, "train_fsdp.py"),
           "--config", DEBUG, "--run_dir", run_dir, *extra]
    done = os.path.join(run_dir, "done.json")
    if reuse and os.path.exists(done):
        with open(done) as f:
            prev = json.load(f)
        if prev["cmd"] == show(cmd):
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()], prev["seconds"], prev["cmd"]
    shutil.rmtree(run_dir, ignore_errors=True)
    if data:  # the corpus tokenized once per corpus, for every arm
        shutil.copytree(data, os.path.join(run_dir, "data"))
    start = time.perf_counter()
    with (open(log, "w") if isinstance(log, str) else contextlib.nullcontext(log)) as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], cwd=ROOT, stdout=out,
                       stderr=subprocess.STDOUT, env=env(), check=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(done, "w") as f:
        json.dump({"cmd": show(cmd), "seconds": seconds}, f)
    return records, seconds, show(cmd)


def curves(records: list[dict]) -> tuple[dict[int, dict], list[tuple[float, float]]]:
    """(train records by step, [(tokens seen, val_loss)] in step order)."""
    tr = {r["step"]: r for r in records if "loss" in r}
    per_step = tr[max(tr)]["tokens_seen"] / max(tr)
    val = [(tr[r["step"]]["tokens_seen"] if r["step"] in tr else r["step"] * per_step, r["val_loss"])
           for r in records if "val_loss" in r]
    return tr, val


def final_loss(records: list[dict]) -> float:
    """A run's last val_loss (its final one: every run validates at its last step)."""
    return curves(records)[1][-1][1]


def tokens_to_reach(val: list[tuple[float, float]], target: float) -> float | None:
    """Tokens at which the val curve first reaches target, linear between its points (from (0, +inf)); None if never."""
    prev = None
    for tokens, loss in val:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return tokens
            t0, l0 = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def balance(tr: dict[int, dict], window: int = 10) -> tuple[int | None, float, float]:
    """(first step from which the trailing window-step mean of moe_max_load stays < LOAD_GOAL (None: never),
    mean over the last window steps, max over the last window steps)."""
    steps = sorted(s for s in tr if "moe_max_load" in tr[s])
    loads = [tr[s]["moe_max_load"] for s in steps]
    means = [statistics.fmean(loads[max(0, i - window + 1):i + 1]) for i in range(len(loads))]
    first = None
    for s, m in zip(steps, means):
        if m >= LOAD_GOAL:
            first = None
        elif first is None:
            first = s
    return first, statistics.fmean(loads[-window:]), max(loads[-window:])


def reach_annealed(points: list[tuple[float, float]], target: float) -> tuple[float | None, str]:
    """The tokens at which runs annealed at their own length first reach target: points [(tokens, final val_loss)]
    of separate runs, linear between neighbours; (tokens, "") when bracketed, (the smallest tokens, "<=") when the
    shortest run already reaches it, (None, "") when none does."""
    points = sorted(points)
    if points[0][1] <= target:
        return points[0][0], "<="
    return tokens_to_reach(points, target), ""


def run_all(jobs: int, tasks: dict) -> dict:
    """{key: (fn, *args)} run jobs at a time -> {key: fn(*args)}; a failed run (or Ctrl-C) stops the queue instead
    of training the rest first."""
    with ThreadPoolExecutor(jobs) as pool:
        futures = {key: pool.submit(*task) for key, task in tasks.items()}
        try:
            return {key: fut.result() for key, fut in futures.items()}
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def tokens_section(args, corpora: dict[str, tuple[str, list[str]]]) -> tuple[list[str], dict]:
    """Dense against each MoE arm on each corpus: each model's full-length run (its val curve) and, for each MoE whose
    full run reaches the dense final val_loss, its runs at --fractions of the steps, each with the whole schedule
    (warmup, then the cosine to its own end), so that the MoE's loss at fewer tokens is an annealed run's, as the
    dense reference is. With several --lrs, every model
    trains the full run at each LR on the first corpus, and keeps the one of lowest final val_loss for its fraction
    runs and for the other corpora (going up the LRs, it stops after the first LR that ends above the one before).
    Runs --jobs at a time."""
    shape, ffn, _, _ = SHAPES[args.shape]
    arms = [DENSE, *args.arms]
    base_lr = debug_lr()
    lines, results = [], {}

    def one(corpus: str, arm: Arm, lr: float, frac: float):
        steps = round(args.steps * frac)
        val = args.val_interval if frac == 1.0 else steps
        name = arm.name + (f"_lr{lr:g}" if len(args.lrs) > 1 else "") + (f"_x{frac:g}" if frac != 1.0 else "")
        run_dir = os.path.join(args.workdir, f"{corpus}_{name}")
        extra = [*shape, "--train.steps", str(steps), "--train.val_interval", str(val), "--checkpoint.interval",
                 str(steps), *(["--optim.lr", f"{base_lr * lr:g}"] if lr != 1.0 else []), *arm.flags(),
                 *corpora[corpus][1]]
        # each corpus's first dense run tokenizes it; every other run of that corpus copies its data
        data = None if (arm, frac) == (DENSE, 1.0) and lr == tokenizer_lr[corpus] else \
            os.path.join(args.workdir, f"{corpus}_dense" + (f"_lr{tokenizer_lr[corpus]:g}" if len(args.lrs) > 1 else ""), "data")
        records, seconds, cmd = train(run_dir, extra, data, run_dir + ".log", args.reuse)
        print(f"[moe_bench] {corpus} {name}: final val_loss {final_loss(records):.4f}, {seconds:.0f} s", flush=True)
        return records, seconds, cmd

    sweep, *others = corpora
    tokenizer_lr = {sweep: args.lrs[0]}
    runs = {}  # (corpus, arm, lr multiplier, fraction) -> (records, seconds, cmd)
    runs |= run_all(args.jobs, {(sweep, DENSE, args.lrs[0], 1.0): (one, sweep, DENSE, args.lrs[0], 1.0)})

    def sweep_lrs(arm: Arm) -> dict:
        """arm's full runs up the LRs in order, stopping after the first that ends above the one before."""
        out, last = {}, None
        for lr in args.lrs:
            out[lr] = runs.get((sweep, arm, lr, 1.0)) or one(sweep, arm, lr, 1.0)
            loss = final_loss(out[lr][0])
            if last is not None and loss > last:
                break
            last = loss
        return out

    swept = run_all(args.jobs, {arm: (sweep_lrs, arm) for arm in arms})
    runs |= {(sweep, arm, lr, 1.0): r for arm, by_lr in swept.items() for lr, r in by_lr.items()}
    best = {arm: min(by_lr, key=lambda lr: final_loss(by_lr[lr][0])) for arm, by_lr in swept.items()}
    for corpus in others:  # the other corpora's dense runs tokenize them, at dense's best LR
        tokenizer_lr[corpus] = best[DENSE]
        runs |= run_all(args.jobs, {(corpus, DENSE, best[DENSE], 1.0): (one, corpus, DENSE, best[DENSE], 1.0)})
    runs |= run_all(args.jobs, {(c, arm, best[arm], 1.0): (one, c, arm, best[arm], 1.0) for c in corpora for arm in arms
                                if arm.e and (c, arm, best[arm], 1.0) not in runs})
    # Shorter runs annealed at their own end have always ended above their full run's final loss here (every shape
    # and corpus): for a MoE whose full run ends above dense's, they could not reach it and are not trained.
    target = {c: final_loss(runs[(c, DENSE, best[DENSE], 1.0)][0]) for c in corpora}
    reached = [(c, arm) for c in corpora for arm in arms
               if arm.e and final_loss(runs[(c, arm, best[arm], 1.0)][0]) <= target[c]]
    runs |= run_all(args.jobs, {(c, arm, best[arm], f): (one, c, arm, best[arm], f) for c, arm in reached
                                for f in args.fractions if (c, arm, best[arm], f) not in runs})

    if len(args.lrs) > 1:
        lines += [f"### The LR sweep: {corpora[sweep][0]}", "",
                  f"Each model's full run at optim.lr = the debug config's {base_lr:g} times each of "
                  f"{', '.join(f'{lr:g}' for lr in args.lrs)} (`--optim.lr`), up the LRs until one ends above the one before (-: not run); final "
                  "val_loss, the lowest in bold (that LR is the model's for the rest):", "",
                  "| model | " + " | ".join(f"lr {base_lr * lr:g} (x{lr:g})" for lr in args.lrs) + " |",
                  "|---|" + "---|" * len(args.lrs)]
        for arm in arms:
            cells = [f"{final_loss(runs[(sweep, arm, lr, 1.0)][0]):.4f}" if lr in swept[arm] else "-"
                     for lr in args.lrs]
            cells = [f"**{c}**" if lr == best[arm] else c for c, lr in zip(cells, args.lrs)]
            lines.append(f"| {arm.label(ffn)} | " + " | ".join(cells) + " |")
        lines.append("")

    for corpus, (title, _) in corpora.items():
        out = {}
        for arm in arms:
            records, seconds, cmd = runs[(corpus, arm, best[arm], 1.0)]
            tr, val = curves(records)
            out[arm] = {"train": tr, "val": val, "seconds": seconds, "cmd": cmd, "lr": base_lr * best[arm],
                        "fractions": {f: curves(runs[(corpus, arm, best[arm], f)][0])[1][-1]
                                      for f in args.fractions if (corpus, arm, best[arm], f) in runs}}
        dense_tokens, target = out[DENSE]["val"][-1]
        fr = ", ".join(f"{f:g}" for f in args.fractions)
        lines += [f"### {title}", "", "```", out[DENSE]["cmd"], "# each MoE: the same command (with --optim.lr its "
                  "own) plus", *(" ".join(arm.flags()) for arm in args.arms),
                  f"# and the same at {fr}x the steps (--train.steps, with --train.val_interval and "
                  "--checkpoint.interval at that step)", "```", "",
                  f"| model | total params | lr | final val_loss | annealed runs at {fr}x the tokens: final val_loss "
                  "| tokens to the dense final val_loss, annealed runs (goal <= 0.7x) | the same along the full run's "
                  "curve | moe_max_load, last 10 steps (mean / max) | load < 1.3 from step | wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, r in out.items():
            bal = balance(r["train"]) if arm.e else None
            curve = tokens_to_reach(r["val"], target)
            annealed, bound = reach_annealed([*r["fractions"].values(), r["val"][-1]], target) if arm.e else (None, "")
            r.update(reach=curve, ratio=curve / dense_tokens if curve is not None else None,
                     annealed_ratio=annealed / dense_tokens if annealed is not None else None, bound=bound, balance=bal)

            def ratio(x, b=""):
                return f"{b}{x:.2f}x" if x is not None else "not reached"
            lines.append(
                f"| {arm.label(ffn)} | {params(arm, args.shape)} | {r['lr']:g} "
                f"| {r['val'][-1][1]:.4f} | {' / '.join(f'{v[1]:.4f}' for v in r['fractions'].values()) or '-'} "
                f"| {'1 (the reference)' if not arm.e else ratio(r['annealed_ratio'], bound)} "
                f"| {'-' if not arm.e else ratio(r['ratio'])} "
                f"| {'-' if not arm.e else f'{bal[1]:.2f} / {bal[2]:.2f}'} | {'-' if not arm.e else (bal[0] or 'never')} "
                f"| {r['seconds']:.0f} |")
        lines += ["", "val_loss at each validation of the full runs, each model at its LR:", "",
                  "| tokens | " + " | ".join("dense" if not arm.e else f"{arm.e}/{arm.k}/{arm.width}"
                                             + (f"+{arm.shared}" if arm.shared else "") for arm in out) + " |",
                  "|---|" + "---|" * len(out)]
        for i, (tokens, _) in enumerate(out[DENSE]["val"]):
            lines.append(f"| {tokens:,.0f} | " + " | ".join(f"{r['val'][i][1]:.4f}" if i < len(r["val"]) else "-"
                                                            for r in out.values()) + " |")
        lines.append("")
        results[corpus] = {arm.name: {k: v for k, v in r.items() if k != "train"} for arm, r in out.items()}
    return lines, results


def debug_lr() -> float:
    """The debug config's optim.lr: what --lrs multiplies."""
    import config as config_lib
    return config_lib.parse_config(["--config", DEBUG]).optim.lr


def params(arm: Arm, shape: str = "debug") -> str:
    """Total and active parameters of the shape's model with arm's feed-forward, as model.py counts them."""
    import config as config_lib
    import model as model_lib
    flags, _, _, _ = SHAPES[shape]
    cfg = config_lib.parse_config(["--config", DEBUG, *flags, *arm.flags()])
    total, active = model_lib.num_params(cfg.model), model_lib.num_params(cfg.model, active=True)
    return f"{total / 1e6:.2f}M" + (f" ({active / 1e6:.2f}M active)" if arm.e else "")


def balance_section(args, log) -> tuple[list[str], dict]:
    """The default balancing on the debug model, 8 experts, --balance_steps steps: moe_max_load per 10-step window."""
    run_dir = os.path.join(args.workdir, "balance_moe8")
    data = os.path.join(args.workdir, "stdlib_dense", "data")
    extra = ["--train.steps", str(args.balance_steps), "--train.val_interval", str(args.balance_steps),
             "--checkpoint.interval", str(args.balance_steps), *moe_flags(8)]
    # this invocation's debug-shape stdlib run tokenized the debug corpus; anything else may hold other settings
    reuse = "tokens" in args.sections.split(",") and args.shape == "debug" and "stdlib" in args.corpora.split(",")
    records, seconds, cmd = train(run_dir, extra, data if reuse else None, log)
    tr, val = curves(records)
    first, last_mean, last_max = balance(tr)
    steps = sorted(tr)
    windows = [steps[i:i + 10] for i in range(0, len(steps), 10)]
    lines = ["```", cmd, "```", "",
             "| steps | " + " | ".join(f"{w[0]}-{w[-1]}" for w in windows) + " |", "|---|" + "---|" * len(windows),
             "| moe_max_load, mean | " + " | ".join(f"{statistics.fmean(tr[s]['moe_max_load'] for s in w):.2f}"
                                                 for w in windows) + " |",
             "| moe_max_load, max | " + " | ".join(f"{max(tr[s]['moe_max_load'] for s in w):.2f}" for w in windows) + " |",
             "", f"Trailing 10-step mean below {LOAD_GOAL} from step {first or 'never'} on; last 10 steps: mean "
             f"{last_mean:.2f}, max {last_max:.2f}; val_loss at {steps[-1]}: {val[-1][1]:.4f}; {seconds:.0f} s.", ""]
    return lines, {"first": first, "last_mean": last_mean, "last_max": last_max, "val_loss": val[-1][1]}


# ---------------------------------------------------------------- step time

def step_time_section(args, log) -> tuple[list[str], dict]:
    js = os.path.join(args.workdir, "step_time.json")
    shape, ffn, _, _ = SHAPES[args.shape]
    cmd = [os.path.join(ROOT, "benchmarks", "bench.py"), "--config", DEBUG, *shape, "--threads", "1", "--warmup", "2",
           "--steps", str(args.time_steps), *[f for arm in args.arms for f in ("--variant", f"{arm.name}=" + " ".join(arm.flags()))],
           "--json", js]
    subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env(), check=True)
    with open(js) as f:
        res = json.load(f)
    v = res["variants"]
    dense = v["ours"]["step_s_all"]
    lines = ["```", "OMP_NUM_THREADS=1 python " + show(cmd), "```", "",
             "| model | step s, median (min-max) | tokens/s | time per token vs dense, median of paired steps (goal <= 1.2) | cpu busy |",
             "|---|---|---|---|---|"]
    out = {}
    for name, r in v.items():
        ratio = statistics.median(a / b for a, b in zip(r["step_s_all"], dense))
        s = r["step_s"]
        out[name] = {"ratio": ratio, "step_s": s["median"], "tokens_per_sec": r["tokens_per_sec"]["median"]}
        label = {arm.name: arm.label(ffn) for arm in args.arms}.get(name, f"dense, ffn_dim {ffn}")
        lines.append(f"| {label} | "
                     f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | {r['tokens_per_sec']['median']:.0f} | "
                     f"{ratio:.2f}x | {r['cpu_busy']['median']:.2f} |")
    return lines + [""], out


# ---------------------------------------------------------------- expert parallelism

def ep_worker(argv: list[str]) -> None:
    """One rank of the EP measurement (under torchrun): build the run's model and optimizer, time --steps steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from bench import local_bytes, synthetic_batches, worker_trainable
    from nn.moe import MoE
    from training.step import train_step

    a, cfg, rank, world, mesh, t = worker_trainable(argv, 3)
    par = cfg.parallel
    experts = [p for m in t.model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]

    batches = synthetic_batches(cfg, world, 1 + a.steps)
    train_step(t, batches[0])  # the optimizer state exists after one step
    state = [v for p in experts for v in t.optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim()]
    full = sum(p.numel() * p.element_size() for p in experts)  # the DTensors' global shapes
    mem = {"params": local_bytes(experts), "grads": local_bytes([p.grad for p in experts if p.grad is not None]),
           "optim": local_bytes(state), "full": full, "gathered": full // par.ep,
           "local_w1": list((experts[0].to_local() if isinstance(experts[0], DTensor) else experts[0]).shape)}
    names = ("all_to_all", "alltoall", "wait_tensor")
    steps, shares = [], []
    for b in batches[1:]:
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            train_step(t, b)
            wall = time.perf_counter() - t0
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if any(n in e.name for n in names))
        busy, end = 0.0, float("-inf")
        for s, e in spans:  # union of the intervals, in us
            if e > end:
                busy += e - max(s, end)
                end = e
        steps.append(wall)
        shares.append(busy / 1e6 / wall)
    out = torch.tensor([statistics.median(steps), statistics.median(shares)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(a.json, "w") as f:
            json.dump({"mem": mem, "step_s": out[0].item(), "a2a_share": out[1].item(), "world": world,
                       "ep": par.ep, "shares_rank0": shares, "steps_rank0": steps}, f)
    dist.destroy_process_group()


def ep_section(args, log) -> tuple[list[str], dict]:
    lines = ["| ep | local w1 shape | params | AdamW state | params + state | experts gathered for compute "
             "| step s (4 ranks) | all-to-all share of the step |", "|---|---|---|---|---|---|---|---|"]
    out, first = {}, ""
    for ep in (1, 2, 4):
        js = os.path.join(args.workdir, f"ep{ep}.json")
        cmd = ["torchrun", "--standalone", "--nproc_per_node=4", os.path.abspath(__file__), "--ep_worker",
               "--steps", str(args.ep_steps), "--json", js, "--config", DEBUG, *moe_flags(8), "--parallel.ep", str(ep)]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, env=env(), check=True)
        first = first or show(cmd)
        with open(js) as f:
            r = json.load(f)
        out[ep] = r
        m = r["mem"]
        kib = lambda b: f"{b / 1024:.0f} KiB"  # noqa: E731
        lines.append(f"| {ep} | {tuple(m['local_w1'])} | {kib(m['params'])} | {kib(m['optim'])} "
                     f"| {kib(m['params'] + m['optim'])} | {kib(m['gathered'])} of {kib(m['full'])} "
                     f"| {r['step_s']:.3f} | {100 * r['a2a_share']:.1f}% |")
    return ["```", "OMP_NUM_THREADS=1 " + first.replace("--parallel.ep 1", "--parallel.ep EP"), "```", "", *lines, ""], out


# ---------------------------------------------------------------- driver

def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--ep_worker" in argv:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        ep_worker([x for x in argv if x != "--ep_worker"])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results markdown to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small",
                   help="the tokens-to-loss model: small (dim 64, 2 layers, 1,500 steps), wide (dim 256, 4 layers, "
                   "1,000 steps) or debug (the debug config)")
    p.add_argument("--steps", type=int, default=None, help="training steps of the full tokens-to-loss runs "
                   "(default: the shape's)")
    p.add_argument("--val_interval", type=int, default=None, help="default: the shape's")
    p.add_argument("--fractions", default="0.5,0.7", help="each MoE also trains at these fractions of --steps, "
                   "annealed at its own end")
    p.add_argument("--jobs", type=int, default=1, help="tokens-to-loss runs at a time (1 thread each)")
    p.add_argument("--corpora", default="stdlib,prose", help="tokens-to-loss corpora: stdlib, prose")
    p.add_argument("--experts", default="4,8,16", help="expert counts, comma-separated: each an MoE top-2 of half "
                   "the dense ffn_dim (the dense model's active width)")
    p.add_argument("--arms", default="", help="the MoEs instead of --experts, comma-separated E/k/WIDTH[+SHARED]: E "
                   "experts, top-k of WIDTH, plus SHARED always-on experts of WIDTH; e.g. 8/2/128,64/7/32+1")
    p.add_argument("--lrs", default="1", help="multipliers of the debug config's optim.lr, comma-separated: with "
                   "several, each model trains at each on the first corpus and keeps its best (e.g. 0.5,1,2)")
    p.add_argument("--reuse", action="store_true", help="read a run whose run dir holds a finished run of the "
                   "same command (an earlier invocation's) instead of training it again")
    p.add_argument("--prose", default=PROSE, help="the second corpus: local prose files (data.dataset)")
    p.add_argument("--time_steps", type=int, default=10, help="timed steps per model in the step-time section")
    p.add_argument("--ep_steps", type=int, default=3, help="timed steps per ep in the EP section")
    p.add_argument("--balance_steps", type=int, default=200, help="steps of the balance run (8 experts, stdlib)")
    p.add_argument("--sections", default="tokens,balance,time,ep", help="which sections to run, comma-separated")
    p.add_argument("--workdir", default="/tmp/moe_bench")
    args = p.parse_args(argv)
    _, ffn, steps, val = SHAPES[args.shape]
    args.arms = [Arm.parse(a) for a in args.arms.split(",")] if args.arms else \
        [top2(int(e), ffn) for e in args.experts.split(",")]
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.fractions = sorted({float(f) for f in args.fractions.split(",") if f})
    if not all(0 < f < 1 for f in args.fractions):
        p.error(f"--fractions {','.join(f'{f:g}' for f in args.fractions)}: each must be in (0, 1); the full run is 1")
    args.steps, args.val_interval = args.steps or steps, args.val_interval or val
    sections = args.sections.split(",")
    os.makedirs(args.workdir, exist_ok=True)
    corpora = {"stdlib": ("stdlib: the Python standard library (the debug corpus)", []),
               "prose": (f"prose: {args.prose}", ["--data.dataset", args.prose])}
    corpora = {k: v for k, v in corpora.items() if k in args.corpora.split(",")}
    t0 = time.perf_counter()
    lines = [f"# Mixture of experts against dense at equal active parameters: the {args.shape} model, {args.steps} steps",
             "", f"`python benchmarks/moe_bench.py {shlex.join(argv)}` "
             f"(every process OMP_NUM_THREADS=1, {args.jobs} tokens-to-loss run(s) at a time)", ""]
    results = {}
    with open(os.path.join(args.workdir, "log.txt"), "w") as log:
        if "tokens" in sections:
            body, results["tokens"] = tokens_section(args, corpora)
            lines += ["## Tokens to loss, and balance", "", *body]
        if "balance" in sections:
            body, results["balance"] = balance_section(args, log)
            lines += [f"## Balance: the default (sigmoid, bias rate 0.01), 8 experts, {args.balance_steps} steps", "",
                      *body]
        if "time" in sections:
            body, results["time"] = step_time_section(args, log)
            lines += ["## Step time on CPU (1 thread), side by side", "", *body]
        if "ep" in sections:
            body, results["ep"] = ep_section(args, log)
            lines += ["## Expert parallelism: 4 CPU ranks, gloo, 8 experts", "", *body]
    lines.append(f"Whole benchmark: {time.perf_counter() - t0:.0f} s wall.")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump(results, f, default=str)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
