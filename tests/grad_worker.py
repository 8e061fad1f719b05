"""Losses and whole gradients of a run's first steps, for parity tests across parallel layouts.

    torchrun --nproc_per_node=N tests/grad_worker.py --out FILE [--tp T] --config configs/debug.toml \
        --run_dir DIR --train.steps S [--section.field VALUE ...]
    torchrun --nproc_per_node=N tests/grad_worker.py --jobs FILE    # a JSON list of such argument lists

With --jobs, one launch runs every job in turn in the same process group (a job per layout of
this world size: the start-up of torchrun and of its workers is paid once).

Builds the run as the trainers do (build; with --tp T > 1 on the ("dp", "tp") mesh
with train_2d's plan and loss_parallel), then runs the loop's own step, train_step,
whose after_backward hook gathers every gradient as a full tensor before clipping. Rank 0
saves with torch.save a dict:

    losses       [float]                 mean token loss of each step's global batch
    grad_norms   [float]                 pre-clip global gradient norm of each step
    moe          [{str: float}]          an MoE model's train-record fields of each step (the step hooks' record)
    grads        [{name: Tensor}]        each step's full fp32 gradients, keyed by parameter name
    replicated   {name: float}           after the last step, for parameters replicated over
                                         "tp": the largest |difference| between TP ranks' copies
    logits       Tensor (B, T, vocab)    with --logits_of FILE: the initial model's fp32 logits of
                                         the token batch torch.load(FILE), gathered whole (over
                                         "tp" and, with --parallel.cp, over the CP slices)
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_2d  # noqa: E402
from config import parse_config  # noqa: E402
from launch import job_list  # noqa: E402
from parallel import distributed  # noqa: E402
from parallel.context_parallel import shard_batch  # noqa: E402
from training.command import check_run  # noqa: E402
from training.session import build  # noqa: E402
from training.step import train_step  # noqa: E402


def replica_spread(model, tp_mesh, experts_split: bool = False) -> dict[str, float]:
    """Largest |difference| between TP ranks' local copies of each parameter replicated over "tp" (Replicate on
    "tp", or not on "tp" at all: an MoE's router and experts, computed whole on every TP rank). experts_split: the
    routed experts are split over the TP ranks (an EP group that takes them in), not replicated."""
    out = {}
    group = tp_mesh.get_group()
    for name, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names
        if "tp" in names and not p.placements[names.index("tp")].is_replicate():
            continue
        if experts_split and ".feed_forward.experts." in name:
            continue
        local = p.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(tp_mesh.size())]
        dist.all_gather(copies, local, group=group)
        out[name] = max((c - local).abs().max().item() for c in copies)
    return out


def run_job(argv: list[str]) -> None:
    """One job: build the run of argv (see the module's docstring), train its steps, rank 0 saves the result."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="file that rank 0 writes")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1: FSDP only)")
    parser.add_argument("--logits_of", default="", help="a torch.save'd (B, T) int64 token batch to run first")
    args, overrides = parser.parse_known_args(argv)
    cfg = parse_config([*overrides, "--parallel.tp", str(args.tp)])
    plan = train_2d.PLAN if args.tp > 1 else None
    check_run(cfg, distributed.world_size(), plan, train_2d.check_tp_layout)
    if not dist.is_initialized():
        distributed.init_distributed(cfg.train.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = distributed.resolve_device(cfg.train.device, distributed.local_rank())
    s = build(cfg, rank, world, device, plan, resume=False)
    result = {"losses": [], "grad_norms": [], "grads": [], "replicated": {},
              "init": {name: p.full_tensor().detach().cpu().clone() for name, p in s.model.named_parameters()}}
    if args.logits_of:
        tokens = torch.load(args.logits_of).to(device)
        with torch.no_grad():  # under parallel.cp each rank runs its slice of the windows, then they are joined
            inputs, _, layout = shard_batch(s.model, tokens, tokens, s.mesh.cp)
            logits = s.model(inputs, layout=layout)
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).contiguous()
        if s.mesh.cp is not None:
            parts = [torch.empty_like(logits) for _ in range(s.mesh.size("cp"))]
            dist.all_gather(parts, logits, group=s.mesh.cp.get_group())
            logits = torch.cat(parts, dim=1)
        result["logits"] = logits.cpu()

    def keep_grads(model):
        # clone: on one rank full_tensor() may share storage with the gradient, which clipping scales in place
        result["grads"].append({name: p.grad.full_tensor().detach().float().cpu().clone()
                                for name, p in model.named_parameters()})

    for _ in range(cfg.train.steps):
        step = train_step(s, s.loader.next_step(), after_backward=keep_grads)  # the loop's own step
        result["losses"].append(step.global_loss(s.mesh.loss.get_group()))
        result["grad_norms"].append(step.grad_norm.item())
        record = {k: v for hook in s.hooks for k, v in hook.record(step.n_targets).items()}
        if record:
            result.setdefault("moe", []).append(record)
    if args.tp > 1:
        result["replicated"] = replica_spread(s.model, s.mesh.tp, "tp" in s.mesh.layout.ep_takes)
    if rank == 0:
        torch.save(result, args.out)
    del s
    gc.collect()


def main() -> None:
    gc.freeze()  # the imports' objects: out of reach of each job's collection and the exit's (core.cli.exit_command)
    for argv in job_list(sys.argv[1:]):
        run_job(argv)
    distributed.finish_distributed()


if __name__ == "__main__":
    main()
