"""Running model-written Python in a time- and memory-limited child process.

Each program runs in a fresh interpreter (``python -I``: no user site, no PYTHON* variables) in
its own empty temporary directory and its own session, with a minimal environment and:

* ``RLIMIT_AS`` (address space) = ``memory_mb``: an allocation beyond it raises MemoryError;
* ``RLIMIT_CPU`` = the timeout (rounded up) + 1 s, a backstop for the wall-clock timeout;
* ``RLIMIT_FSIZE`` = 16 MiB per written file, ``RLIMIT_CORE`` = 0;
* a wall-clock timeout after which the whole process group is killed (so children it forked,
  or an endless loop waiting on input, die too).

The limits are set by a small launcher *inside* the child before the program is run, instead
of a ``preexec_fn``, which is unsafe when the parent is multi-threaded (parallel scoring).

This is a resource fence, not a security boundary: the program can still read files and use
the network if the host allows it. Run untrusted model output in a container or VM without
network, as HumanEval's authors advise.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PASSED = "passed"
FAILED = "failed"
TIMEOUT = "timeout"
MEMORY = "memory_exceeded"

_LAUNCHER = """
import resource, runpy, sys
mem, cpu, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
"""


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program: ``status`` is one of passed/failed/timeout/memory_exceeded."""

    status: str
    returncode: int | None
    seconds: float
    stderr_tail: str

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def run_python(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> ExecutionResult:
    """Run ``program`` as ``__main__``; it passes when it exits with status 0."""
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="wedlm_sandbox_") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable, "-I", "-B", "-c", _LAUNCHER,
            str(memory_mb << 20), str(math.ceil(timeout_s) + 1), path,
        ]
        stderr_path = os.path.join(workdir, "stderr.txt")
        start = time.perf_counter()
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            )
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
            finally:
                _kill_group(proc)
        seconds = time.perf_counter() - start
        with open(stderr_path, "rb") as f:
            f.seek(max(0, os.path.getsize(stderr_path) - 4000))
            stderr_tail = f.read().decode("utf-8", "replace")
    return ExecutionResult(_classify(timed_out, returncode, stderr_tail), returncode, seconds, stderr_tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the program and everything it spawned, then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _classify(timed_out: bool, returncode: int | None, stderr: str) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return TIMEOUT
    if returncode == 0:
        return PASSED
    if "MemoryError" in stderr or returncode == -signal.SIGSEGV:
        # Under RLIMIT_AS a failed allocation raises MemoryError, or crashes C code that does
        # not check malloc's result.
        return MEMORY
    return FAILED


def run_many(
    programs: Sequence[str], timeout_s: float = 10.0, memory_mb: int = 1024, workers: int = 4
) -> list[ExecutionResult]:
    """``run_python`` over many programs in parallel, results in input order."""
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(programs)))) as pool:
        return list(pool.map(lambda p: run_python(p, timeout_s, memory_mb), programs))
