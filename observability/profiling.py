"""On-demand profiles of a few training steps: a torch profiler trace, and on CUDA a memory snapshot.

``train.profile_steps = "10-12"`` records steps 10 to 12 on rank 0 into RUN_DIR/profile/:
``trace_steps_10-12.json`` (Chrome trace format: open it in https://ui.perfetto.dev or
chrome://tracing) and, on CUDA, ``memory_steps_10-12.pickle`` (drag it into
https://pytorch.org/memory_viz). Other steps and ranks run unprofiled.
"""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

from core.errors import ConfigError
from storage.rundir import RunDir


def parse_steps(text: str) -> tuple[int, int] | None:
    """'10-12' -> (10, 12); '7' -> (7, 7); '' -> None. Raises ConfigError naming train.profile_steps."""
    if not text:
        return None
    first, dash, last = text.partition("-")
    try:
        # '1-' or '-3' is a range with a missing end: refuse it rather than read it as one step
        span = int(first), int(last if dash else first)
    except ValueError:
        span = None
    if span is None or not 1 <= span[0] <= span[1]:
        raise ConfigError(f"train.profile_steps must look like '10-12' or '7' (1-based steps, first <= last), "
                          f"got {text!r}")
    return span


class StepProfiler:
    """Profiles the steps of span (first, last) on this rank when enabled; call before_step/after_step around each."""

    def __init__(self, span: tuple[int, int] | None, run_dir: str, device: torch.device, enabled: bool):
        self.span = span if enabled else None
        self.dir = RunDir(run_dir).profile
        self.cuda = device.type == "cuda"
        self._prof = None

    def before_step(self, step: int) -> None:
        """step: the 1-based step about to run."""
        if self.span is None or step != self.span[0]:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.__enter__()
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def finishes(self, step: int, last: bool = False) -> bool:
        """Whether after_step(step, last) ends the profile and writes the trace (step: the 1-based step just run;
        last: no step follows it in this run, so a span that reaches past it ends there)."""
        return self._prof is not None and (step == self.span[1] or last)

    def after_step(self, step: int, last: bool = False) -> str | None:
        """Finish after the span's last step, or after the run's last step inside the span (last): a profiler left
        open at exit crashes the process. Returns the trace's path then, else None."""
        if not self.finishes(step, last):
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        tag = f"steps_{self.span[0]}-{step}"
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"trace_{tag}.json")
        prof.export_chrome_trace(trace)
        if self.cuda:
            torch.cuda.memory._dump_snapshot(os.path.join(self.dir, f"memory_{tag}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        return trace
