"""Throughput, MFU, memory and the metrics.jsonl log of a run."""
from __future__ import annotations

import json
import os
import resource
import time

import torch

# Dense bf16 peak per device, TFLOP/s, from the vendors' data sheets (SXM, without sparsity).
GPU_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def measured_cpu_peak_flops(n: int = 2048, seconds: float = 0.3) -> float:
    """Dense fp32 matmul rate of this process, FLOP/s: the CPU's MFU denominator.

    Times repeated n x n x n fp32 matmuls (2 n^3 FLOPs each) with the process's current
    torch thread count for about `seconds` (at least one timed matmul after a warm-up one), and
    returns the best rate seen. n: matrix size (2048, as in the benchmark).
    """
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best, t_end = 0.0, time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device: bf16 data-sheet peak on a known GPU, measured fp32 GEMM on CPU.

    An unknown GPU falls back to the H100 figure; the name is what torch reports.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_BF16_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return GPU_BF16_PEAK_TFLOPS["H100"] * 1e12
    return measured_cpu_peak_flops()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank in GiB: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # ru_maxrss is KiB on Linux


class MetricsLog:
    """Appends one JSON object per record to <run_dir>/metrics.jsonl (rank 0 only writes)."""

    def __init__(self, run_dir: str, enabled: bool):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
