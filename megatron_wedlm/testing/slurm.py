"""A real one-node SLURM cluster on this machine, for tests: Debian's ``munged``, ``slurmctld`` and
``slurmd`` as children of the test, every file they write under one directory and ports chosen
free, so nothing is shared or left behind; commands reach it through ``SLURM_CONF``. The node
offers the CPUs and GPUs a job asks for, not the machine's (GPUs are empty device files).
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from megatron_wedlm.runtime.multiprocess import find_free_port

__all__ = ["PROGRAMS", "SlurmCluster", "missing_daemons", "why_unavailable"]

#: the daemons and commands :class:`SlurmCluster` runs (on PATH or in /usr/sbin)
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def missing_daemons() -> list[str]:
    """The programs of :data:`PROGRAMS` this machine lacks (``apt-get install slurm-wlm munge``)."""
    return [name for name in PROGRAMS if _which(name) is None]


def why_unavailable() -> str | None:
    """Why :class:`SlurmCluster` cannot start here (for a test's skip), or None when it can."""
    missing = missing_daemons()
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the one-node SLURM cluster runs its daemons as root (SlurmUser=root)"
    return None


class SlurmCluster:
    """``munged`` + ``slurmctld`` + ``slurmd`` for one node offering ``cpus`` and ``gpus``; a context
    manager whose exit cancels every job, stops the daemons and leaves their logs in ``root``."""

    def __init__(self, root: str | Path, cpus: int = 64, gpus: int = 8, startup_timeout: float = 60.0):
        self.root = Path(root)
        self.cpus = cpus
        self.gpus = gpus
        self.startup_timeout = startup_timeout
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ files

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.root / sub, 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = find_free_port(), find_free_port()
        while slurmd_port == ctld_port:
            slurmd_port = find_free_port()
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=wedlmtest",
            # job ids (and the ports job scripts derive from them) differ between clusters
            f"FirstJobId={random.randint(1000, 1_000_000)}",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={r / 'etc' / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            # seconds between SIGTERM and SIGKILL when a job is cancelled or times out: SLURM's default,
            # the time a signalled run has to finish its step and save (trainer.exit_signal)
            "KillWait=30",
            "MinJobAge=600",       # finished jobs stay visible to scontrol for the test's asserts
            "SchedulerParameters=sched_interval=2",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{self.gpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        # slurmd drops GPUs without device files; empty files stand in for /dev/nvidia*
        devices = self.root / "dev"
        devices.mkdir(exist_ok=True)
        for index in range(self.gpus):
            (devices / f"gpu{index}").touch()
        (self.root / "etc" / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File={devices}/gpu[0-{self.gpus - 1}]\n")
        (self.root / "etc" / "plugstack.conf").write_text("")

    # ------------------------------------------------------------------ processes

    def env(self) -> dict[str, str]:
        """The environment that points SLURM's commands at this cluster (on top of ``os.environ``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                                cwd=self.root, start_new_session=True)
        log.close()

    def start(self) -> "SlurmCluster":
        """Write the configuration, start the three daemons and wait until the node is idle."""
        reason = why_unavailable()
        if reason:
            raise RuntimeError(reason)
        self._write_files()
        m = self.root / "munge"
        self._start("munged", [_which("munged"), "--foreground", "--force", f"--key-file={m / 'munge.key'}",
                               f"--socket={m / 'munge.socket'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket")
        self._start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld to answer")
        self._start("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() == "IDLE", "the node to be idle")
        return self

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n"
                                       + self.logs())
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(f"SLURM: no {what} after {self.startup_timeout} s:\n" + self.logs())

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd, slurmctld, munged)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", pwd.getpwuid(os.geteuid()).pw_name, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ queries

    def run(self, *command: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster (``scontrol``, ``squeue``, ``sbatch``, ...)."""
        return subprocess.run([_which(command[0]) or command[0], *command[1:]], env=self.env(), capture_output=True,
                              text=True, check=check, timeout=timeout)

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False).stdout.split()
        return out[0].upper().rstrip("*~#$@+") if out else ""

    def job(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...), finished jobs for ``MinJobAge``."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def logs(self) -> str:
        """The daemons' own logs, for failure messages."""
        parts = []
        for file in sorted((self.root / "log").glob("*")):
            text = file.read_text(errors="replace")
            parts.append(f"--- {file.name}\n{text[-3000:]}")
        return "\n".join(parts)
