"""Running model-written Python in a time- and memory-limited child process.

Each program runs in a fresh ``python -I`` in its own empty directory and session, with a
minimal environment, rlimits (address space, CPU time, file size, no core), where the host allows
a cgroup and PID/network/mount namespaces (``isolation``), and a wall-clock timeout after which
everything it started is killed (``SandboxError`` if anything survives).

A program passes only when it ran to its end: the launcher writes a nonce to a pipe after it, so
an early ``sys.exit(0)`` is ``exited_early`` (a guard against mistakes, not against a program
that hunts for the nonce). The limits are set by a launcher inside the child, not a
``preexec_fn``, which is unsafe in a multi-threaded parent. Without namespaces this is a resource
fence, not a security boundary: ``ExecutionResult.isolation`` says which fences were in force.
"""

from __future__ import annotations

import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megatron_wedlm.eval import isolation
from megatron_wedlm.eval.isolation import CGROUP, NAMESPACES, RLIMITS, SESSION, ProgramCgroup

PASSED = "passed"
FAILED = "failed"
EXITED_EARLY = "exited_early"
TIMEOUT = "timeout"
MEMORY = "memory_exceeded"

_LAUNCHER = """
import os, resource, runpy, sys
mem, cpu, nproc, done_fd = map(int, sys.argv[1:5])
nonce, _, source = sys.stdin.buffer.read().partition(b"\\n")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
os.environ["HOME"] = os.environ["TMPDIR"] = os.getcwd()
with open("program.py", "wb") as f:
    f.write(source)
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
os.write(done_fd, nonce)
"""


class SandboxError(RuntimeError):
    """A process the sandbox started could not be killed."""


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program: ``status`` passed/failed/exited_early/timeout/memory_exceeded;
    ``isolation`` names the fences in force (``eval/isolation.py``)."""

    status: str
    returncode: int | None
    seconds: float
    stderr_tail: str
    isolation: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def run_python(
    program: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_processes: int = 64,
    isolation_allowed: Collection[str] = isolation.ALL,
) -> ExecutionResult:
    """Run ``program`` as ``__main__``; it passes when it runs to its end and exits with 0.
    ``isolation_allowed`` limits the fences to those named (default: all the host offers; ``session``
    and ``rlimits`` always)."""
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0:
        raise ValueError(
            f"timeout_s, memory_mb and max_processes must be positive, got {timeout_s}, "
            f"{memory_mb}, {max_processes}"
        )
    unknown = set(isolation_allowed) - set(isolation.ALL)
    if unknown:
        raise ValueError(f"unknown isolation {sorted(unknown)}; choose from {list(isolation.ALL)}")
    allowed = set(isolation_allowed)
    with tempfile.TemporaryDirectory(prefix="wedlm_sandbox_") as scratch:
        workdir = os.path.join(scratch, "work")
        os.mkdir(workdir)
        cgroup = ProgramCgroup.create(memory_mb << 20, max_processes) if CGROUP in allowed else None
        namespaces = set(NAMESPACES) <= allowed and isolation.namespaces_available(sys.executable)
        in_force = (SESSION, RLIMITS) + ((CGROUP,) if cgroup else ())
        in_force += NAMESPACES if namespaces else ()
        done_read, done_write = os.pipe()
        nonce = secrets.token_hex(16).encode()
        stderr_path = os.path.join(scratch, "stderr.txt")
        start = time.perf_counter()
        try:
            cmd = _command(timeout_s, memory_mb, max_processes, done_write, cgroup, namespaces)
            with open(stderr_path, "wb") as stderr:
                proc = subprocess.Popen(
                    cmd, cwd=workdir, env=_ENV, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=stderr, start_new_session=True, pass_fds=(done_write,),
                )
            os.close(done_write)
            done_write = -1
            try:
                source = nonce + b"\n" + program.encode()
                returncode, timed_out = _feed_and_wait(proc, source, timeout_s)
            finally:
                _kill_everything(proc, cgroup)
            seconds = time.perf_counter() - start
            os.set_blocking(done_read, False)
            try:
                ran_to_end = os.read(done_read, 64) == nonce
            except BlockingIOError:
                ran_to_end = False
            oom = cgroup is not None and cgroup.oom_killed()
        finally:
            for fd in (done_read, done_write):
                if fd >= 0:
                    os.close(fd)
            if cgroup:
                cgroup.remove()
        with open(stderr_path, "rb") as f:
            f.seek(max(0, os.path.getsize(stderr_path) - 4000))
            stderr_tail = f.read().decode("utf-8", "replace")
    status = _classify(timed_out, returncode, ran_to_end, oom, stderr_tail)
    if status == EXITED_EARLY:
        stderr_tail += "\n[sandbox] the program exited before its end (sys.exit/os._exit early)"
    return ExecutionResult(status, returncode, seconds, stderr_tail, in_force)


_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _command(
    timeout_s: float, memory_mb: int, max_processes: int, done_fd: int,
    cgroup: ProgramCgroup | None, namespaces: bool,
) -> list[str]:
    """The launcher's command line, inside the namespaces and the cgroup when there are."""
    # Without a cgroup, RLIMIT_NPROC bounds forks; it counts every process of the user.
    nproc = 0 if cgroup else isolation.processes_of_user(os.getuid()) + max_processes
    cmd = [
        sys.executable, "-I", "-B", "-c", _LAUNCHER,
        str(memory_mb << 20), str(math.ceil(timeout_s) + 1), str(nproc), str(done_fd),
    ]
    if namespaces:
        cmd = isolation.namespace_command(cmd, tmp_mb=memory_mb)
    if cgroup:  # join before anything else runs, so every later fork is inside
        join = "".join(f"echo $$ > {shlex.quote(f)}\n" for f in cgroup.procs_files)
        cmd = ["sh", "-ec", join + 'exec "$@"', "sh", *cmd]
    return cmd


def _feed_and_wait(
    proc: subprocess.Popen, data: bytes, timeout_s: float
) -> tuple[int | None, bool]:
    """Send the nonce and source on stdin, then wait; (returncode, timed out)."""
    deadline = time.monotonic() + timeout_s
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:  # the wrapper died before reading (its stderr says why)
        pass
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic())), False
    except subprocess.TimeoutExpired:
        return None, True


def _kill_everything(proc: subprocess.Popen, cgroup: ProgramCgroup | None) -> None:
    """Kill the program and all it spawned, reap it, and check that nothing survived: the cgroup or
    PID namespace catches every process, the session and /proc descendants where neither exists."""
    tree = isolation.descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    isolation.kill_all(tree | isolation.descendants(proc.pid))
    proc.kill()
    proc.wait()
    survivors = (cgroup.kill() if cgroup else set()) | tree
    deadline = time.monotonic() + 5.0
    while survivors := {pid for pid in survivors if isolation.is_running(pid)}:
        if time.monotonic() > deadline:
            raise SandboxError(
                f"sandboxed processes {sorted(survivors)} survived SIGKILL; kill them by hand"
            )
        isolation.kill_all(survivors)
        time.sleep(0.05)


def _classify(
    timed_out: bool, returncode: int | None, ran_to_end: bool, oom: bool, stderr: str
) -> str:
    if timed_out:
        return TIMEOUT
    if returncode == 0 and ran_to_end:
        return PASSED
    if oom or "MemoryError" in stderr or returncode == -signal.SIGSEGV:
        # Under RLIMIT_AS a failed allocation raises MemoryError, or crashes C code that does
        # not check malloc's result; over the cgroup cap the kernel kills a member.
        return MEMORY
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return TIMEOUT
    if returncode == 0:
        return EXITED_EARLY
    return FAILED


def run_many(
    programs: Sequence[str], timeout_s: float = 10.0, memory_mb: int = 1024, workers: int = 4,
    **limits: Any,
) -> list[ExecutionResult]:
    """``run_python`` over many programs in parallel, results in input order; ``limits`` go to it."""
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(programs)))) as pool:
        return list(pool.map(lambda p: run_python(p, timeout_s, memory_mb, **limits), programs))
