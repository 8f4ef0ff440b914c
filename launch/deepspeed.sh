#!/usr/bin/env bash
# Launch distnorm-train with the DeepSpeed launcher (its hostfile lists nodes and GPU slots).
#
#   launch/deepspeed.sh CONFIG [section.key=value ...]
#   HOSTFILE=launch/hostfile.example launch/deepspeed.sh configs/imagenet/resnet50_cbn_deepspeed.yaml
#
# Environment: HOSTFILE (multi-node; without it, this node only), NUM_GPUS (per node,
# default: all), MASTER_ADDR / MASTER_PORT, PYTHON. The config must select
# train.engine=deepspeed and a train.deepspeed_config JSON (configs/deepspeed/).
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
CONFIG=$1
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
ARGS=()
if [[ -n "${HOSTFILE:-}" ]]; then
  ARGS+=(--hostfile "$HOSTFILE")
  WORLD=$(awk '/slots=/{split($2, s, "="); n += s[2]} END {print n}' "$HOSTFILE")
else
  WORLD=${NUM_GPUS:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
fi
[[ -n "${NUM_GPUS:-}" ]] && ARGS+=(--num_gpus "$NUM_GPUS")
[[ -n "${MASTER_ADDR:-}" ]] && ARGS+=(--master_addr "$MASTER_ADDR")
[[ -n "${MASTER_PORT:-}" ]] && ARGS+=(--master_port "$MASTER_PORT")

"$PYTHON" -m distnorm.train --config "$CONFIG" --check --world-size "$WORLD" "$@"
exec deepspeed "${ARGS[@]}" --module distnorm.train --config "$CONFIG" "$@"
