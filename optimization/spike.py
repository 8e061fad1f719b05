"""The spike guard (train.spike_skip): skip the update of a step whose loss or gradient norm is an outlier.

The rule is OLMo-core's SkipStepOptimizer's: a step is skipped when its loss or its gradient norm
exceeds the mean plus k standard deviations of the last N steps (OLMo-core: k = 6, N = 128), and
only once N steps are in the window. Every step with a finite norm joins the window, skipped or
not, so a lasting shift of the loss (a new data stage) is absorbed instead of skipped forever.
The windows live in checkpoint.TrainState, so a resumed run decides as the uninterrupted one did.
"""
from __future__ import annotations

import math


def outlier(window: list[float], value: float, sigmas: float, size: int) -> str:
    """'' if value is within mean + sigmas * std of window (or the window holds fewer than size values),
    else a short reason naming the bound. std is the sample standard deviation (n - 1)."""
    if len(window) < size:
        return ""
    mean = math.fsum(window) / len(window)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in window) / (len(window) - 1))
    bound = mean + sigmas * std
    return "" if value <= bound else f"{value:.4g} > {bound:.4g} (mean {mean:.4g} + {sigmas:g} sigma {std:.3g})"


def spike_reason(losses: list[float], grad_norms: list[float], loss: float, grad_norm: float, sigmas: float,
                 size: int) -> str:
    """Why the step of (loss, grad_norm) is a spike against the windows, or '' to keep it (see outlier)."""
    for name, window, value in (("loss", losses, loss), ("grad_norm", grad_norms, grad_norm)):
        why = outlier(window, value, sigmas, size)
        if why:
            return f"{name} spike: {why}"
    return ""


def push(window: list[float], value: float, size: int) -> None:
    """Append value to window in place, keeping its last size values."""
    window.append(value)
    del window[:-size]
