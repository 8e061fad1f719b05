"""Mixture of experts against the dense model of the same active size: tokens to loss, step time, balance, EP.

    python benchmarks/moe_bench.py --out benchmarks/results/FILE.md [--steps 150] [--experts 4,8,16] [--workdir DIR]

The debug model (configs/debug.toml: dim 128, 4 layers, ffn_dim 384) against MoEs of E experts,
top-2, each of width 192 (so 2 x 192 = 384 active, the dense width), every block MoE, the default
balancing (sigmoid scores, bias update 0.01). Every process runs with OMP_NUM_THREADS=1, one at a
time, and each section prints the command it ran:

- tokens to loss: one process per run (torchrun --nproc_per_node=1 train_fsdp.py), the same seed
  and data order, --steps steps each, validation every --val_interval steps; on two corpora: the
  debug config's (the Python standard library) and prose that is not code (--prose, default
  Vim's help files, the English manual every Debian Vim install carries). The score is the
  tokens the MoE needs to reach the dense run's final val_loss, linearly interpolated between
  its validation points, over the dense run's tokens (goal <= 0.7); "not reached" when its last
  validation is still above;
- balance: from the same runs' train records, and from a run of --balance_steps steps with 8
  experts on the debug corpus, moe_max_load (the busiest expert's tokens over the
  mean per expert, the largest over the layers): the first step from which its trailing 10-step
  mean stays below 1.3, and its mean over the last 10 steps;
- step time: benchmarks/bench.py with the dense model and each MoE as variants in one process,
  their steps in turns (paired ratios), on random tokens;
- EP: this script as a 4-rank torchrun worker (--ep_worker) at parallel.ep 1, 2, 4 with 8
  experts: each rank's bytes of the experts (parameters and AdamW state; gradients as parameters) from the local
  shards, the experts one rank gathers for its compute, and the share of the step's wall time
  spent inside the all-to-alls (dispatch and combine, forward and backward; torch.profiler's
  intervals of the collective and its wait, merged), on gloo over CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEBUG = os.path.join(ROOT, "configs", "debug.toml")
PROSE = "/usr/share/vim/vim90/doc/*.txt"
LOAD_GOAL = 1.3


def moe_flags(e: int) -> list[str]:
    """An MoE of e experts, top-2 of width 192: the debug model's active feed-forward width (384)."""
    return ["--model.n_experts", str(e), "--model.experts_per_token", "2", "--model.expert_ffn_dim", "192"]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def show(cmd: list[str]) -> str:
    """The command as a user would type it (paths relative to the checkout)."""
    return " ".join(shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in cmd)


# ---------------------------------------------------------------- tokens to loss

def train(run_dir: str, extra: list[str], data: str | None, log) -> tuple[list[dict], float, str]:
    """One 1-process training run; (its metrics.jsonl records, wall seconds, the command)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if data:  # the corpus tokenized once per corpus, for every arm
        shutil.copytree(data, os.path.join(run_dir, "data"))
    cmd = ["torchrun", "--standalone", "--nproc_per_node=1", os.path.join(ROOT, "train_fsdp.py"),
           "--config", DEBUG, "--run_dir", run_dir, *extra]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], cwd=ROOT, stdout=log,
                   stderr=subprocess.STDOUT, env=env(), check=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records, seconds, show(cmd)


def curves(records: list[dict]) -> tuple[dict[int, dict], list[tuple[float, float]]]:
    """(train records by step, [(tokens seen, val_loss)] in step order)."""
    tr = {r["step"]: r for r in records if "loss" in r}
    per_step = tr[max(tr)]["tokens_seen"] / max(tr)
    val = [(tr[r["step"]]["tokens_seen"] if r["step"] in tr else r["step"] * per_step, r["val_loss"])
           for r in records if "val_loss" in r]
    return tr, val


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


def tokens_section(args, corpora: dict[str, list[str]], log) -> tuple[list[str], dict]:
    lines, results = [], {}
    base = ["--train.steps", str(args.steps), "--train.val_interval", str(args.val_interval),
            "--checkpoint.interval", str(args.steps)]
    for corpus, (title, flags) in corpora.items():
        data, out, dense_cmd = None, {}, ""
        for e in [0, *args.experts]:
            name = "dense" if e == 0 else f"moe{e}"
            extra = [*base, *flags, *(moe_flags(e) if e else [])]
            records, seconds, cmd = train(os.path.join(args.workdir, f"{corpus}_{name}"), extra, data, log)
            data = data or os.path.join(args.workdir, f"{corpus}_{name}", "data")
            tr, val = curves(records)
            out[e] = {"train": tr, "val": val, "seconds": seconds, "cmd": cmd}
            print(f"[moe_bench] {corpus} {name}: final val_loss {val[-1][1]:.4f}, {seconds:.0f} s", flush=True)
            dense_cmd = dense_cmd or cmd
        dense_tokens, target = out[0]["val"][-1]
        lines += [f"### {title}", "", "```", dense_cmd, "# each MoE: the same command plus",
                  " ".join(moe_flags(0)).replace(" 0 ", " E ", 1), "```", "",
                  "| model | total params | final val_loss | tokens to the dense final val_loss | ratio (goal <= 0.7) "
                  "| moe_max_load, last 10 steps (mean / max) | load < 1.3 from step | wall s |",
                  "|---|---|---|---|---|---|---|---|"]
        for e, r in out.items():
            reach = tokens_to_reach(r["val"], target)
            ratio = reach / dense_tokens if reach is not None else None
            bal = balance(r["train"]) if e else None
            r.update(reach=reach, ratio=ratio, balance=bal)
            lines.append(
                f"| {'dense, ffn_dim 384' if not e else f'{e} experts, top-2 of 192'} | {params(e)} "
                f"| {r['val'][-1][1]:.4f} | {'-' if not e else (f'{reach:,.0f}' if reach is not None else 'not reached')} "
                f"| {'1 (the reference)' if not e else (f'{ratio:.2f}x' if ratio is not None else f'> 1 (not reached in {dense_tokens:,.0f})')} "
                f"| {'-' if not e else f'{bal[1]:.2f} / {bal[2]:.2f}'} | {'-' if not e else (bal[0] or 'never')} "
                f"| {r['seconds']:.0f} |")
        lines += ["", "val_loss at each validation (tokens: dense, " + ", ".join(f"E={e}" for e in args.experts) + "):", "",
                  "| tokens | " + " | ".join("dense" if not e else f"E={e}" for e in out) + " |",
                  "|---|" + "---|" * len(out)]
        for i, (tokens, _) in enumerate(out[0]["val"]):
            lines.append(f"| {tokens:,.0f} | " + " | ".join(f"{r['val'][i][1]:.4f}" if i < len(r["val"]) else "-"
                                                            for r in out.values()) + " |")
        lines.append("")
        results[corpus] = {e: {k: v for k, v in r.items() if k != "train"} for e, r in out.items()}
    return lines, results


def params(e: int) -> str:
    """Total and active parameters of the debug model with e experts (0: dense), as model.py counts them."""
    import config as config_lib
    import model as model_lib
    cfg = config_lib.parse_config(["--config", DEBUG, *(moe_flags(e) if e else [])])
    total, active = model_lib.num_params(cfg.model), model_lib.num_params(cfg.model, active=True)
    return f"{total / 1e6:.2f}M" + (f" ({active / 1e6:.2f}M active)" if e else "")


def balance_section(args, log) -> tuple[list[str], dict]:
    """The default balancing on the debug model, 8 experts, --balance_steps steps: moe_max_load per 10-step window."""
    run_dir = os.path.join(args.workdir, "balance_moe8")
    data = os.path.join(args.workdir, "stdlib_dense", "data")
    extra = ["--train.steps", str(args.balance_steps), "--train.val_interval", str(args.balance_steps),
             "--checkpoint.interval", str(args.balance_steps), *moe_flags(8)]
    records, seconds, cmd = train(run_dir, extra, data if os.path.isdir(data) else None, log)
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
    cmd = [os.path.join(ROOT, "benchmarks", "bench.py"), "--config", DEBUG, "--threads", "1", "--warmup", "2",
           "--steps", str(args.time_steps), *[f for e in args.experts for f in ("--variant", f"moe{e}=" + " ".join(moe_flags(e)))],
           "--json", js]
    subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env(), check=True)
    with open(js) as f:
        res = json.load(f)
    v = res["variants"]
    dense = v["ours"]["step_s_all"]
    lines = ["```", "OMP_NUM_THREADS=1 python " + show(cmd), "```", "",
             "| model | step s, median (min-max) | tokens/s | time per token vs dense, median of paired steps (goal <= 1.3) | cpu busy |",
             "|---|---|---|---|---|"]
    out = {}
    for name, r in v.items():
        ratio = statistics.median(a / b for a, b in zip(r["step_s_all"], dense))
        s = r["step_s"]
        out[name] = {"ratio": ratio, "step_s": s["median"], "tokens_per_sec": r["tokens_per_sec"]["median"]}
        lines.append(f"| {'dense' if name == 'ours' else name.replace('moe', '') + ' experts'} | "
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
    p.add_argument("--steps", type=int, default=150, help="training steps of every tokens-to-loss run")
    p.add_argument("--val_interval", type=int, default=10)
    p.add_argument("--experts", default="4,8,16", help="expert counts, comma-separated (each divides 192 * 2 = 384 active)")
    p.add_argument("--prose", default=PROSE, help="the second corpus: local prose files (data.dataset)")
    p.add_argument("--time_steps", type=int, default=10, help="timed steps per model in the step-time section")
    p.add_argument("--ep_steps", type=int, default=3, help="timed steps per ep in the EP section")
    p.add_argument("--balance_steps", type=int, default=200, help="steps of the balance run (8 experts, stdlib)")
    p.add_argument("--sections", default="tokens,balance,time,ep", help="which sections to run, comma-separated")
    p.add_argument("--workdir", default="/tmp/moe_bench")
    args = p.parse_args(argv)
    args.experts = [int(e) for e in args.experts.split(",")]
    sections = args.sections.split(",")
    os.makedirs(args.workdir, exist_ok=True)
    corpora = {"stdlib": ("stdlib: the Python standard library (the debug corpus)", []),
               "prose": (f"prose: {args.prose}", ["--data.dataset", args.prose])}
    t0 = time.perf_counter()
    lines = [f"# Mixture of experts against dense at equal active parameters: the debug model, {args.steps} steps",
             "", f"`python benchmarks/moe_bench.py --steps {args.steps} --out {args.out}` "
             "(every process OMP_NUM_THREADS=1, one at a time)", ""]
    results = {}
    with open(os.path.join(args.workdir, "log.txt"), "w") as log:
        if "tokens" in sections:
            body, results["tokens"] = tokens_section(args, corpora, log)
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
