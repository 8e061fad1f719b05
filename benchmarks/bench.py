"""Benchmark of the training step: tokens/s, MFU and memory per rank, against `transformers`.

One process (threads per rank with --threads):

    python benchmarks/bench.py --config configs/debug.toml --model.dim 512 --model.n_layers 8 \\
        --model.n_heads 8 --model.n_kv_heads 2 --model.ffn_dim 1408 --model.vocab_size 8192 \\
        --data.seq_len 256 --train.global_batch_size 8 --threads 2 --hf

N FSDP ranks: the same under `torchrun --standalone --nproc_per_node=N`. Parallel layouts side
by side (the driver launches one torchrun per layout, alternating, --rounds times):

    python benchmarks/bench.py ... --layouts 1x2,2x1 --rounds 2      # RANKSxTHREADS

Every variant (ours, --variant NAME=ARGS, --hf) is built in the same process, warmed up, then
timed in turns (round-robin, one step each), so load from other jobs hits them alike. Each
round also times a 2048^3 fp32 GEMM; the best round is the CPU's peak, the MFU denominator. The
batches are synthetic random tokens: the data pipeline is timed on its own (--loader_seconds).
--forward_only also times each variant's validation pass (validation.loss_sum_and_count, under
no_grad, on the same batches) in the same turns: the cost of validation and evaluate.py, e.g.
the chunked loss against full logits. A variant with '--src DIR' runs DIR's model.py (e.g. a
copy from before a change), parallelized and stepped by this checkout's code, so the table
compares the two models alone.
Prints a table and writes every figure as JSON (--json).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import config as config_lib  # noqa: E402
import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import prepare  # noqa: E402
from core import errors  # noqa: E402
from data_pipeline import loader as loader_lib  # noqa: E402
from evaluation import validation  # noqa: E402
from observability import metrics  # noqa: E402
from optimization import optimizers  # noqa: E402
from parallel import distributed, layout, parallelize  # noqa: E402
from training.step import build_trainable, optimizer_step, train_step  # noqa: E402

MIB = 2 ** 20


def parse_args(argv):
    """(the benchmark's own flags, the rest: trainer config flags for config.parse_config)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (compilation happens here)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave as is)")
    p.add_argument("--hf", action="store_true", help="also time transformers' LlamaForCausalLM (one process only)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="another setting of our step: config overrides ('--train.compile true') and/or "
                        "'--src DIR' (model.py from DIR, e.g. a copy from before a change, with this "
                        "checkout's parallelization and step)")
    p.add_argument("--loader_seconds", type=float, default=1.0, help="time data_pipeline.loader.GlobalBatchLoader this long (0: skip)")
    p.add_argument("--forward_only", action="store_true",
                   help="also time each variant's validation pass (forward only, no_grad) on the step's batches")
    p.add_argument("--profile", type=int, default=0, help="print the N ops with most self CPU time, per variant")
    p.add_argument("--layouts", default="", help="driver: comma list of RANKSxTHREADS, e.g. 1x2,2x1")
    p.add_argument("--rounds", type=int, default=1, help="driver: launches per layout, alternating")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_known_args(argv)


# ---------------------------------------------------------------- what is timed

def local_bytes(tensors) -> int:
    """Bytes of this rank's part of the tensors (DTensor: the local shard), summed."""
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker_trainable(argv: list[str], steps: int) -> tuple:
    """A benchmark worker's run under torchrun, built as the trainers build it: (flags, cfg, rank, world, mesh,
    Trainable). argv: --steps N (default steps), --json FILE (required), then config overrides; one thread per
    process. Collective (it initialises the process group and builds the sharded model)."""
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--json", required=True)
    a, rest = p.parse_known_args(argv)
    cfg = config_lib.parse_config(rest)
    config_lib.validate(cfg, distributed.world_size())
    rank, world, device = distributed.init_distributed(cfg.train.device)
    par = cfg.parallel
    mesh = layout.build_mesh(device, world, par)
    return a, cfg, rank, world, mesh, build_trainable(cfg, rank, mesh, device)


def load_model_source(src: str):
    """model.py of directory src as a module, imported under a private name (so it never
    replaces this checkout's `model`)."""
    spec = importlib.util.spec_from_file_location(f"bench_{abs(hash(src))}_model", os.path.join(src, "model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class OursStep:
    """The trainer's own step (train_step) on the FSDP2-sharded model of build_trainable.

    src: a directory whose model.py's Transformer is timed instead of this checkout's; it is
    parallelized, initialised and stepped by this checkout's parallelize and trainer."""

    def __init__(self, name, cfg, mesh, device, src: str = ""):
        self.name, self.cfg, self.device = name, cfg, device
        t = cfg.train
        model = None
        if src:
            mm = load_model_source(src)
            with torch.device("meta"):
                model = mm.Transformer(mm.ModelArgs(**dataclasses.asdict(cfg.model)))
            parallelize.parallelize(model, mesh, cfg.parallel, dtype=config_lib.compute_dtype(t, device),
                                    activation_checkpointing=t.activation_checkpointing, compile=t.compile)
            parallelize.materialize(model, device, t.seed, cfg.parallel.cpu_offload)
        self.trainable = build_trainable(cfg, dist.get_rank(), mesh, device, model=model)
        self.model, self.optimizer = self.trainable.model, self.trainable.optimizer

    def step(self, micro_batches, after_backward=None):
        train_step(self.trainable, micro_batches, after_backward)

    def forward_only(self, micro_batches):
        vs = validation.ValSet("bench", micro_batches, 0, len(micro_batches))
        validation.loss_sum_and_count(self.trainable.runner, vs, self.trainable.mesh.data.get_group())


class HFStep(OursStep):
    """transformers' LlamaForCausalLM (sdpa attention, random init, same shape and dtype): forward,
    fp32 summed token loss / target count, backward, then the same clipping and AdamW as ours."""

    def __init__(self, name, cfg, mesh, device):
        transformers = errors.require("transformers", "hf", "bench.py --hf")

        self.name, self.cfg, self.device = name, cfg, device
        dtype = torch.bfloat16 if config_lib.compute_dtype(cfg.train, device) == "bfloat16" else torch.float32
        a = cfg.model
        config = transformers.LlamaConfig(
            vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_dim, num_hidden_layers=a.n_layers,
            num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim,
            max_position_embeddings=a.max_seq_len, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta}, tie_word_embeddings=False,
            attention_bias=False, mlp_bias=False, use_cache=False)
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                   dtype=dtype).to(device)
        self.model.train()
        self.optimizer, self.scheduler = optimizers.build_optimizer(self.model, cfg.optim, cfg.train.steps,
                                                               fused=not cfg.parallel.cpu_offload)
        self.n_targets = cfg.train.global_batch_size * cfg.data.seq_len

    def step(self, micro_batches, after_backward=None):
        for inputs, labels in micro_batches:
            logits = self.model(input_ids=inputs.to(self.device)).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(self.device).flatten(), reduction="sum")
            (loss / self.n_targets).backward()
        if after_backward is not None:
            after_backward(self.model)
        optimizer_step(self.model, self.optimizer, self.cfg.optim.grad_clip, self.device)
        self.scheduler.step()

    @torch.no_grad()
    def forward_only(self, micro_batches):
        for inputs, labels in micro_batches:
            logits = self.model(input_ids=inputs.to(self.device)).logits
            F.cross_entropy(logits.float().flatten(0, 1), labels.to(self.device).flatten(), reduction="sum").item()


def synthetic_batches(cfg, dp: int, n: int, seed: int = 0):
    """n steps of this rank's micro-batches [(inputs, labels)], (micro, seq_len) int64 random tokens."""
    micro = cfg.train.micro_batch(dp)
    per_rank, seq = cfg.train.global_batch_size // dp, cfg.data.seq_len
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    steps = []
    for _ in range(n):
        w = torch.randint(0, cfg.model.vocab_size, (per_rank, seq + 1), generator=gen)
        steps.append([data_lib.inputs_labels(mb) for mb in w.split(micro)])
    return steps


def memory_step(v, batch, profile_rows: int) -> dict:
    """One untimed, profiled step: local bytes of parameters, gradients and optimizer state (MiB),
    and the step's peak of allocated memory (state at the start + the highest running sum of the
    step's allocations, MiB; on CUDA the allocator's peak)."""
    from torch.profiler import ProfilerActivity, profile

    params = list(v.model.parameters())
    opt_state = [t for s in v.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    start = local_bytes(params) + local_bytes(opt_state)
    if v.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(v.device)
    grads = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step(batch, after_backward=lambda m: grads.append(local_bytes(p.grad for p in params if p.grad is not None)))
    running = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        if e.device_type() == torch.autograd.DeviceType.CPU:
            running += e.nbytes()
            peak = max(peak, running)
    if profile_rows and dist.get_rank() == 0:
        print(f"--- profile of one step: {v.name}\n"
              + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=profile_rows), flush=True)
    step_peak = torch.cuda.max_memory_allocated(v.device) if v.device.type == "cuda" else start + peak
    return {"params_mib": local_bytes(params) / MIB, "grads_mib": grads[0] / MIB,
            "optim_mib": local_bytes(opt_state) / MIB, "step_peak_mib": step_peak / MIB}


def loader_rate(cfg, dp_rank: int, dp: int, seconds: float) -> float:
    """Tokens/s per rank that data_pipeline.loader.GlobalBatchLoader.next_step delivers on cfg.data (prepared into
    run_dir/data_<hash of the data settings> on rank 0 if needed); counts input tokens."""
    key = json.dumps(cfg.data.prepared_settings(), sort_keys=True)
    out = os.path.join(cfg.run_dir, f"data_{zlib.crc32(key.encode()):08x}")
    distributed.on_rank0(lambda: prepare.prepare(cfg.data, out), dist.get_rank())
    corpus = data_lib.PackedCorpus(out, cfg.data)
    micro = cfg.train.micro_batch(dp)
    loader = loader_lib.GlobalBatchLoader(corpus, cfg.train.global_batch_size, micro, dp_rank, dp, cfg.train.seed)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += sum(inputs.numel() for inputs, _ in loader.next_step())
    return tokens / (time.perf_counter() - t0)


def set_vs_ours(res: dict) -> None:
    """vs_ours of each variant: median over rounds of ours' step time / its step time in the same
    round (paired, so load that comes and goes cancels out); > 1 means faster than ours."""
    ours = res["variants"]["ours"]
    for v in res["variants"].values():
        v["vs_ours"] = statistics.median(a / b for a, b in zip(ours["step_s_all"], v["step_s_all"]))
        if "forward_only_s_all" in v:
            v["forward_only_vs_ours"] = statistics.median(
                a / b for a, b in zip(ours["forward_only_s_all"], v["forward_only_s_all"]))


def stats(xs) -> dict:
    """{'median', 'min', 'max'} of a list of numbers."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def peak_flops(device, n: int = 2048) -> float:
    """FLOP/s of one device: a fresh n^3 fp32 GEMM timing on CPU, the data-sheet bf16 peak on CUDA."""
    return metrics.measured_cpu_peak_flops(n, seconds=0.0, min_timings=1) if device.type == "cpu" \
        else metrics.device_peak_flops(device)


def run_worker(args, rest) -> dict:
    """Build every variant on every rank, time them in turns; returns the results (all ranks)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_lib.parse_config(rest)
    if cfg.parallel.tp != 1:
        raise SystemExit(f"[bench] parallel.tp is {cfg.parallel.tp}: the benchmark times FSDP only (tp 1)")
    config_lib.validate(cfg, distributed.world_size())
    rank, world, device = distributed.init_distributed(cfg.train.device)
    mesh = layout.build_mesh(device, world)
    variants = [OursStep("ours", cfg, mesh, device)]
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        extra = shlex.split(extra)
        src = ""
        if "--src" in extra:
            i = extra.index("--src")
            src = os.path.abspath(extra.pop(i + 1))
            extra.pop(i)
        variants.append(OursStep(name, config_lib.parse_config(rest + extra), mesh, device, src))
    if args.hf:
        if world == 1:
            variants.append(HFStep("transformers", cfg, mesh, device))
        elif rank == 0:
            print("[bench] --hf skipped: transformers' model runs in one process only", flush=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batches = synthetic_batches(cfg, world, args.warmup + args.steps)
    first_step_s = {}
    for v in variants:
        for i in range(args.warmup):
            t0 = time.perf_counter()
            v.step(batches[i])
            sync()
            first_step_s.setdefault(v.name, time.perf_counter() - t0)
    times = {v.name: [] for v in variants}
    cpu = {v.name: [] for v in variants}
    fwd = {v.name: [] for v in variants}
    peaks = []
    for r, i in enumerate(range(args.warmup, args.warmup + args.steps)):
        peaks.append(peak_flops(device))
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotate: no variant always first
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            v.step(batches[i])
            sync()
            times[v.name].append(time.perf_counter() - t0)
            cpu[v.name].append(time.process_time() - c0)
            if args.forward_only:
                dist.barrier()
                t0 = time.perf_counter()
                v.forward_only(batches[i])
                sync()
                fwd[v.name].append(time.perf_counter() - t0)
    # The step of a run lasts as long as its slowest rank; the run's peak is the sum of its ranks'.
    t = torch.tensor([times[v.name] for v in variants], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    fo = torch.tensor([fwd[v.name] for v in variants], dtype=torch.float64)
    dist.all_reduce(fo, op=dist.ReduceOp.MAX)
    c = torch.tensor([cpu[v.name] for v in variants], dtype=torch.float64)
    dist.all_reduce(c)
    c /= t * torch.get_num_threads() * world  # share of the wall time the run's threads were on a core
    pk = torch.tensor(peaks, dtype=torch.float64)
    dist.all_reduce(pk)
    peak = pk.max().item()  # the run's peak: its best GEMM round
    mem = {v.name: memory_step(v, batches[-1], args.profile) for v in variants}

    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    fpt = model_lib.flops_per_token(cfg.model, cfg.data.seq_len)
    res = {"world_size": world, "threads": torch.get_num_threads(), "device": device.type,
           "peak_source": "measured 2048^3 fp32 GEMM, summed over ranks" if device.type == "cpu"
           else f"{torch.cuda.get_device_name(device)}: data-sheet dense bf16, {peak / world / 1e12:.0f} TFLOP/s per device",
           "peak_tflops": stats((pk / 1e12).tolist()), "peak_tflops_all": (pk / 1e12).tolist(),
           "tokens_per_step": tokens, "flops_per_token": fpt,
           "params": model_lib.num_params(cfg.model), "peak_rss_gib": metrics.peak_memory_gib(device),
           "variants": {}}
    for j, v in enumerate(variants):
        tps = [tokens / s for s in t[j].tolist()]
        mfu = [x * fpt / peak for x in tps]
        res["variants"][v.name] = {
            "tokens_per_sec": stats(tps), "step_s": stats(t[j].tolist()), "mfu": stats(mfu),
            "cpu_busy": stats(c[j].tolist()),
            "first_step_s": first_step_s.get(v.name), "mem_mib_per_rank": mem[v.name],
            "step_s_all": t[j].tolist()}
        if args.forward_only:
            res["variants"][v.name].update(forward_only_s=stats(fo[j].tolist()), forward_only_s_all=fo[j].tolist())
    set_vs_ours(res)
    base = res["variants"]["ours"]["tokens_per_sec"]["median"]
    if args.loader_seconds > 0:
        rate = loader_rate(cfg, mesh.local_rank("data"), world, args.loader_seconds)
        r = torch.tensor([rate], dtype=torch.float64)
        dist.all_reduce(r, op=dist.ReduceOp.MIN)
        consumed = base / world
        res["loader"] = {"tokens_per_sec_per_rank": r.item(), "step_consumes_per_rank": consumed,
                         "ratio": r.item() / consumed}
    return res


# ---------------------------------------------------------------- output

def fmt_stats(s, scale=1.0, spec=".0f"):
    """'median (min-max)' of a stats() dict, each times scale."""
    return f"{s['median'] * scale:{spec}} ({s['min'] * scale:{spec}}-{s['max'] * scale:{spec}})"


def print_table(res: dict, label: str = "") -> None:
    """One run's results as a table on stdout (rank 0)."""
    print(f"\n[bench] {label}{res['world_size']} rank(s) x {res['threads']} thread(s), {res['device']}; "
          f"{res['tokens_per_step']} tokens/step, {res['flops_per_token'] / 1e6:.1f} MFLOP/token, "
          f"{res['params'] / 1e6:.2f}M params; peak {fmt_stats(res['peak_tflops'], 1e3, '.1f')} GFLOP/s "
          f"({res['peak_source']}); peak RSS {res['peak_rss_gib']:.2f} GiB/rank")
    print(f"{'variant':<20}{'tokens/s median (min-max)':>28}{'MFU':>22}{'vs ours':>9}{'cpu busy':>9}"
          f"{'params/grads/optim MiB/rank':>30}{'step peak MiB':>15}")
    for name, r in res["variants"].items():
        m = r["mem_mib_per_rank"]
        print(f"{name:<20}{fmt_stats(r['tokens_per_sec']):>28}{fmt_stats(r['mfu'], 1, '.3f'):>22}"
              f"{r['vs_ours']:>8.2f}x{r['cpu_busy']['median']:>9.2f}"
              f"{m['params_mib']:>12.1f}/{m['grads_mib']:.1f}/{m['optim_mib']:.1f}{m['step_peak_mib']:>15.0f}")
    for name, r in res["variants"].items():
        if "forward_only_s" in r:
            print(f"forward only (validation pass) {name}: {fmt_stats(r['forward_only_s'], 1e3)} ms, "
                  f"{r['forward_only_vs_ours']:.2f}x ours' speed (paired)")
    if "loader" in res:
        ld = res["loader"]
        print(f"loader: {ld['tokens_per_sec_per_rank']:,.0f} tokens/s per rank delivered vs "
              f"{ld['step_consumes_per_rank']:,.0f} consumed by the step ({ld['ratio']:.0f}x)")
    sys.stdout.flush()


def drive(args, rest) -> dict:
    """Launch torchrun once per layout and round, alternating; pool each layout's timed steps."""
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    fwd = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--loader_seconds", str(args.loader_seconds),
           "--profile", str(args.profile)] + (["--hf"] if args.hf else []) + \
        (["--forward_only"] if args.forward_only else [])
    for spec in args.variant:
        fwd += ["--variant", spec]
    runs: dict[tuple, list[dict]] = {lay: [] for lay in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for ranks, threads in layouts:
                out = os.path.join(tmp, f"{ranks}x{threads}_{r}.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                       os.path.abspath(__file__), *fwd, "--threads", str(threads), "--json", out, *rest]
                env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
                if rc and not os.path.exists(out):
                    raise SystemExit(f"[bench] {' '.join(cmd)} failed with exit status {rc}")
                if rc:
                    print(f"[bench] warning: the {ranks}x{threads} run exited with status {rc} after writing "
                          f"its results", flush=True)
                with open(out) as f:
                    runs[(ranks, threads)].append(json.load(f))
    summary = {}
    for (ranks, threads), rs in runs.items():
        res = rs[0]  # memory and loader figures of the first round; times pooled over all rounds
        res["peak_tflops_all"] = [p for x in rs for p in x["peak_tflops_all"]]
        res["peak_tflops"] = stats(res["peak_tflops_all"])
        for name, v in res["variants"].items():
            v["step_s_all"] = [s for x in rs for s in x["variants"][name]["step_s_all"]]
            v["step_s"] = stats(v["step_s_all"])
            if "forward_only_s_all" in v:
                v["forward_only_s_all"] = [s for x in rs for s in x["variants"][name]["forward_only_s_all"]]
                v["forward_only_s"] = stats(v["forward_only_s_all"])
            tps = [res["tokens_per_step"] / s for s in v["step_s_all"]]
            v["tokens_per_sec"] = stats(tps)
            v["mfu"] = stats([x * res["flops_per_token"] / (res["peak_tflops"]["max"] * 1e12) for x in tps])
            v["cpu_busy"] = stats([x["variants"][name]["cpu_busy"]["median"] for x in rs])
        set_vs_ours(res)
        summary[f"{ranks}x{threads}"] = res
    ref_key, ref = next(iter(summary.items()))
    print(f"\n[bench] layouts (RANKSxTHREADS), {args.rounds} launch(es) each, timed steps pooled:")
    for key, res in summary.items():
        print_table(res, f"{key}: ")
        for name, v in res["variants"].items():
            r = ref["variants"].get(name)
            if r is None or key == ref_key:
                continue
            state = sum(v["mem_mib_per_rank"][k] for k in ("params_mib", "grads_mib", "optim_mib"))
            state_ref = sum(r["mem_mib_per_rank"][k] for k in ("params_mib", "grads_mib", "optim_mib"))
            v["vs_" + ref_key] = {"tokens_per_sec": v["tokens_per_sec"]["median"] / r["tokens_per_sec"]["median"],
                                  "state_mem_per_rank": state / state_ref}
            print(f"{name} vs {ref_key}: tokens/s {v['vs_' + ref_key]['tokens_per_sec']:.2f}x; params+grads+optim "
                  f"per rank {v['vs_' + ref_key]['state_mem_per_rank']:.3f}x (1/N = "
                  f"{ref['world_size'] / res['world_size']:.3f})")
    return {"layouts": summary}


def main(argv=None) -> int:
    """Worker (plain python or under torchrun) or, with --layouts, the driver; returns the exit status."""
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.hf:
        try:
            errors.require("transformers", "hf", "bench.py --hf")
        except errors.UserError as e:
            raise SystemExit(f"error: {e}") from None
    rest = ["--run_dir", os.path.join(ROOT, "runs", "bench")] + rest  # a later --run_dir wins
    if args.layouts:
        res = drive(args, rest)
    else:
        res = run_worker(args, rest)
        if dist.get_rank() == 0:
            print_table(res)
        distributed.finish_distributed()
    if args.json and int(os.environ.get("RANK", 0)) == 0:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
