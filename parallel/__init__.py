"""parallel: how a model is spread over ranks, applied from outside the model in one place.

distributed.py (the process group, devices, signals), layout.py (the layout: every rank's groups by role, the size
checks, the only place that builds the device mesh), parallelize.py (TP plan, activation checkpointing, compile,
FSDP2, initialisation), runner.py (what the step, validation and scoring ask of the model, at pp 1 or as a
pipeline), hooks.py (a model feature's part in the step: MoE's counts and bias, float8's scales), context_parallel.py (Ulysses), expert_parallel.py (MoE experts over ranks,
all-to-all), pipeline.py (stages, schedules), composition.py (what composes with what: one table), compose.py (the MoE and
pipeline checks that are not pairs), memory.py (whether a run can fit at all), float8.py (torchao's float8 Linear
layers, swapped in by parallelize.py).

Layer 3: imports core/, model.py, nn/ and storage/.
"""
