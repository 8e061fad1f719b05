"""What a person watching a run sees: a progress bar in a terminal, plain lines in a log file.

In a terminal (stderr is a TTY) tqdm draws one bar that updates in place. Without one (nohup,
SLURM's output file, a pipe) a bar would write carriage-return-joined updates into one huge
line, so each log interval becomes one plain line instead: step, loss, lr, tokens/s, MFU, ETA.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


def duration(seconds: float) -> str:
    """4000 -> '1h06m40s'; 75 -> '1m15s'."""
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Progress of `total` steps from `initial`, shown on one rank (enabled); bar or lines by stderr.isatty().

    step() after every step; log(record) after every logged one (a metrics.jsonl train
    record); write(text) for a message that must not break the bar.
    """

    def __init__(self, total: int, initial: int, enabled: bool, tty: bool | None = None):
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.bar = tqdm(total=total, initial=initial, disable=not (enabled and self.tty), dynamic_ncols=True)
        self._t0, self._first = time.perf_counter(), initial

    def step(self) -> None:
        self.bar.update(1)

    def rewind(self, step: int) -> None:
        """The run went back to step (a rollback): the bar shows it, the ETA counts from there."""
        self.bar.n = step
        self.bar.refresh()
        self._t0, self._first = time.perf_counter(), step

    def log(self, record: dict) -> None:
        """Show a train record: the bar's postfix, or one line with the ETA from the run's mean step time."""
        if not self.enabled:
            return
        if self.tty:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_sec']:.0f}", mfu=f"{record['mfu']:.1%}")
            return
        step = record["step"]
        per_step = (time.perf_counter() - self._t0) / max(1, step - self._first)
        print(f"step {step}/{self.total} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"{record['tokens_per_sec']:,.0f} tok/s | MFU {record['mfu']:.1%} | "
              f"ETA {duration(per_step * (self.total - step))}", flush=True)

    def write(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                self.bar.write(text)
            else:
                print(text, flush=True)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """prepare.py's progress on rank 0 while tokenizing: one line at most every INTERVAL_S seconds, and one at the end.

    Rank 0 sees only its own share; the ranks share the units evenly, so its ETA is the run's.
    """

    INTERVAL_S = 10.0

    def __init__(self, enabled: bool, n_units: int, rank: int, world: int, name: str = ""):
        self.enabled, self.world, self.name = enabled, world, name
        self.mine = len(range(rank, n_units, world))
        self.units = self.docs = self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        if enabled:
            print(f"[data] tokenizing {n_units} work unit(s) of '{name}' on {world} rank(s)", flush=True)

    def unit_done(self, n_tokens: int, n_docs: int) -> None:
        self.units, self.docs, self.tokens = self.units + 1, self.docs + n_docs, self.tokens + n_tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.INTERVAL_S or self.units == self.mine):
            self.last, elapsed = now, now - self.t0
            eta = elapsed / self.units * max(0, self.mine - self.units)
            print(f"[data] rank 0: {self.units}/{self.mine} units, {self.docs:,} documents, {self.tokens:,} tokens, "
                  f"{self.tokens / max(elapsed, 1e-9):,.0f} tokens/s, {'ETA ' + duration(eta) if eta else 'done'}",
                  flush=True)
