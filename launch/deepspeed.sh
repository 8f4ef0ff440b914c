#!/usr/bin/env bash
# Launch distnorm-train with the DeepSpeed launcher (its hostfile lists nodes and GPU slots).
#
#   launch/deepspeed.sh CONFIG [section.key=value ...]
#   HOSTFILE=launch/hostfile.example launch/deepspeed.sh configs/imagenet/resnet50_cbn_deepspeed.yaml
#
# Environment: HOSTFILE (multi-node; without it, this node only), NUM_GPUS (per node,
# default: all; on CPU with DS_ACCELERATOR=cpu: the number of processes), MASTER_ADDR /
# MASTER_PORT, PYTHON. The config must select
# train.engine=deepspeed and a train.deepspeed_config JSON (configs/deepspeed/).
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
CONFIG=$1
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python; fi
fi
# The runner installed beside that interpreter (a venv not on PATH still works).
DEEPSPEED=$(dirname "$(command -v "$PYTHON")")/deepspeed
[[ -x "$DEEPSPEED" ]] || DEEPSPEED=deepspeed
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

# With a hostfile the runner starts the workers through pdsh, which hands the command line to
# each host's shell: data.train_shards=...-{000000..000005}.tar would be brace-expanded there
# into six arguments (DeepSpeed quotes only arguments with spaces, in double quotes). Escape
# every argument for that shell; refuse what cannot pass through double quotes unchanged.
WORKER_ARGS=(--config "$CONFIG" "$@")
if [[ -n "${HOSTFILE:-}" ]]; then
  ESCAPED=()
  for arg in "${WORKER_ARGS[@]}"; do
    if [[ "$arg" =~ [[:space:]] ]]; then
      if [[ "$arg" == *[\$\`\\]* ]]; then
        echo "launch/deepspeed.sh: the argument '$arg' has spaces and one of \$ \` \\, which the runner's remote shell would change; put that value in the YAML config" >&2
        exit 2
      fi
      ESCAPED+=("$arg")  # the runner wraps it in double quotes
    else
      ESCAPED+=("$(printf '%q' "$arg")")
    fi
  done
  WORKER_ARGS=("${ESCAPED[@]}")
fi
# Workers get --local_rank=N from the runner; distnorm-train accepts it (LOCAL_RANK wins).
exec "$DEEPSPEED" "${ARGS[@]}" --module distnorm.train "${WORKER_ARGS[@]}"
