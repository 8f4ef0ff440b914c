#!/usr/bin/env bash
# Launch distnorm-train with torchrun: one node, or one call per node for several nodes.
#
#   launch/torchrun.sh CONFIG [section.key=value ...]
#
# Environment (defaults in brackets):
#   NPROC        processes on this node            [number of GPUs, or 1 without GPUs]
#   NNODES       nodes in the job                   [1]
#   NODE_RANK    this node's index (static mode)    [0]
#   MASTER_ADDR  rendezvous host (the head node's name or address)
#                [required when NNODES > 1; one node: a private rendezvous on a free port]
#   MASTER_PORT  rendezvous port                    [from the job id, see below]
#   RDZV         c10d (elastic rendezvous, any node may start first) or static  [c10d]
#   RDZV_ID      job id shared by all nodes (c10d)  [SLURM_JOB_ID, else derived from
#                MASTER_ADDR, MASTER_PORT and the config]
#   PYTHON       interpreter                        [python, or .venv/bin/python if present]
#
# Two jobs on one host never share a rendezvous: one node uses torchrun --standalone (a
# free port, a fresh id); several nodes default the port to 20000 + SLURM_JOB_ID % 20000
# under Slurm (29500 elsewhere: set MASTER_PORT when two multi-node jobs share a head node).
#
# Before starting any worker it checks the config, the engine, the data paths, the shard
# sizes against their index and that NPROC x NNODES divides the global batch
# (distnorm-train --check), so a bad config fails here, not after the queue wait.
#
# Ctrl-C: torchrun forwards SIGINT to every process; rank 0 prints one line (the last
# checkpoint, and this command to resume from it) and the launcher exits with 130, without
# tracebacks. A failed worker: torchrun's failure summary (which rank, exit code, and the
# root cause distnorm-train recorded), without the launcher's own traceback.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi
# This command as typed, with the variables above that were set: what the Ctrl-C line gives
# as the command that resumes the run (unless a wrapper around this script set its own).
LAUNCH_COMMAND=""
for var in NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT RDZV RDZV_ID; do
  if [[ -n "${!var:-}" ]]; then LAUNCH_COMMAND+="$var=$(printf '%q' "${!var}") "; fi
done
LAUNCH_COMMAND+=$(printf '%q ' "$0" "$@")
export DISTNORM_LAUNCH_COMMAND="${DISTNORM_LAUNCH_COMMAND:-${LAUNCH_COMMAND% }}"
CONFIG=$1
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python; fi
fi
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV=${RDZV:-c10d}
if [[ "$NNODES" -gt 1 && -z "${MASTER_ADDR:-}" ]]; then
  echo "launch/torchrun.sh: NNODES=$NNODES needs MASTER_ADDR (the head node's host name or address," >&2
  echo "the same on every node); without it each node would wait for itself on 127.0.0.1" >&2
  exit 2
fi
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  DEFAULT_PORT=$((20000 + SLURM_JOB_ID % 20000))
else
  DEFAULT_PORT=29500
fi
MASTER_PORT=${MASTER_PORT:-$DEFAULT_PORT}

"$PYTHON" -m distnorm.train --config "$CONFIG" --check --world-size $((NPROC * NNODES)) "$@"

if [[ "$NNODES" -eq 1 && -z "${MASTER_ADDR:-}" ]]; then
  RENDEZVOUS=(--standalone)  # a free port and a fresh rendezvous id: no collision on this host
elif [[ "$RDZV" == static ]]; then
  RENDEZVOUS=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
else
  if [[ -z "${RDZV_ID:-}" ]]; then
    RDZV_ID=${SLURM_JOB_ID:-distnorm-$(printf '%s' "$MASTER_ADDR:$MASTER_PORT:$CONFIG" | cksum | cut -d' ' -f1)}
  fi
  RENDEZVOUS=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$RDZV_ID")
fi
# OMP_NUM_THREADS: torchrun would set 1 per process; keep it if the caller chose one.
# torchrun (torch.distributed.run's main, these arguments), ending without the Python
# traceback of its own that follows a failed worker or a signal (distnorm/train/torchrun.py).
exec "$PYTHON" -c 'from distnorm.train.torchrun import main; main()' -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC" "${RENDEZVOUS[@]}" \
  -m distnorm.train --config "$CONFIG" "$@"
