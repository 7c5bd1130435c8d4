"""An output directory that appears complete or not at all, the one way tools write results: a
failed or mistyped run never destroys the previous output or an input (:func:`atomic_output_dir`).
A crash between its two renames leaves the old output as ``<output>.old-<host>-<pid>``, and a full
disk is named (:class:`DiskFullError`), which torch's zip writer does not say.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from pathlib import Path
from typing import Iterable, Iterator

from .megatron_compat import CHECKPOINT_WRITE_FAILURE_MARKERS

__all__ = [
    "DiskFullError",
    "OutputDirError",
    "atomic_output_dir",
    "atomic_write_text",
    "check_output_dir",
    "disk_full_is_named",
    "is_disk_full",
    "pid_alive",
    "publish_directory",
    "remove_dead_writers",
    "writer_tag",
]

#: Free bytes below which a failed write whose message says nothing about space is taken for a
#: full disk (a write that filled the disk leaves less than a file-system block or so free).
LOW_SPACE_BYTES = 1 << 20

# Messages of write failures that do not carry ENOSPC: torch.save's zip writer (the short write
# shows as a position mismatch), safetensors (Rust I/O error text) and Megatron-Core's checkpoint
# writer where it drops the writer's own message (megatron_compat).
_WRITE_FAILURE_MARKERS = ("inline_container.cc", "file write failed", "PytorchStreamWriter failed",
                          *CHECKPOINT_WRITE_FAILURE_MARKERS)
_NO_SPACE_MARKERS = ("No space left on device", "os error 28")


class OutputDirError(ValueError):
    """The output directory would destroy an input, or exists and may not be replaced."""


class DiskFullError(OSError):
    """No space left on the device while writing a path; the message names the path."""

    def __init__(self, path: str | Path) -> None:
        message = f"no space left on device while writing {path}; free some space or write elsewhere"
        super().__init__(errno.ENOSPC, message)
        self.path = str(path)


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures of a distributed checkpoint save."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack += [item.__cause__, item.__context__]  # type: ignore[list-item]
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                cause = getattr(failure, "exc", failure)  # a WrappedException holds the rank's exception
                stack.append(cause if isinstance(cause, BaseException) else None)


def is_disk_full(err: BaseException, path: str | Path) -> bool:
    """Whether ``err``, raised while writing under ``path``, means the device ran out of space."""
    causes = list(_causes(err))
    for item in causes:
        if isinstance(item, OSError) and item.errno == errno.ENOSPC:
            return True
        if any(marker in str(item) for marker in _NO_SPACE_MARKERS):
            return True
    if any(marker in str(item) for item in causes for marker in _WRITE_FAILURE_MARKERS):
        free = _free_bytes(Path(path))
        return free is not None and free < LOW_SPACE_BYTES
    return False


@contextlib.contextmanager
def disk_full_is_named(path: str | Path) -> Iterator[None]:
    """Re-raise a write failure caused by a full disk as :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except (DiskFullError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if is_disk_full(err, path):
            raise DiskFullError(path) from err
        raise


def _overlap(output: Path, item: Path) -> str | None:
    if output == item:
        return "is"
    if output in item.parents:
        return "contains"
    if item in output.parents:
        return "is inside"
    return None


def check_output_dir(output: str | Path, inputs: Iterable[str | Path | None] = (), overwrite: bool = False) -> None:
    """Raise :class:`OutputDirError` if ``output`` is an input, holds one, lies inside one, is not a
    directory, or is a non-empty directory and ``overwrite`` is false. Nothing is written."""
    final = Path(output)
    resolved = final.resolve()
    for item in inputs:
        if item is None:
            continue
        relation = _overlap(resolved, Path(item).resolve())
        if relation is not None:
            raise OutputDirError(
                f"the output {output} {relation} the input {item}; writing it would destroy or mix with "
                "the input. Choose an output directory outside every input"
            )
    if final.exists() and not final.is_dir():
        raise OutputDirError(f"the output {final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise OutputDirError(
            f"the output directory {final} is not empty; choose another or pass --overwrite "
            "(the old contents are replaced only once the new output is complete)"
        )


def writer_tag() -> str:
    """``<host>-<pid>``, ending a temporary directory's name so a later writer can tell if it still runs."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_dead_writers(parent: Path, stem: str) -> None:
    """Remove ``parent/<stem>.tmp-<host>-<pid>`` (``stem`` a glob) of dead writers on this host."""
    for stale in parent.glob(f"{stem}.tmp-{socket.gethostname()}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (someone else's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish_directory(staging: Path, final: Path, aside: Path) -> None:
    """Rename the finished ``staging`` to ``final``; an existing ``final`` is renamed to ``aside``
    first and deleted only once the new one is in place (a crash in between leaves it there)."""
    if final.exists():
        os.replace(final, aside)
        os.replace(staging, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staging, final)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Replace the small text file ``path`` with ``text`` whole: written beside it, then renamed,
    so a reader (or a crash) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def atomic_output_dir(
    output: str | Path,
    *,
    inputs: Iterable[str | Path | None] = (),
    overwrite: bool = False,
) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``output`` that replaces it when the body succeeds and is
    deleted when it fails; ``output`` overlapping ``inputs`` (what the writer reads), or non-empty
    without ``overwrite``, is refused first (:func:`check_output_dir`)."""
    final = Path(output)
    check_output_dir(final, inputs, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers(final.parent, final.name)
    tag = writer_tag()
    staging = final.with_name(f"{final.name}.tmp-{tag}")
    shutil.rmtree(staging, ignore_errors=True)
    with disk_full_is_named(final):
        try:
            staging.mkdir()
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    publish_directory(staging, final, aside=final.with_name(f"{final.name}.old-{tag}"))
