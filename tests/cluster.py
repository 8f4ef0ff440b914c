"""A small simulated cluster on one machine: N hosts as Linux network namespaces.

Each host gets its own network namespace with an interface ``eth0`` on a private /24
(``10.<net>.0.<i+1>``), all joined by a bridge in the root namespace, its own loopback,
its own host name (a UTS namespace per command: ``unshare --uts`` + ``hostname``) and its own
``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``) listing every host
by name. So ``localhost`` on one host is not the head node — the place where a rendezvous
that wrongly points at ``localhost`` fails, as it would on a real cluster — and torchrun's
c10d rendezvous can recognise the head by its name.

Used by the tests (``tests/test_cluster.py``) and by hand::

    sudo .venv/bin/python -m tests.cluster run --hosts 2 -- hostname       # every host, then tear down
    sudo .venv/bin/python -m tests.cluster up --hosts 2                    # keep it (prints the names)
    sudo ip netns exec dn0-h1 unshare --uts sh -c 'hostname dn0-h1; bash'
    sudo .venv/bin/python -m tests.cluster down                            # remove every dn* cluster

Needs root and ``ip netns`` (iproute2). :func:`available` says why not, for skips. Teardown
(processes killed, namespaces, bridge, /etc/netns entries removed) always runs: on exit from
the ``with`` block, on an exception, and at interpreter exit.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "Host", "available", "qdisc_available"]

PREFIX = "dn"


def available() -> str | None:
    """``None`` if a cluster can be built here, else the reason (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    """One simulated host: its namespace, name, address and root-side link."""

    index: int
    name: str
    netns: str
    address: str
    link: str  # the veth end in the root namespace (on the bridge): cut it to cut the host off
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, cmd: str) -> list[str]:
        """``cmd`` (a shell command) as run on this host: its namespace, name and /etc/hosts."""
        inner = f"hostname {shlex.quote(self.name)} && exec sh -c {shlex.quote(cmd)}"
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c", inner]

    def start(self, cmd: str, *, env: dict[str, str] | None = None, log: Path | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Start ``cmd`` on this host (in its own session, so it can be killed as a group)."""
        out = open(log, "w") if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(self.command(cmd), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, cmd: str, *, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), env=env, capture_output=True, text=True, timeout=timeout)

    def kill(self) -> None:
        """Kill every process started on this host (a host that dies)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Anything else left in the namespace (daemons it started).
        pids = _sh("ip", "netns", "pids", self.netns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def cut(self) -> None:
        """Cut this host's network link (the cable pulled)."""
        _sh("ip", "link", "set", self.link, "down")

    def restore(self) -> None:
        _sh("ip", "link", "set", self.link, "up")

    def shape(self, qdisc: str | None) -> None:
        """Shape this host's outgoing traffic with a ``tc`` root qdisc (``"netem delay 1ms"``,
        ``"tbf rate 1gbit burst 256kb latency 50ms"``), or clear it (``None``)."""
        _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if qdisc:
            _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", "eth0", "root", *qdisc.split())


def qdisc_available(qdisc: str) -> str | None:
    """``None`` if this kernel accepts ``qdisc`` (e.g. ``"netem delay 1ms"``), else why not."""
    probe = f"{PREFIX}q{os.getpid()}"
    _sh("ip", "netns", "add", probe)
    try:
        _sh("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
        added = _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc.split(), check=False)
        return None if added.returncode == 0 else (added.stderr.strip() or f"tc exit {added.returncode}")
    finally:
        _sh("ip", "netns", "delete", probe, check=False)


class Cluster:
    """``with Cluster(2) as c: c.hosts[0].start(...)`` — N hosts, always torn down."""

    def __init__(self, hosts: int, *, net: int | None = None):
        if hosts < 1:
            raise ValueError("a cluster needs at least one host")
        reason = available()
        if reason:
            raise RuntimeError(f"cannot build a simulated cluster: {reason}")
        self.id = net if net is not None else os.getpid() % 200 + 20
        self.bridge = f"{PREFIX}{self.id}br"
        self.hosts = [
            Host(i, f"{PREFIX}{self.id}-h{i}", f"{PREFIX}{self.id}-h{i}", f"10.{self.id}.0.{i + 1}", f"{PREFIX}{self.id}h{i}")
            for i in range(hosts)
        ]
        self._up = False
        self.slurm_env: dict[str, str] | None = None
        self._slurm_dir: Path | None = None

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Cluster":
        atexit.register(self.down)
        self._up = True
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
            for h in self.hosts:
                _sh("ip", "netns", "add", h.netns)
                _sh("ip", "link", "add", h.link, "type", "veth", "peer", "name", f"{h.link}p")
                _sh("ip", "link", "set", f"{h.link}p", "netns", h.netns)
                _sh("ip", "netns", "exec", h.netns, "ip", "link", "set", f"{h.link}p", "name", "eth0")
                _sh("ip", "netns", "exec", h.netns, "ip", "addr", "add", f"{h.address}/24", "dev", "eth0")
                _sh("ip", "netns", "exec", h.netns, "ip", "link", "set", "eth0", "up")
                _sh("ip", "netns", "exec", h.netns, "ip", "link", "set", "lo", "up")
                _sh("ip", "link", "set", h.link, "master", self.bridge)
                _sh("ip", "link", "set", h.link, "up")
                etc = Path("/etc/netns") / h.netns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
                (etc / "hostname").write_text(h.name + "\n")
        except Exception:
            self.down()
            raise
        return self

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for h in self.hosts:
            h.kill()
            _sh("ip", "netns", "delete", h.netns, check=False)
            _sh("ip", "link", "delete", h.link, check=False)
            shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)
        _sh("ip", "link", "delete", self.bridge, check=False)

    # ----------------------------------------------------------------------- ssh
    def start_ssh(self, workdir: Path) -> None:
        """Passwordless root ssh between the hosts, as a cluster has it: a key made for this
        cluster, an sshd on every host, and a host-wide client config (``/etc/netns/<ns>/ssh``
        is mounted over ``/etc/ssh`` inside the host) that uses the key and trusts the hosts."""
        if shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
            raise RuntimeError("start_ssh needs openssh-server (apt-get install openssh-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        key, host_key = workdir / "id_ed25519", workdir / "host_ed25519"
        for path in (key, host_key):
            if not path.exists():
                _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path))
        (workdir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for h in self.hosts:
            etc = Path("/etc/netns") / h.netns / "ssh"
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "ssh_config").write_text(
                f"Host *\n  IdentityFile {key}\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                "  LogLevel ERROR\n  BatchMode yes\n")
            (etc / "sshd_config").write_text(
                f"ListenAddress {h.address}\nHostKey {host_key}\nPermitRootLogin prohibit-password\n"
                f"AuthorizedKeysFile {workdir}/authorized_keys\nStrictModes no\nUsePAM no\nPidFile none\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n")
            h.start("exec /usr/sbin/sshd -D -e -f /etc/ssh/sshd_config", log=workdir / f"sshd-{h.name}.log")
        deadline = time.time() + 20
        for h in self.hosts:
            while self.hosts[0].run(f"ssh {h.name} true", timeout=20).returncode != 0:
                if time.time() > deadline:
                    raise RuntimeError(f"ssh to {h.name} does not work: " + (workdir / f"sshd-{h.name}.log").read_text())
                time.sleep(0.2)

    # --------------------------------------------------------------------- slurm
    def start_slurm(self, workdir: Path) -> dict[str, str]:
        """A Slurm cluster on the hosts, as a real one is laid out: ``slurmctld`` on host 0,
        one ``slurmd`` per host (``NodeName`` = the host's name, ``NodeAddr`` = its address),
        munge shared (its socket is a file, reachable from every network namespace), state
        under ``workdir`` (the shared file system). Returns the environment for Slurm's
        commands (``SLURM_CONF``); submit from a host (``hosts[0].run("sbatch ...", env=...)``).
        Needs Debian's slurm-wlm and munge."""
        for tool in ("slurmctld", "slurmd", "munged"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"start_slurm needs `{tool}` (apt-get install slurm-wlm munge)")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "ctld").mkdir(exist_ok=True)
        for h in self.hosts:
            (workdir / f"spool-{h.name}").mkdir(exist_ok=True)
        cpus = os.cpu_count() or 1
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} RealMemory=2000 State=UNKNOWN\n"
                        for h in self.hosts)
        conf = workdir / "slurm.conf"
        conf.write_text(
            f"ClusterName=dn{self.id}\nSlurmctldHost={self.hosts[0].name}({self.hosts[0].address})\n"
            "SlurmUser=root\nAuthType=auth/munge\nMpiDefault=none\n"
            f"StateSaveLocation={workdir}/ctld\nSlurmdSpoolDir={workdir}/spool-%n\n"
            f"SlurmctldPidFile={workdir}/slurmctld.pid\n"
            # slurmd kills the process named in its pid file at start: one file per host, on a
            # tmpfs of the host's own mount namespace (see _slurmd_command).
            "SlurmdPidFile=/run/dn-slurmd/slurmd.pid\n"
            f"SlurmctldLogFile={workdir}/slurmctld.log\nSlurmdLogFile={workdir}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/backfill\n"
            # A node that stops answering is DOWN after SlurmdTimeout (its jobs requeued), and
            # back in service as soon as its slurmd registers again.
            "SlurmdTimeout=10\nReturnToService=2\nJobRequeue=1\nKillWait=5\nMinJobAge=600\n"
            f"{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
        (workdir / "cgroup.conf").write_text("")  # no cgroup plugin in use (linuxproc, task/none)
        self.slurm_env = {**os.environ, "SLURM_CONF": str(conf)}
        self._slurm_dir = workdir
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        if _sh("pgrep", "-x", "munged", check=False).returncode != 0:
            _sh("runuser", "-u", "munge", "--", "munged")
        self.hosts[0].start("exec slurmctld -D", env=self.slurm_env, log=workdir / "slurmctld.out")
        for h in self.hosts:
            self.start_slurmd(h)
        deadline = time.time() + 60
        while True:
            states = self.hosts[0].run("sinfo -h -N -o '%N %t'", env=self.slurm_env).stdout.split()
            if states[1::2] and all(s == "idle" for s in states[1::2]) and len(states) == 2 * len(self.hosts):
                return self.slurm_env
            if time.time() > deadline:
                raise RuntimeError(f"Slurm nodes did not become idle ({states}); see {workdir}/*.log")
            time.sleep(0.5)

    def start_slurmd(self, host: Host) -> None:
        """(Re)start the slurmd of ``host`` (after :meth:`start_slurm`): a node coming back."""
        host.start(_slurmd_command(host.name), env=self.slurm_env, log=self._slurm_dir / f"slurmd-{host.name}.out")

    # ------------------------------------------------------------------- running
    def run_everywhere(self, cmd: str, *, env_of=None, logs: Path | None = None, timeout: float = 600,
                       cwd: str | Path | None = None) -> list[int | None]:
        """Start ``cmd`` on every host (``env_of(host)`` gives each its environment), wait for
        all; returns the exit codes (``None``: killed at the timeout)."""
        procs = [h.start(cmd, env=env_of(h) if env_of else None,
                         log=(logs / f"{h.name}.log") if logs is not None else None, cwd=cwd)
                 for h in self.hosts]
        return wait_all(procs, timeout)


def _slurmd_command(node: str) -> str:
    """slurmd for one host, in that host's mount namespace (``ip netns exec`` gives each command
    its own, with a fresh /sys): a private /run/dn-slurmd for its pid file, and the machine's
    cgroup hierarchies mounted again under the new /sys/fs/cgroup (slurmd refuses to start
    without them), as read from this namespace's mount table."""
    mounts = ["mkdir -p /run/dn-slurmd", "mount -t tmpfs tmpfs /run/dn-slurmd"]
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, where, kind, opts = line.split()[:4]
        if where.startswith("/sys/fs/cgroup"):
            keep = ",".join(o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec"))
            mounts.append(f"mkdir -p {where} && mount -t {kind} {'-o ' + keep + ' ' if keep else ''}{dev} {where}")
    return " && ".join([*mounts, f"exec slurmd -D -N {node}"])


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.time() + timeout
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.time(), 0.1)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)
    return codes


def _down_all() -> None:
    """Remove every simulated host and bridge this module may have left behind."""
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and "-h" in name:
            for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "delete", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    for line in _sh("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX) and name.endswith("br"):
            _sh("ip", "link", "delete", name, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run a command on every host, then tear down")
    run.add_argument("--hosts", type=int, default=2)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    up = sub.add_parser("up", help="create the hosts and leave them up")
    up.add_argument("--hosts", type=int, default=2)
    sub.add_parser("down", help="remove every simulated host")
    args = parser.parse_args(argv)
    if args.action == "down":
        _down_all()
        return 0
    cluster = Cluster(args.hosts)
    if args.action == "up":
        cluster.up()
        atexit.unregister(cluster.down)
        for h in cluster.hosts:
            print(f"{h.name} {h.address}  (sudo ip netns exec {h.netns} unshare --uts sh -c 'hostname {h.name}; bash')")
        return 0
    import tempfile

    cmd = " ".join(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    with cluster, tempfile.TemporaryDirectory() as tmp:
        codes = cluster.run_everywhere(cmd, env_of=lambda h: {**os.environ, "HOST_RANK": str(h.index)}, logs=Path(tmp))
        for h, code in zip(cluster.hosts, codes):
            print(f"[{h.name} {h.address}] exit {code}\n{(Path(tmp) / f'{h.name}.log').read_text()}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
