"""parallel: how a model is spread over ranks, applied from outside the model in one place.

distributed.py (the process group, devices, signals), parallelize.py (the mesh, TP plan, activation checkpointing,
compile, FSDP2, initialisation), context_parallel.py (Ulysses), expert_parallel.py (MoE experts over ranks,
all-to-all), pipeline.py (stages, schedules), composition.py (what composes with what: one table), compose.py (the MoE and
pipeline checks that are not pairs), memory.py (whether a run can fit at all), float8.py (torchao's float8 Linear
layers, swapped in by parallelize.py).

Layer 3: imports core/, model.py, nn/ and storage/.
"""
