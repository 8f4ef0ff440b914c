#!/usr/bin/env bash
# Launch distnorm-train with the DeepSpeed launcher (its hostfile lists nodes and GPU slots).
#
#   launch/deepspeed.sh CONFIG [section.key=value ...]
#   HOSTFILE=launch/hostfile.example launch/deepspeed.sh configs/imagenet/resnet50_cbn_deepspeed.yaml
#
# Environment: HOSTFILE (a DeepSpeed hostfile; unset: /job/hostfile if it exists, as for the
# runner, else this node only; one host in it runs like this node only, several go over
# ssh/pdsh), NUM_GPUS (per node, default: all, or the hostfile's slots; on CPU with
# DS_ACCELERATOR=cpu: the number of processes), MASTER_ADDR / MASTER_PORT, PYTHON. The config
# must select train.engine=deepspeed and a train.deepspeed_config JSON (configs/deepspeed/).
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
# Which hosts the runner will use, as DeepSpeed 0.19.8 decides (deepspeed/launcher/runner.py):
# --hostfile defaults to /job/hostfile (l.35, l.54) and a missing file means this node only
# (fetch_hostfile, l.212-222); a hostfile is parsed by _parse_hostfile (l.225-254): lines
# stripped, blank and '#' lines skipped, every other line must start "HOST slots=N", a host
# listed twice or no host at all is an error. --num_gpus gives every host N slots (l.521,
# apply_num_nodes_and_gpus). This wrapper passes no --include / --exclude / --num_nodes /
# --force_multi / --no_ssh, so the hosts are the hostfile's entries. A missing HOSTFILE is
# refused here rather than run on this node only.
if [[ -z "${HOSTFILE:-}" && -f /job/hostfile ]]; then HOSTFILE=/job/hostfile; fi
hostfile_hosts_and_slots() {  # prints "HOSTS SLOTS" for the hostfile $1, or fails naming the line
  awk '
    { line = $0; gsub(/^[[:space:]]+|[[:space:]]+$/, "", line) }
    line == "" || line ~ /^#/ { next }
    line ~ /^[^[:space:]]+[[:space:]]+slots=[0-9]/ {
      host = line; sub(/[[:space:]].*/, "", host)
      slots = line; sub(/^[^[:space:]]+[[:space:]]+slots=/, "", slots); sub(/[^0-9].*/, "", slots)
      if (host in seen) { printf "host %s is listed twice\n", host > "/dev/stderr"; bad = 1; exit }
      seen[host] = 1; hosts++; total += slots; next
    }
    { printf "line \"%s\" is not \"HOST slots=N\"\n", line > "/dev/stderr"; bad = 1; exit }
    END { if (bad) exit 1; if (!hosts) { print "it lists no host" > "/dev/stderr"; exit 1 }; print hosts, total }
  ' "$1"
}
ARGS=()
HOSTS=1
if [[ -n "${HOSTFILE:-}" ]]; then
  if [[ ! -f "$HOSTFILE" ]]; then
    echo "launch/deepspeed.sh: HOSTFILE=$HOSTFILE does not exist (the DeepSpeed runner would run on this node only)" >&2
    exit 2
  fi
  if ! COUNTS=$(hostfile_hosts_and_slots "$HOSTFILE" 2>&1); then
    echo "launch/deepspeed.sh: HOSTFILE=$HOSTFILE: $COUNTS (the DeepSpeed runner refuses it too)" >&2
    exit 2
  fi
  read -r HOSTS SLOTS <<<"$COUNTS"
  ARGS+=(--hostfile "$HOSTFILE")
  if [[ -n "${NUM_GPUS:-}" ]]; then WORLD=$((HOSTS * NUM_GPUS)); else WORLD=$SLOTS; fi
else
  WORLD=${NUM_GPUS:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
fi
[[ -n "${NUM_GPUS:-}" ]] && ARGS+=(--num_gpus "$NUM_GPUS")
[[ -n "${MASTER_ADDR:-}" ]] && ARGS+=(--master_addr "$MASTER_ADDR")
[[ -n "${MASTER_PORT:-}" ]] && ARGS+=(--master_port "$MASTER_PORT")

"$PYTHON" -m distnorm.train --config "$CONFIG" --check --world-size "$WORLD" "$@"

# Several hosts: the runner starts the workers through pdsh (runner.py l.537: multi-node
# exactly when more than one host remains; pdsh is its default launcher), which hands the
# command line to each host's shell: data.train_shards=...-{000000..000005}.tar would be
# brace-expanded there into six arguments. DeepSpeed wraps only arguments with a space in
# double quotes (multinode_runner.py l.79), so escape every other argument for that shell and
# refuse what cannot pass through double quotes unchanged. One host (a one-line hostfile
# included): the runner starts the local launcher with the arguments as they are (no shell),
# and an escaped argument would reach the workers with its backslashes.
WORKER_ARGS=(--config "$CONFIG" "$@")
if [[ "$HOSTS" -gt 1 ]]; then
  ESCAPED=()
  for arg in "${WORKER_ARGS[@]}"; do
    if [[ "$arg" == *" "* ]]; then
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
