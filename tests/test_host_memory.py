"""A CPU rank keeps the blocks a step frees (core/host_memory.py): its later steps take no fresh pages.

The reference is the same steps in a process that did not join as a CPU rank (glibc's defaults): every step maps
its activations afresh, one minor page fault per 4 KiB page touched.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from project import ROOT

STEPS = """
import resource, sys, torch
from parallel import distributed
if sys.argv[1] == "rank":
    distributed.init_distributed("cpu")
torch.set_num_threads(1)
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256))
x = torch.randn(8192, 256)  # activations of 32 MiB: above glibc's largest default mmap threshold

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

for _ in range(3):  # the heap reaches the step's peak
    mlp(x).square().mean().backward()
per_step = []
for _ in range(9):
    before = faults()
    mlp(x).square().mean().backward()
    per_step.append(faults() - before)
print(sorted(per_step)[4])  # the median: a step now and then also pays for another thread's pages (gloo's)
"""


def faults_per_step(mode: str) -> int:
    """The median minor page faults of a step (9 steps after 3), in a fresh process: 'plain' or a CPU 'rank'."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("MASTER_PORT", None)
    out = subprocess.run([sys.executable, "-c", STEPS, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
def test_a_cpu_rank_takes_no_fresh_pages_after_its_first_steps():
    plain = faults_per_step("plain")
    if plain < 5_000:  # transparent huge pages always on (or glibc asked for them): few faults to remove
        pytest.skip(f"glibc's defaults took only {plain} page faults a step here: nothing to measure")
    rank = faults_per_step("rank")
    assert rank < 100, f"a CPU rank took {rank} page faults a step (the plain process {plain})"
