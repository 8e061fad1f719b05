"""The accelerators a plan is for: peak FLOP/s, memory, and the links a collective crosses, each with its source.

Figures are per device, dense (no sparsity), from the vendors' data sheets; link bandwidths
are per device and per direction (what a ring collective's step moves at). The `cpu` entry is
this project's 2-core test machine, one gloo rank per core, measured here (the command is in
its source line), so a plan of a CPU run can be checked against a real one.
"""
from __future__ import annotations

import dataclasses

from core.errors import ConfigError
from parallel.memory import host_memory

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class GPU:
    """One device kind's figures."""

    name: str
    bf16_flops: float
    """Dense bf16 peak, FLOP/s (fp32 on the cpu entry: its measured GEMM rate)."""
    fp8_flops: float
    """Dense fp8 peak, FLOP/s (0: no float8 matmuls)."""
    memory: int
    """Device memory, bytes (what the driver reports; the cpu entry: the machine's, which its ranks share)."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s (the optimizer step is bound by it)."""
    intra_node: float
    """Bandwidth to another device of the same node, bytes/s per direction (NVLink, Infinity Fabric, gloo on loopback)."""
    inter_node: float
    """Network bandwidth per device to another node, bytes/s per direction (one NIC per GPU)."""
    efficiency: float
    """The fraction of the peak a training step's matmuls reach (calibrated: see docs/planning.md)."""
    source: str
    op_overhead_s: float = 0.0
    """The host's time per operator dispatched, seconds: eager PyTorch's Python and dispatcher work (0 on a GPU,
    where the launches run ahead of the device's work)."""
    dtensor_op_overhead_s: float = 0.0
    """The host's extra time per operator on DTensors (sharding propagation, redistribution), seconds (0 on a GPU,
    as op_overhead_s)."""
    collective_latency_s: float = 20e-6
    """Each collective call's fixed cost, seconds (NCCL's small-message latency; gloo's on the cpu entry)."""
    cores: int = 0
    """The cpu entry: the cores its ranks share (more ranks than cores on a node time-share them); 0 for a GPU,
    which each rank has to itself."""


GPUS = {g.name: g for g in (
    GPU("h100", 989e12, 1979e12, 81_559 * 2 ** 20, 3.35e12, 450e9, 50e9, 0.55,
        "NVIDIA H100 SXM5 data sheet: 989 TFLOP/s bf16, 1,979 fp8, 80 GB HBM3 (81,559 MiB as the driver reports it) at 3.35 TB/s, NVLink 4 900 GB/s "
        "(450 each way), ConnectX-7 400 Gb/s per GPU; efficiency from the H200 run (same SM): benchmarks/results/"
        "h200_2026-12-04_gpu_check.md, 50.6% MFU compiled"),
    GPU("h200", 989e12, 1979e12, 143_771 * 2 ** 20, 4.8e12, 450e9, 50e9, 0.55,
        "NVIDIA H200 SXM data sheet: 989 TFLOP/s bf16, 1,979 fp8, 141 GB HBM3e (143,771 MiB as the driver reports it) at 4.8 TB/s, NVLink 4 (450 GB/s each "
        "way), 400 Gb/s per GPU; efficiency: benchmarks/results/h200_2026-12-04_gpu_check.md"),
    GPU("b200", 2250e12, 4500e12, 180 * 10 ** 9, 8e12, 900e9, 50e9, 0.55,
        "NVIDIA DGX B200 data sheet: 2.25 PFLOP/s bf16, 4.5 fp8 dense per GPU, 180 GB HBM3e at 8 TB/s, NVLink 5 "
        "1.8 TB/s (900 each way), 400 Gb/s per GPU; efficiency assumed as Hopper's (not measured)"),
    GPU("a100", 312e12, 0.0, 80 * GIB, 2.04e12, 300e9, 25e9, 0.55,
        "NVIDIA A100 SXM4 80GB data sheet: 312 TFLOP/s bf16, no fp8, 80 GB HBM2e at 2.04 TB/s, NVLink 3 600 GB/s "
        "(300 each way), HDR 200 Gb/s per GPU; efficiency assumed as Hopper's"),
    GPU("mi300x", 1307e12, 2615e12, 192 * 10 ** 9, 5.3e12, 448e9, 50e9, 0.45,
        "AMD Instinct MI300X data sheet: 1,307 TFLOP/s bf16, 2,615 fp8 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity "
        "Fabric links of 64 GB/s each way, 400 Gb/s per GPU; efficiency lower than Hopper's (assumed)"),
    GPU("cpu", 1.89e11, 0.0, host_memory(), 20e9, 0.30e9, 0.30e9, 0.72,
        "this project's 2-core machine, one thread per gloo rank (torchrun's OMP_NUM_THREADS=1), with the memory of "
        "the machine that plans (parallel.memory.host_memory: a 16 GB laptop must not be told a run fits in 24), "
        "shared by its ranks: fp32 GEMM 189 GFLOP/s (observability.metrics.measured_cpu_peak_flops on 1 thread), gloo "
        "all-gather 0.30 GB/s received (torchrun --nproc_per_node 2, 4 and 32 MiB per rank); the efficiency and "
        "the time per operator fitted to two 1-rank runs (the debug model and dim 512 x 8 layers: "
        "benchmarks/plan_bench.py, docs/planning.md); the time per DTensor operator fitted to a 2-rank tp 2 run",
        op_overhead_s=29e-6, dtensor_op_overhead_s=81e-6, collective_latency_s=100e-6, cores=2),
)}


def rank_memory(gpu: GPU, gpus_per_node: int) -> int:
    """The bytes one rank has: its GPU's memory, or on the cpu entry the machine's over the ranks it runs."""
    return gpu.memory // gpus_per_node if gpu.cores else gpu.memory


def gpu_named(name: str) -> GPU:
    """The GPUS entry called name (case-insensitive); ConfigError naming the choices for another."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"--gpu {name!r} is not a GPU the planner knows; choose one of "
                          f"{', '.join(GPUS)}") from None
