"""A real single-node Slurm cluster for tests: munged + slurmctld + slurmd, all state under one temp dir.

    from slurm_cluster import slurm_cluster      # the session fixture; tests take it as an argument

Debian's ``slurm-wlm`` and ``munge`` (``bash scripts/ci_system_deps.sh``) are started with a minimal slurm.conf:
``proctrack/linuxproc``, ``task/none`` (no cgroups), no accounting (job states come from ``scontrol``/``squeue``;
``MinJobAge`` keeps finished jobs visible), ``batch_sched_delay=0`` (else every job waits ~3 s). Nothing is written
to /etc, /run or /var and no systemd is needed. The daemons listen on free ports on 127.0.0.1, so a second cluster
(another test session) can run side by side. ``SLURM_CONF`` is exported for the session (sbatch exports it into the
jobs, so ``srun``/``scontrol`` inside a job find it too) and restored afterwards.

Teardown cancels the jobs still known to this cluster, shuts the daemons down and then signals only the PIDs
recorded at start (munged, slurmctld, slurmd): never processes found by name.

If Slurm cannot run here the fixture skips with the exact reason: not root (slurmd must switch to the submitting
user), which binary is missing, or which daemon failed to start and the tail of its log.
``STALERL_KEEP_SLURM_STATE=1`` keeps the state dir (logs, job outputs) after the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

REQUIRED_BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol",
                     "sinfo", "scancel")
INSTALL_HINT = "install them with: bash scripts/ci_system_deps.sh (apt-get install slurm-wlm munge)"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run on this machine; the message says exactly why."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours is not alive
    with contextlib.suppress(OSError, ValueError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(lines[-n:]) if lines else "(empty)"


@dataclass
class SlurmCluster:
    """One single-node cluster. ``start()`` raises :class:`SlurmUnavailable`; ``stop()`` is idempotent."""

    state: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    partition: str = "debug"
    pids: dict = field(default_factory=dict)  # name -> pid, recorded as soon as each daemon is up
    startup_s: float = 0.0

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def jobs_dir(self) -> Path:
        """A scratch directory writable by any user, for job outputs."""
        return self.state / "jobs"

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------------------------------------ start
    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable(f"running as uid {os.geteuid()}, not root: slurmd must run as root to start "
                                   "jobs as the submitting user (run the tests as root, e.g. in the CI container)")
        missing = [b for b in REQUIRED_BINARIES if _which(b) is None]
        if missing:
            raise SlurmUnavailable(f"Slurm binaries not found: {', '.join(missing)}; {INSTALL_HINT}")
        t0 = time.monotonic()
        s = self.state
        for sub in ("munge", "state", "spool", "log", "run", "jobs"):
            (s / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(s, 0o755)
        os.chmod(s / "munge", 0o755)  # munged: the socket's directory must be o+x
        os.chmod(s / "jobs", 0o1777)
        try:
            self._start_munge()
            self._write_conf()
            self._start_daemon("slurmctld", [_which("slurmctld"), "-f", str(self.conf)], s / "run" / "slurmctld.pid")
            self._start_daemon("slurmd", [_which("slurmd"), "-f", str(self.conf), "-N", self.node],
                               s / "run" / "slurmd.pid")
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _fail(self, what: str, log: Optional[Path] = None) -> SlurmUnavailable:
        logs = [log] if log else [self.state / "munge" / "munged.log", self.state / "log" / "slurmctld.log",
                                  self.state / "log" / "slurmd.log"]
        tails = "".join(f"\n---- tail of {p}:\n{_tail(p)}" for p in logs if p.exists())
        return SlurmUnavailable(f"{what}{tails}")

    def _run(self, argv: list, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=kw.pop("timeout", 30), **kw)

    def _start_munge(self) -> None:
        m = self.state / "munge"
        key = m / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = m / "munge.socket.2"
        # --force: munged refuses a socket whose ancestor directories are not o+x (e.g. a 0700 temp root) unless
        # forced; root can use the socket either way.
        res = self._run([_which("munged"), "--force", f"--key-file={key}", f"--socket={self.socket}",
                         f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                         f"--seed-file={m / 'munged.seed'}"])
        if res.returncode != 0:
            raise self._fail(f"munged failed to start (exit {res.returncode}): {res.stderr.strip()}",
                             m / "munged.log")
        self._record("munged", m / "munged.pid")
        deadline = time.monotonic() + 5
        while not self.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        enc = self._run([_which("munge"), "-n", "-S", str(self.socket)])
        dec = self._run([_which("unmunge"), "-S", str(self.socket)], input=enc.stdout)
        if enc.returncode != 0 or dec.returncode != 0:
            raise self._fail(f"munge round trip failed: {enc.stderr.strip()} {dec.stderr.strip()}",
                             m / "munged.log")

    def _write_conf(self) -> None:
        hw = self._run([_which("slurmd"), "-C"]).stdout.splitlines()
        hw_fields = [f for f in (hw[0].split() if hw else []) if not f.startswith(("NodeName=", "RealMemory=",
                                                                                    "UpTime="))]
        if not any(f.startswith("CPUs=") for f in hw_fields):
            hw_fields = [f"CPUs={os.cpu_count() or 1}"]
        mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:")), 2 * 1024 * 1024)
        self.ctld_port, self.slurmd_port = _free_ports(2)
        s = self.state
        self.conf.write_text("\n".join([
            "ClusterName=stalerlci",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={s / 'state'}",
            f"SlurmdSpoolDir={s / 'spool'}",
            f"SlurmctldPidFile={s / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={s / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={s / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={s / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={s / 'log' / 'jobcomp.txt'}",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MinJobAge=3600",
            "KillWait=30",  # Slurm's default: scancel's SIGTERM, then SIGKILL 30 s later (a run stops within its grace)
            "InactiveLimit=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 {' '.join(hw_fields)} RealMemory={int(mem_kb / 1024 * 0.95)} "
            "State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=NO",
            "",
        ]))

    def _record(self, name: str, pid_file: Path, wait_s: float = 10.0) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                self.pids[name] = int(pid_file.read_text().strip())
                return
            time.sleep(0.05)
        raise self._fail(f"{name} wrote no pid file {pid_file} within {wait_s:.0f}s")

    def _start_daemon(self, name: str, argv: list, pid_file: Path) -> None:
        res = self._run(argv)  # both daemonize; the pid file appears once they are up
        if res.returncode != 0:
            raise self._fail(f"{name} failed to start (exit {res.returncode}): {res.stderr.strip()}",
                             self.state / "log" / f"{name}.log")
        self._record(name, pid_file)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for name in ("slurmctld", "slurmd"):
                if not _alive(self.pids.get(name)):
                    raise self._fail(f"{name} (pid {self.pids.get(name)}) exited during start-up",
                                     self.state / "log" / f"{name}.log")
            res = self._run([_which("sinfo"), "-h", "-n", self.node, "-o", "%T"])
            state = res.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise self._fail(f"node {self.node} is {state or 'unknown'!r}, not idle, {timeout_s:.0f}s after start")

    # ------------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Cancel this cluster's jobs, shut the daemons down, then signal only the recorded PIDs."""
        if _alive(self.pids.get("slurmctld")):
            with contextlib.suppress(Exception):
                ids = self._run([_which("squeue"), "-h", "-o", "%A"], timeout=10).stdout.split()
                if ids:
                    self._run([_which("scancel"), *ids], timeout=10)
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline and self._run(
                            [_which("squeue"), "-h", "-o", "%A"], timeout=10).stdout.strip():
                        time.sleep(0.2)
            with contextlib.suppress(Exception):
                self._run([_which("scontrol"), "shutdown"], timeout=15)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.get(name)
            if not pid:
                continue
            # slurmd/slurmctld got `scontrol shutdown` above; munged only stops on a signal
            steps = ((None, 5.0),) if name != "munged" else ()
            for sig, wait in (*steps, (signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
                if sig is not None and _alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + wait
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not _alive(pid):
                    break
        self.pids.clear()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node Slurm cluster for the whole session (skips with the reason when impossible)."""
    state = Path(tempfile.mkdtemp(prefix="stalerl-slurm-", dir="/tmp"))  # short path: munge socket <= 108 chars
    cluster = SlurmCluster(state)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(f"single-node Slurm unavailable: {exc}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if os.environ.get("STALERL_KEEP_SLURM_STATE") != "1":
            shutil.rmtree(state, ignore_errors=True)
