#!/usr/bin/env bash
# Launch distnorm-train with torchrun: one node, or one call per node for several nodes.
#
#   launch/torchrun.sh CONFIG [section.key=value ...]
#
# Environment (defaults in brackets):
#   NPROC        processes on this node            [number of GPUs, or 1 without GPUs]
#   NNODES       nodes in the job                   [1]
#   NODE_RANK    this node's index (static mode)    [0]
#   MASTER_ADDR  rendezvous host (node 0)           [127.0.0.1]
#   MASTER_PORT  rendezvous port                    [29500]
#   RDZV         c10d (elastic rendezvous, any node may start first) or static  [c10d]
#   RDZV_ID      job id shared by all nodes (c10d)  [distnorm]
#   PYTHON       interpreter                        [python, or .venv/bin/python if present]
#
# Before starting any worker it checks the config, the engine, the data paths and that
# NPROC x NNODES divides the global batch (distnorm-train --check), so a bad config fails
# here, not after the queue wait.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi
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
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-c10d}

"$PYTHON" -m distnorm.train --config "$CONFIG" --check --world-size $((NPROC * NNODES)) "$@"

if [[ "$RDZV" == static ]]; then
  RENDEZVOUS=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
else
  RENDEZVOUS=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-distnorm}")
fi
# OMP_NUM_THREADS: torchrun would set 1 per process; keep it if the caller chose one.
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC" "${RENDEZVOUS[@]}" \
  -m distnorm.train --config "$CONFIG" "$@"
