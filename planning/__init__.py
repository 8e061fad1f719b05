"""planning: know before launch what a run will do: the trainer's own step dry-run at the real world size on fake
tensors and a fake process group (dryrun.py), the GPUs' figures (gpus.py), the step-time model (estimate.py), the
layouts to try (search.py); plan.py is its command.

Layer 11: imports everything below it, the entry scripts' TP plan too; nothing imports it but plan.py.
"""
