"""observability: what a run tells its user: metrics.jsonl, TensorBoard and W&B (metrics.py, wandblog.py), the progress bar (progress.py) and profiles (profiling.py).

Layer 4: imports core/ and storage/ (and parallel/ for the device's peak FLOP/s).
"""
