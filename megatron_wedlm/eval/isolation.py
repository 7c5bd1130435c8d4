"""What the OS offers to fence in a sandboxed program, detected once and applied per run.

On top of the sandbox's session and rlimits, where the host allows it without extra packages:
a **cgroup** (one memory and process cap for the program and all it forks, every member
listable and killable, so no double fork escapes) and **namespaces** via ``unshare`` (PID: all
die with the first; network: nothing reachable; mount: read-only mounts, private ``/tmp`` and
``/dev/shm``), the program running as ``nobody`` or without capabilities. All or nothing: one
probe runs the full command, and any failure disables them. Each run reports the mechanisms in
force, so a score says how it was obtained.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SESSION = "session"
RLIMITS = "rlimits"
CGROUP = "cgroup"
PID_NAMESPACE = "pid_namespace"
NETWORK_NAMESPACE = "network_namespace"
PRIVATE_TMP = "private_tmp"
READONLY_FILESYSTEM = "readonly_filesystem"
NAMESPACES = (PID_NAMESPACE, NETWORK_NAMESPACE, PRIVATE_TMP, READONLY_FILESYSTEM)
ALL = (SESSION, RLIMITS, CGROUP, *NAMESPACES)

NOBODY = 65534

# Runs inside the new mount namespace, before the program: read-only mounts first (so the
# fresh tmpfs stays writable), then a private /tmp whose ``sandbox`` folder is the workdir.
_MOUNT_SCRIPT = """
mount --make-rprivate /
mount -o remount,bind,ro /
for m in $(awk '$2 !~ "^/(dev)(/|$)" && $2 != "/" {print $2}' /proc/self/mounts); do
    mount -o remount,bind,ro "$m" 2>/dev/null || true
done
mount -t tmpfs -o size={size_mb}m,mode=1777 wedlm-sandbox /tmp
if [ -d /dev/shm ]; then mount -t tmpfs -o size={size_mb}m,mode=1777 wedlm-sandbox /dev/shm; fi
mkdir -m 0777 /tmp/sandbox
cd /tmp/sandbox
exec "$@"
"""


def namespace_command(command: Sequence[str], tmp_mb: int) -> list[str]:
    """``command`` wrapped to run in fresh PID, network and mount namespaces, unprivileged."""
    if os.geteuid() == 0:
        user = ["--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
        userns: list[str] = []
    else:
        user, userns = [], ["--user", "--map-root-user"]
    return [
        "unshare", *userns, "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--net",
        "sh", "-ec", _MOUNT_SCRIPT.replace("{size_mb}", str(tmp_mb)), "sh",
        "setpriv", *user, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", *command,
    ]


@functools.lru_cache(maxsize=None)
def namespaces_available(python: str) -> bool:
    """Whether the namespace wrapper works here: run it once around ``python -c pass``."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    try:
        probe = subprocess.run(
            namespace_command([python, "-I", "-c", "pass"], tmp_mb=1), cwd="/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of each mount, from /proc/self/mountinfo."""
    rows = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                rows.append((fields[4], tail[0], set(tail[2].split(","))))
    return rows


def _own_cgroups() -> dict[str, str]:
    """Controller (or ``""`` for the v2 hierarchy) -> this process's cgroup path."""
    own = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    return own


def _write(path: Path, value: str) -> None:
    path.write_text(value)


@dataclass
class ProgramCgroup:
    """The cgroup(s) holding one program: v2 has one folder, v1 one per hierarchy."""

    dirs: tuple[Path, ...]
    version: int

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> ProgramCgroup | None:
        """A fresh cgroup under this process's own, capped; None where none can be made."""
        try:
            mounts, own = _mounts(), _own_cgroups()
        except OSError:
            return None
        name = f"wedlm-sandbox-{uuid.uuid4().hex[:12]}"
        v2 = [m for m, fstype, _ in mounts if fstype == "cgroup2"]
        if v2 and "" in own:
            made = cls._try((Path(v2[0] + own[""]) / name,), 2, memory_bytes, max_processes)
            if made:
                return made
        v1 = {
            ctrl: Path(m + own[ctrl]) / name
            for m, fstype, opts in mounts if fstype == "cgroup"
            for ctrl in ("memory", "pids") if ctrl in opts and ctrl in own
        }
        if len(v1) == 2:
            return cls._try((v1["memory"], v1["pids"]), 1, memory_bytes, max_processes)
        return None

    @classmethod
    def _try(cls, dirs: tuple[Path, ...], version: int, memory_bytes: int, max_processes: int):
        made: list[Path] = []
        try:
            for d in dirs:
                d.mkdir()
                made.append(d)
            group = cls(dirs, version)
            if version == 2:
                if not (dirs[0] / "memory.max").exists():
                    _write(dirs[0].parent / "cgroup.subtree_control", "+memory +pids")
                _write(dirs[0] / "memory.max", str(memory_bytes))
                if (dirs[0] / "memory.swap.max").exists():
                    _write(dirs[0] / "memory.swap.max", "0")
                _write(dirs[0] / "pids.max", str(max_processes))
            else:
                _write(dirs[0] / "memory.limit_in_bytes", str(memory_bytes))
                try:  # only present with swap accounting; then swap counts too
                    _write(dirs[0] / "memory.memsw.limit_in_bytes", str(memory_bytes))
                except OSError:
                    pass
                _write(dirs[1] / "pids.max", str(max_processes))
            return group
        except OSError:
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:
                    pass
            return None

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join (it and its future children)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def members(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs:
            try:
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return pids

    def oom_killed(self) -> bool:
        """Whether the kernel killed a member for going over the memory cap."""
        events = self.dirs[0] / ("memory.events" if self.version == 2 else "memory.oom_control")
        try:
            counts = dict(line.split() for line in events.read_text().splitlines() if line)
        except (OSError, ValueError):
            return False
        return int(counts.get("oom_kill", 0)) > 0

    def kill(self, wait_s: float = 5.0) -> set[int]:
        """SIGKILL every member until none is left (or ``wait_s`` passed); return survivors."""
        kill_file = self.dirs[0] / "cgroup.kill"
        if self.version == 2 and kill_file.exists():
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while (left := self.members()) and time.monotonic() < deadline:
            kill_all(left)
            time.sleep(0.02)
        return self.members()

    def remove(self) -> None:
        """Remove the (emptied) folders; a folder whose members are still exiting is retried."""
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    self.kill(wait_s=0.1)
                    time.sleep(0.02)


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/PID/stat; None for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def is_running(pid: int) -> bool:
    """True for a live process; a zombie (dead, not yet reaped) counts as gone."""
    found = _state_and_parent(pid)
    return found is not None and found[0] != "Z"


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, theirs, ...), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        found = _state_and_parent(entry) if entry.isdigit() else None
        if found and found[0] != "Z":
            children.setdefault(found[1], []).append(int(entry))
    found_pids, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found_pids:
                found_pids.add(child)
                todo.append(child)
    return found_pids


def processes_of_user(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all, not just ours)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count
