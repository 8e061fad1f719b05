#!/usr/bin/env bash
# Multi-node training under SLURM: one torchrun agent per node, c10d rendezvous on the first node.
#   sbatch --nodes=4 scripts/slurm_train.sh train_fsdp.py configs/llama_125m.toml /shared/runs/125m --parallel.dp_replicate 4
#   sbatch --nodes=2 scripts/slurm_train.sh train_2d.py configs/llama3_8b_2d.toml /shared/runs/8b
#   scripts/slurm_train.sh --dry-run SCRIPT CONFIG RUN_DIR [...]   prints the command instead of running it
# The run directory must be on a filesystem that every node sees. torchrun restarts the whole
# group up to MAX_RESTARTS times when a rank dies or hangs (train.collective_timeout_s), and the
# trainer resumes from the newest complete checkpoint by itself; so does resubmitting the job.
# SLURM's SIGTERM before a preemption or the time limit makes every rank finish its step, save
# and exit (--signal asks for it 120 s early); the script then exits 0 (130 after Ctrl-C), and
# with torchrun's status otherwise.
# Environment: NPROC_PER_NODE (default: SLURM_GPUS_ON_NODE, else 8), RDZV_PORT (29500),
# MAX_RESTARTS (3), HEAD_NODE (default: the first host of SLURM_JOB_NODELIST).
#SBATCH --job-name=llama-pretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -euo pipefail
USAGE="usage: slurm_train.sh [--dry-run] SCRIPT CONFIG RUN_DIR [--section.field value ...]"
DRY_RUN=0
fail() { echo "error: $*" >&2; exit 2; }  # bad input: one line, status 2, nothing touched
case "${1:-}" in
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; echo "$USAGE"; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -*) fail "unknown option '$1'; $USAGE" ;;
esac
[[ $# -ge 3 ]] || fail "$USAGE"
SCRIPT=$1
CONFIG=$2
RUN_DIR=$3
shift 3
[[ -f $SCRIPT ]] || fail "SCRIPT '$SCRIPT' not found; give train_fsdp.py or train_2d.py (paths are from $(pwd))"
[[ -f $CONFIG ]] || fail "CONFIG '$CONFIG' not found; give a TOML file such as configs/llama_125m.toml"
for arg in "$@"; do
    [[ $arg != --dry-run ]] || fail "--dry-run goes first: slurm_train.sh --dry-run SCRIPT CONFIG RUN_DIR ..."
done
# Outside an allocation (e.g. --dry-run on a laptop) set these yourself.
[[ -n ${SLURM_NNODES:-} ]] || fail "SLURM_NNODES is not set: run under sbatch/salloc, or set SLURM_NNODES (and SLURM_JOB_ID, HEAD_NODE)"
[[ -n ${SLURM_JOB_ID:-} ]] || fail "SLURM_JOB_ID is not set: run under sbatch/salloc, or set it (any id shared by the nodes)"
if [[ -z "${HEAD_NODE:-}" ]]; then
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || fail "SLURM_JOB_NODELIST is not set: run under sbatch/salloc, or set HEAD_NODE to the address of the first node"
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
# --rdzv-backend c10d: the agents meet on HEAD_NODE and number the nodes themselves, so every
# node runs this same line (no --node_rank); each worker gets RANK, LOCAL_RANK and LOCAL_WORLD_SIZE.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: every restart gets a new store, so no restarted worker reads a
# dead one's address (the agents count restarts each for itself; pytorch/pytorch#135712).
CMD=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun
    --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE"
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:${RDZV_PORT:-29500}" --rdzv-id="$SLURM_JOB_ID"
    --max-restarts="${MAX_RESTARTS:-3}"
    "$SCRIPT" --config "$CONFIG" --run_dir "$RUN_DIR" "$@")
if [[ $DRY_RUN == 1 ]]; then
    printf '%q ' srun --kill-on-bad-exit=1 "${CMD[@]}"
    echo
    exit 0
fi
# torchrun exits 1 after it forwarded a SIGTERM or SIGINT to its workers, even when they finished
# the step and saved. The trainer writes how it ended to RUN_DIR/exit.json; exit with its status
# (0 after SIGTERM, 130 after Ctrl-C), so a requeue script can tell a clean stop from a crash.
# The traps only defer a signal to this script until srun returns (a trapped signal, unlike an
# ignored one, is not inherited by srun).
trap ':' TERM INT
EXIT_RECORD="$RUN_DIR/exit.json"
rm -f "$EXIT_RECORD"
rc=0
srun --kill-on-bad-exit=1 "${CMD[@]}" || rc=$?
if [[ $rc != 0 && -f "$EXIT_RECORD" ]]; then
    rc=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_status"])' "$EXIT_RECORD")
fi
exit "$rc"
