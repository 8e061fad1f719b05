"""The plan's figure beside the run's own: rank 0 runs plan.py for this very command while the run builds, and the
start line prints the planned peak next to which the train records' `peak_bytes_max` can be read.

plan.py runs as a process of its own (it builds fake process groups, which a process already in a real one cannot),
on the same command line, world size and ranks per node, for this device's kind ('cpu', or 'h100' for any CUDA GPU:
the peak it plans depends on the dtype, not on the GPU). It is started only when the run records its peak (CUDA, or
train.track_memory on CPU), and costs rank 0 one dry run: seconds for the presets (docs/planning.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

PLAN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan.py")
WAIT_S = 120
"""The longest the start line waits for plan.py (docs/planning.md's slowest dry run, 405B at 2,048 ranks, took 53 s),
and at most a quarter of train.collective_timeout_s: the other ranks wait in the first step's collectives meanwhile."""
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT")
"""torchrun's variables, which plan.py must not take for its own (it plans every rank from one process)."""


class PlannedPeak:
    """plan.py started on argv (the training command's arguments) for world_size ranks, local_world per node;
    describe() waits for it and says its peak."""

    def __init__(self, argv: list[str], world_size: int, local_world: int, device_type: str,
                 collective_timeout_s: float):
        self.wait_s = min(WAIT_S, collective_timeout_s / 4)
        fd, self.json_path = tempfile.mkstemp(prefix="plan-", suffix=".json")
        os.close(fd)
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
        cmd = [sys.executable, PLAN, *argv, "--world_size", str(world_size), "--gpus_per_node", str(local_world),
               "--gpu", "cpu" if device_type == "cpu" else "h100", "--json", self.json_path]
        self.err = tempfile.TemporaryFile(mode="w+")  # not a pipe: plan.py's warnings must not fill it and stall it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, text=True, env=env)

    def describe(self) -> str:
        """' | peak planned 1.23 GiB (1,320,702,443 bytes, ...)' for the start line, or ' | peak not planned:
        why' when plan.py failed or took over wait_s seconds. Never raises: the run does not depend on its plan."""
        try:
            self.proc.wait(timeout=self.wait_s)
        except subprocess.TimeoutExpired:
            self.close()
            return f" | peak not planned: plan.py took over {self.wait_s:g} s (run it on its own: docs/planning.md)"
        try:
            if self.proc.returncode != 0:
                self.err.seek(0)
                lines = self.err.read().strip().splitlines()
                return f" | peak not planned: plan.py exited {self.proc.returncode}" + (f": {lines[-1]}" if lines else "")
            with open(self.json_path) as f:
                peak = max(r["peak_bytes"] for r in json.load(f)["ranks"])
        except (OSError, ValueError, KeyError) as e:
            return f" | peak not planned: plan.py's JSON unread ({e})"
        finally:
            self.close()
        amount = f"{peak / 2 ** 30:.2f} GiB" if peak >= 2 ** 30 else f"{peak / 2 ** 20:.1f} MiB"
        return f" | peak planned {amount} ({peak:,} bytes, plan.py's largest rank; the run's is the records' peak_bytes_max)"

    def close(self) -> None:
        """Stop plan.py if it still runs and remove its JSON."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.err.close()
        try:
            os.remove(self.json_path)
        except OSError:
            pass
