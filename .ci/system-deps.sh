#!/usr/bin/env bash
# The Debian packages the tests and the launchers use, installed where they are missing.
# `make test` and `make test-cluster` run this first (`make system-deps`); it is quiet when
# everything is present, so it costs a few `command -v` per run ("once per machine").
#
#   command      package           what needs it
#   sbatch ...   slurm-wlm         launch/slurm.sbatch tests, the Slurm cluster tests
#   munged       munge             Slurm's authentication
#   sshd         openssh-server    the DeepSpeed runner over ssh (simulated hosts)
#   ssh          openssh-client    "
#   pdsh         pdsh              "  (the DeepSpeed runner's remote shell)
#   ip, tc       iproute2          simulated hosts (network namespaces, bandwidth limits)
#   unshare      util-linux        "
#
# Root installs them with apt-get. Anyone else gets the command to run, and the tests that
# need a missing tool skip naming it. What was checked is written to $STATUS; a test whose
# tool is missing although this script reported it installed fails instead of skipping.
set -euo pipefail
STATUS=${DISTNORM_SYSTEM_DEPS_STATUS:-${1:-.venv/.system-deps}}

declare -A PACKAGE=(
  [sbatch]=slurm-wlm [slurmctld]=slurm-wlm [slurmd]=slurm-wlm [munged]=munge
  [sshd]=openssh-server [ssh]=openssh-client [pdsh]=pdsh
  [ip]=iproute2 [tc]=iproute2 [unshare]=util-linux
)

found() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]]; }

missing=()
for tool in "${!PACKAGE[@]}"; do
  found "$tool" || missing+=("${PACKAGE[$tool]}")
done
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u | sed '/^$/d')

if (( ${#missing[@]} )); then
  if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "system-deps: installing ${missing[*]} (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # Debian starts no daemons in containers; the tests start what they need themselves.
  else
    echo "system-deps: missing ${missing[*]}; as root: apt-get install ${missing[*]}" \
         "(the tests that need them are skipped)" >&2
  fi
fi

mkdir -p "$(dirname "$STATUS")"
{
  echo "# written by .ci/system-deps.sh: tool=installed|missing"
  for tool in $(printf '%s\n' "${!PACKAGE[@]}" | sort); do
    if found "$tool"; then echo "$tool=installed"; else echo "$tool=missing"; fi
  done
} > "$STATUS"
