"""Running the quickstart's stages: each entry-point subprocess is printed, its output streamed to
the console (stage-prefixed; progress bars collapsed, warnings counted, a heartbeat when silent) and
in full to ``logs/<stage>.log``.

Each stage records its status, wall seconds and children's CPU seconds (a shared machine inflates
wall time only), and the run its longest console silence. A failing stage raises
:class:`StageError` (command, exit status, log tail) and later stages do not run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

_WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")
# An exception line ("ValueError: ...", "torch.OutOfMemoryError: ..."), except the launcher's own.
_ERROR_LINE = re.compile(r"^(?:(?:\w+\.)*\w*(?:Error|Exception)|(?:\w+ )?error):")
HEARTBEAT_S = 15.0  # console line when a stage has printed nothing for this long
PROGRESS_BAR_EVERY_S = 5.0  # at most one console line per this many seconds for \r updates


class StageError(RuntimeError):
    """A stage failed; the message names the stage, the command and the end of its log."""


@dataclass
class StageRecord:
    name: str
    description: str
    status: str = "pending"  # pending | running | done | failed | skipped
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    log: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Console:
    """Timestamped console lines; remembers the longest silence between two of them."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.last = self.start
        self.longest_gap = 0.0
        self._lock = threading.Lock()

    def print(self, text: str) -> None:
        with self._lock:
            now = time.monotonic()
            self.longest_gap = max(self.longest_gap, now - self.last)
            self.last = now
            elapsed = now - self.start
            stamp = f"[{int(elapsed // 60):02d}:{elapsed % 60:04.1f}]"
            for line in text.splitlines() or [""]:
                self.stream.write(f"{stamp} {line}\n")
            self.stream.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


class StageRunner:
    """Runs stages in order, records them in ``<out>/stages.json``."""

    def __init__(self, out_dir: str | Path, console: Console | None = None, env: Mapping[str, str] | None = None):
        self.out_dir = Path(out_dir)
        self.log_dir = self.out_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.env = dict(os.environ if env is None else env)
        self.records: list[StageRecord] = []
        self._current: StageRecord | None = None
        self._stage_start = time.monotonic()

    # -- stages -----------------------------------------------------------------------------
    def stage(self, name: str, description: str, fn: Callable[[], dict[str, Any] | None]) -> StageRecord:
        """Run ``fn`` as stage ``name``; what it returns is kept as the stage's ``detail``."""
        record = StageRecord(name=name, description=description, status="running")
        self.records.append(record)
        self._current = record
        index = len(self.records)
        self.console.print(f"=== stage {index}: {name} -- {description}")
        wall0, cpu0 = time.monotonic(), _children_cpu_seconds() + _self_cpu_seconds()
        self._stage_start = wall0
        try:
            record.detail = fn() or {}
            record.status = "done"
        except BaseException:
            record.status = "failed"
            raise
        finally:
            record.wall_seconds = time.monotonic() - wall0
            record.cpu_seconds = _children_cpu_seconds() + _self_cpu_seconds() - cpu0
            self._current = None
            self.save()
        self.console.print(
            f"=== stage {index}: {name} done in {record.wall_seconds:.1f}s wall, {record.cpu_seconds:.1f}s CPU"
        )
        return record

    def skip(self, name: str, description: str, reason: str) -> StageRecord:
        record = StageRecord(name=name, description=description, status="skipped", detail={"reason": reason})
        self.records.append(record)
        self.console.print(f"=== stage {len(self.records)}: {name} skipped: {reason}")
        self.save()
        return record

    def save(self) -> Path:
        path = self.out_dir / "stages.json"
        path.write_text(json.dumps([asdict(r) for r in self.records], indent=2))
        return path

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[None]:
        """While active, print a line whenever the console has been quiet for ``HEARTBEAT_S``."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(1.0):
                if time.monotonic() - self.console.last >= HEARTBEAT_S:
                    record = self._current
                    if record is not None:
                        self.console.print(f"[{record.name}] ... still running "
                                           f"({time.monotonic() - self._stage_start:.0f}s in this stage)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def in_parallel(self, jobs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run the current stage's ``jobs`` (each a few :meth:`run` calls in sequence) at once, one
        thread each; returns their results in order. A failure is raised once every job has ended,
        so no child outlives the stage."""
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = [pool.submit(job) for job in jobs]
        return [future.result() for future in futures]

    # -- subprocesses -----------------------------------------------------------------------
    def run(self, command: Sequence[str], log_name: str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None, tag: str | None = None) -> None:
        """Run ``command``, streaming its output; raise :class:`StageError` on failure. ``tag``
        prefixes its console lines (default: the stage's name; parallel commands need their own)."""
        record = self._current
        tag = tag or (record.name if record else "run")
        printable = shlex.join(str(c) for c in command)
        log_path = self.log_dir / f"{log_name or tag}.log"
        if record is not None:
            record.commands.append(printable)
            record.log = str(log_path.relative_to(self.out_dir))
        self.console.print(f"[{tag}] $ {printable}")
        full_env = dict(self.env)
        full_env.update(env or {})
        tail: deque[str] = deque(maxlen=25)
        errors: list[str] = []
        with log_path.open("a", encoding="utf-8") as log:
            log.write(f"$ {printable}\n")
            log.flush()
            proc = subprocess.Popen(
                [str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=full_env, cwd=str(cwd) if cwd else None, bufsize=0,
            )
            try:
                self._pump(proc, tag, log, tail, errors)
                code = proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if code != 0:
            first = "".join(f"\n  {e}" for e in dict.fromkeys(errors))
            raise StageError(
                f"stage {tag!r} failed (exit status {code}) running:\n  {printable}\n"
                + (f"error(s) reported:{first}\n" if first else "")
                + f"last lines of {log_path}:\n" + "\n".join(tail)
            )

    def _pump(self, proc: subprocess.Popen, tag: str, log: TextIO, tail: deque[str], errors: list[str]) -> None:
        """Copy the child's output to the log and (filtered, collapsed) to the console."""
        assert proc.stdout is not None
        buffer = b""
        last_bar = 0.0
        in_warning = False
        warnings = 0

        def handle(line: str, is_bar: bool) -> None:
            nonlocal last_bar, in_warning, warnings
            log.write(line + "\n")
            tail.append(line)
            if len(errors) < 3 and _ERROR_LINE.match(line) and "ChildFailedError" not in line:
                errors.append(line)
            if _WARNING_LINE.match(line):
                in_warning, warnings = True, warnings + 1
                return
            if in_warning and line[:1].isspace():
                return
            in_warning = False
            if is_bar:  # progress-bar update: show some, log all
                now = time.monotonic()
                if now - last_bar < PROGRESS_BAR_EVERY_S:
                    return
                last_bar = now
            self.console.print(f"[{tag}] {line}")

        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            while True:
                cut = min((i for i in (buffer.find(b"\n"), buffer.find(b"\r")) if i != -1), default=-1)
                if cut == -1:
                    break
                raw, sep, buffer = buffer[:cut], buffer[cut:cut + 1], buffer[cut + 1:]
                line = raw.decode("utf-8", errors="replace").rstrip()
                if line:
                    handle(line, is_bar=sep == b"\r")
            log.flush()
        if buffer.strip():
            handle(buffer.decode("utf-8", errors="replace").rstrip(), is_bar=False)
        if warnings:
            self.console.print(f"[{tag}] ({warnings} Python warnings in {Path(log.name).name})")
