"""AdamW with decay on matrices only, and the linear-warmup + cosine LR schedule."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from errors import ConfigError


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """Final LR of the cosine decay, as a fraction of lr."""
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
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        for name in ("weight_decay", "grad_clip", "min_lr_ratio"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ConfigError(f"optim.{name} must be >= 0, got {getattr(self, name)}")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for the optimizer step that follows `step` completed steps.

    Linear warmup: (step + 1) / warmup_steps for the first warmup_steps steps; then cosine
    decay from 1 to min_ratio over the remaining steps (Loshchilov & Hutter, SGDR, 2017).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int, fused: bool = True):
    """(AdamW, LambdaLR) for model: decay on matrices (ndim >= 2) only, warmup + cosine to total_steps.

    fused: the fused AdamW kernel (CUDA, and CPU since torch 2.4); pass False when the
    parameters live in CPU memory under CUDA offloading.
    """
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  fused=fused or None)
    schedule = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                                 min_ratio=cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
