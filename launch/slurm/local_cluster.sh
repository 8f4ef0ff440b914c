#!/usr/bin/env bash
# A one-host Slurm cluster for trying launch/slurm.sbatch (and its tests) without a real one:
# munge + slurmctld + slurmd from Debian's slurm-wlm, everything on this machine.
#
#   sudo launch/slurm/local_cluster.sh start     # install if needed, write configs, start
#   sudo launch/slurm/local_cluster.sh stop
#
# Root is needed (packages, daemons, /etc/slurm). The node advertises this machine's CPUs
# and memory and no GPUs; state lives in /var/spool/slurm-distnorm. Tested by
# tests/test_launchers.py::test_slurm_sbatch_runs_and_requeues (skipped without root).
set -euo pipefail
ACTION=${1:-start}
STATE=/var/spool/slurm-distnorm
HOST=$(hostname -s)

stop() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  for _ in $(seq 50); do pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break; sleep 0.1; done
}

if [[ "$ACTION" == stop ]]; then stop; exit 0; fi
if [[ $EUID -ne 0 ]]; then echo "local_cluster.sh: run as root" >&2; exit 2; fi
if ! command -v slurmctld >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi
stop

# Not `nproc`: it answers OMP_NUM_THREADS when that is set (1 under the test suite), and a
# node advertising 1 CPU never starts a job asking --cpus-per-task=2.
CPUS=$(getconf _NPROCESSORS_ONLN)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm "$STATE"/{ctld,d} /var/log/slurm /run/munge
chown slurm: "$STATE"/ctld /var/log/slurm
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=distnorm-local
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
: > /etc/slurm/cgroup.conf  # no cgroup plugin in use (proctrack/linuxproc, task/none)

# A munged left from an earlier install (its socket removed, or another key) answers nothing:
# restart it unless a credential round-trips.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  pkill -x munged 2>/dev/null || true
  for _ in $(seq 50); do pgrep -x munged >/dev/null || break; sleep 0.1; done
  [[ -s /etc/munge/munge.key ]] || mungekey --create >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
  chown munge: /etc/munge/munge.key /run/munge && chmod 400 /etc/munge/munge.key
  runuser -u munge -- munged
  munge -n | unmunge >/dev/null || { echo "local_cluster.sh: munged does not answer; see /var/log/munge/" >&2; exit 1; }
fi
slurmctld
slurmd
for _ in $(seq 100); do
  if sinfo -h -o '%t' 2>/dev/null | grep -E 'idle|mix|alloc' >/dev/null; then  # not -q: no SIGPIPE under pipefail
    echo "local Slurm cluster up: $HOST, $CPUS CPUs, partition debug"
    exit 0
  fi
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  sleep 0.2
done
echo "local_cluster.sh: the node did not become idle; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
