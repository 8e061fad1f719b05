#!/usr/bin/env bash
# Multi-node training under SLURM: one torchrun per node, c10d rendezvous on the first node.
#   sbatch --nodes=4 scripts/slurm_train.sh train_fsdp.py configs/llama_125m.toml /shared/runs/125m
#   sbatch --nodes=2 scripts/slurm_train.sh train_2d.py configs/llama3_8b_2d.toml /shared/runs/8b
# The run directory must be on a filesystem that every node sees. Resubmitting the same job
# resumes from the newest complete checkpoint; SLURM's SIGTERM before a preemption or the time
# limit makes every rank finish its step, save and exit (--signal asks for it 120 s early).
#SBATCH --job-name=llama-pretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -euo pipefail
SCRIPT=${1:?usage: slurm_train.sh SCRIPT CONFIG RUN_DIR [--section.field value ...]}
CONFIG=${2:?config file}
RUN_DIR=${3:?run directory}
shift 3
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:29500" --rdzv-id="$SLURM_JOB_ID" \
    "$SCRIPT" --config "$CONFIG" --run_dir "$RUN_DIR" "$@"
