"""The optimizer by name (AdamW, or Muon for the blocks' matrices with AdamW for the rest) and the LR schedules.

Schedules (optim.schedule): linear warmup over optim.warmup_steps steps, then cosine decay, linear
decay, or WSD (stable at the peak, then decay over the last decay_fraction of the run). After the
warmup the schedule runs in samples (tokens: every sample has seq_len), counted in steps of the
first batch: with [[train.batch_stages]] a step of a batch twice as large advances the schedule
by two, and decay_fraction is a fraction of the run's tokens (Megatron-LM likewise schedules
in samples when the batch ramps up). Without batch stages this is plain optimizer steps. Each
factor is a pure function of (step, train.steps, the batch stages), so a run loaded from another
run's checkpoint with its own train.steps follows its own schedule from the loaded step.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import torch

from core.errors import ConfigError
from nn import parametrization
from nn.roles import roles
from optimization.muon import MuonAdamW, is_muon_matrix


@dataclasses.dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """'adamw', or 'muon': Muon (muon.py) on the blocks' hidden matrices (attention.wq wk wv wo, feed_forward.w1 w2 w3, an MoE's experts each on its own), AdamW on embeddings, output, norms and an MoE's router."""
    lr: float = 1e-3
    """Peak learning rate of AdamW and of Muon (whose LR is scaled by 0.2 * sqrt(max(m, n)) per matrix to match AdamW's update RMS)."""
    schedule: Literal["cosine", "wsd", "linear"] = "cosine"
    """LR schedule after the linear warmup: 'cosine' to min_lr_ratio, 'linear' to min_lr_ratio, or 'wsd' (stable at lr, then decay over the last decay_fraction of the run). It runs in samples (tokens), which are optimizer steps unless [[train.batch_stages]] grow the batch."""
    decay_fraction: float = 0.2
    """WSD: fraction of the run (of train.steps, or of its tokens with batch stages), in (0, 1], over which the LR decays to min_lr_ratio at the end of the run."""
    decay_shape: Literal["linear", "1-sqrt"] = "linear"
    """WSD: shape of the decay: 'linear' or '1-sqrt' (1 - sqrt(progress), Hagele et al. 2024)."""
    muon_momentum: float = 0.95
    """Muon: momentum (Nesterov), torch.optim.Muon's default."""
    min_lr_ratio: float = 0.0
    """LR of the last step (train.steps) of every schedule, as a fraction of lr."""
    warmup_steps: int = 1000
    """Steps of linear warmup from lr/warmup_steps to lr."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (embeddings and projections); norm weights are not decayed."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this (0: no clipping; the norm is still logged)."""

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay", "grad_clip", "min_lr_ratio"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"optim.{name} must be a finite number, got {getattr(self, name)}")
        if self.min_lr_ratio > 1:
            raise ConfigError(f"optim.min_lr_ratio is a fraction of optim.lr: it must be in [0, 1], got "
                              f"{self.min_lr_ratio}")
        if self.warmup_steps < 0 or not self.lr > 0:
            raise ConfigError(f"optim.lr must be > 0 and optim.warmup_steps >= 0, got {self.lr} and "
                              f"{self.warmup_steps}")
        if not 0 < self.decay_fraction <= 1:  # also refuses NaN
            raise ConfigError(f"optim.decay_fraction is a fraction of train.steps: it must be in (0, 1], got "
                              f"{self.decay_fraction}")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        for name in ("weight_decay", "grad_clip", "min_lr_ratio"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float, schedule: str = "cosine",
              decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """Multiplier of the peak LR for the optimizer step that follows `step` completed steps (step k = step + 1).

    Step k of T (1-indexed, what metrics.jsonl logs) runs at: k / W for k <= W (linear warmup,
    the peak at step W), then decayed(k, W, T): the peak at step W, min_ratio at step T (the
    last step). Units: optimizer steps.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return decayed(step + 1, warmup_steps, total_steps, min_ratio, schedule, decay_fraction, decay_shape)


def decayed(k: float, warmup_steps: int, total: float, min_ratio: float, schedule: str = "cosine",
            decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """The schedule after the warmup, for the step that ends at position k (of total; steps, or samples / first batch).

    cosine: min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2, p = (k - W) / (T - W)
    (Loshchilov & Hutter, SGDR, 2017); linear: min_ratio + (1 - min_ratio) * (1 - p); wsd:
    1 until the last D = max(1, round(decay_fraction * T)), then min_ratio + (1 - min_ratio)
    * f(q), q = (k - (T - D)) / D, f = 1 - q ('linear') or 1 - sqrt(q) ('1-sqrt') (Hagele et
    al., "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations", 2024).
    p and q are clamped to [0, 1]. Positions are those at the end of the step, so the decay
    covers the steps after W (or the last D) and the last step, k = T, runs at exactly
    min_ratio (as torchtitan's WSD, which counts step + 1).
    """
    if schedule == "wsd":
        decay = max(1, round(decay_fraction * total))
        q = min(1.0, max(0.0, (k - (total - decay)) / decay))
        return min_ratio + (1 - min_ratio) * (1 - (math.sqrt(q) if decay_shape == "1-sqrt" else q))
    progress = min(1.0, max(0.0, (k - warmup_steps) / max(1, total - warmup_steps)))
    if schedule == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_position(step: int, batch_schedule: list[tuple[int, int]]) -> float:
    """Samples in the first `step` optimizer steps, divided by the first global batch: `step` itself without stages.

    batch_schedule: [(start_step, global_batch_size)], sorted, the first at 0 (TrainConfig.batch_schedule).
    """
    samples = 0
    for i, (start, batch) in enumerate(batch_schedule):
        end = batch_schedule[i + 1][0] if i + 1 < len(batch_schedule) else step
        samples += batch * max(0, min(step, end) - start)
    return samples / batch_schedule[0][1]


def scheduled_factor(step: int, warmup_steps: int, total_steps: int, batch_schedule: list[tuple[int, int]],
                     **shape) -> float:
    """lr_factor for the step after `step` completed steps: warmup in steps, the rest in samples (schedule_position).

    shape: lr_factor's min_ratio, schedule, decay_fraction, decay_shape. After the warmup the
    step is placed by the samples done at its end, schedule_position(step + 1), against those
    of the whole run, so the last step runs at min_ratio. The stages only grow the batch
    (config checks), so the position is >= the step's own count.
    """
    if step < warmup_steps:
        return lr_factor(step, warmup_steps, total_steps, **shape)
    return decayed(schedule_position(step + 1, batch_schedule), warmup_steps,
                   schedule_position(total_steps, batch_schedule), **shape)


def schedule_notice(cfg: OptimConfig, total_steps: int) -> str:
    """One line for the start when optim.warmup_steps >= total_steps (train.steps), else ''.

    Such a run never leaves the linear warmup, whatever optim.schedule: the cosine and linear
    decays start at warmup_steps, and lr_factor's warmup branch comes first for WSD too, so its
    decay over the last decay_fraction of the run never runs. Not an error: a short debug run
    of a long config (warmup 20, --train.steps 3) is legitimate.
    """
    if cfg.warmup_steps < total_steps:
        return ""
    return (f"[train] notice: optim.warmup_steps ({cfg.warmup_steps}) >= train.steps ({total_steps}): the LR never "
            f"leaves its warmup and the '{cfg.schedule}' schedule never decays; lower optim.warmup_steps below "
            f"train.steps to decay")


def reapply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set every group's LR from the schedule at scheduler.last_epoch (after loading a checkpoint).

    LambdaLR.load_state_dict restores the LR the saved run computed with its own train.steps;
    recomputing it makes the schedule a function of (step, this run's train.steps) only.
    """
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def scale_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, factor: float) -> None:
    """Multiply the schedule's base LRs by factor (train.rollback_lr_factor ** rollbacks) and set the LRs in force."""
    if factor != 1.0:
        scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
        reapply_schedule(scheduler)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int, fused: bool = True,
                    batch_schedule: list[tuple[int, int]] = ((0, 1),), group=None):
    """(optimizer, LambdaLR over all its param groups) for model, by cfg.name, scheduled to total_steps.

    batch_schedule: TrainConfig.batch_schedule(), which turns the steps after the warmup into
    samples (scheduled_factor); the default, one constant batch, keeps them steps.

    adamw: torch.optim.AdamW, decay on matrices (ndim >= 2) only. muon: muon.MuonAdamW with the
    blocks' hidden matrices (by declared role, nn/roles.py) in a Muon group (decay cfg.weight_decay, momentum cfg.muon_momentum)
    and the rest in AdamW groups as above; one LambdaLR scales every group. Under model.parametrization
    mup/completep (model.args) each parameter's LR multiplier, decay and eps come from
    nn/parametrization.py, the hidden matrices in groups of their own (sp: the groups above). fused: the fused
    AdamW kernel (CUDA, and CPU since torch 2.4); pass False when the parameters live in CPU
    memory under CUDA offloading. group: the ranks that hold the same parameters, over which a
    Muon step is collective (None: every rank; under pipeline parallelism, the stage's).
    """
    named = list(model.named_parameters())
    args = getattr(model, "args", None)  # model.ModelArgs; a model without it trains under sp
    scaled = args is not None and args.parametrization != "sp"
    # Declared roles (nn/roles.py): this project's model must declare every parameter's; another model (a bare Linear,
    # or bench.py --src's model.py from before roles) declares none and trains with the defaults.
    declares = any(hasattr(type(m), "ROLES") for m in model.modules())
    role = roles(model, strict=args is not None and declares)
    # One group per kind, in the order parameters first appear: (decayed, Muon, a hidden matrix under mup/completep).
    # Kinds, not values, make the groups, so a resume with another weight decay finds the groups it saved.
    groups: dict[tuple, dict] = {}
    for name, p in named:
        r = role.get(name)
        muon = cfg.name == "muon" and is_muon_matrix(r)
        s = parametrization.optimizer_settings(args, r, muon, cfg.weight_decay if p.ndim >= 2 else 0.0, cfg.eps)
        key = (p.ndim >= 2, muon, scaled and r is not None and r.hidden)
        if key not in groups:
            groups[key] = {"params": [], "lr": cfg.lr * s["lr_mult"], "weight_decay": s["weight_decay"],
                           "eps": s["eps"], **({"muon": True} if muon else {})}
        groups[key]["params"].append(p)
    if cfg.name == "muon":
        optimizer = MuonAdamW(list(groups.values()), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              momentum=cfg.muon_momentum, fused=fused, group=group)
    else:
        optimizer = torch.optim.AdamW(list(groups.values()), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                      fused=fused or None)
    schedule = functools.partial(scheduled_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                                 batch_schedule=list(batch_schedule), min_ratio=cfg.min_lr_ratio, schedule=cfg.schedule, decay_fraction=cfg.decay_fraction,
                                 decay_shape=cfg.decay_shape)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
