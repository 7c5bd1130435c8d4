"""Training checkpoints' names, lineage, readability and atomic publication, for both engines.

A checkpoint ``<checkpointing.dir>/iter_0000015/`` is written as ``iter_N.partial`` and renamed once
every rank finished and ``trainer_state.json`` is on disk, so the newest complete one is loadable;
pruning renames to ``.pruned`` first, so a reader sees a checkpoint whole or gone. Each trainer
state records the run's ``lineage`` (runs, each with the step it started from); ``lineage.json``
holds the newest run's, and ``--resume auto`` and pruning follow it only, never an abandoned branch.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_wedlm.runtime.atomic_output import atomic_write_text, publish_directory

__all__ = [
    "CONFIG_FILE",
    "CheckpointDirectory",
    "CheckpointReadError",
    "LINEAGE_FILE",
    "Lineage",
    "TRAINER_STATE_FILE",
    "checkpoint_name",
    "checkpoint_problem",
    "complete_checkpoints",
    "current_lineage",
    "find_latest_checkpoint",
    "host_rng_state",
    "is_complete_checkpoint",
    "lineage_checkpoints",
    "on_lineage",
    "read_trainer_state",
    "record_lineage",
    "resolve_resume_path",
    "set_host_rng_state",
]

Lineage = list[dict[str, Any]]  # [{"run_id": ..., "from_step": ...}, ...], oldest run first

TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
LATEST_FILE = "latest_checkpointed_iteration.txt"
LINEAGE_FILE = "lineage.json"
PARTIAL_SUFFIX = ".partial"
PRUNED_SUFFIX = ".pruned"  # a pruned checkpoint is renamed to this, then deleted
_NAME = re.compile(r"^iter_(\d{7,})$")
def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None and (path / TRAINER_STATE_FILE).is_file()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and is_complete_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def lineage_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete, readable checkpoints of ``root``'s current lineage, oldest first
    (every complete one when no lineage is recorded)."""
    lineage = current_lineage(root)
    found = []
    for step, path in complete_checkpoints(root):
        try:
            state = read_trainer_state(path)
        except CheckpointReadError:
            continue
        if lineage is None or _state_on_lineage(state, lineage):
            found.append((step, path))
    return found


class CheckpointReadError(RuntimeError):
    """A checkpoint exists but cannot be read; the message names the file and what is wrong."""


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def on_lineage(run_id: str | None, step: int, lineage: Lineage) -> bool:
    """Whether what run ``run_id`` saved or logged at ``step`` is history of ``lineage``: a run's
    output counts up to the step the next run started from."""
    ids = [entry["run_id"] for entry in lineage]
    if run_id not in ids:
        return False
    index = ids.index(run_id)
    return index == len(ids) - 1 or step <= int(lineage[index + 1]["from_step"])


def _state_on_lineage(state: dict[str, Any], lineage: Lineage) -> bool:
    own = state.get("lineage")
    return on_lineage(own[-1]["run_id"] if own else None, int(state["step"]), lineage)


def current_lineage(root: str | Path) -> Lineage | None:
    """The lineage of the run that started last under ``root`` (None: none recorded)."""
    file = Path(root) / LINEAGE_FILE
    if not file.is_file():
        return None
    try:
        return list(json.loads(file.read_text())["lineage"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        _stderr(f"warning: {file} cannot be read ({err}); --resume auto considers every checkpoint")
        return None


def record_lineage(root: str | Path, lineage: Lineage) -> None:
    """Make ``lineage`` the current one under ``root`` (atomically; rank 0, at the start of a run)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / LINEAGE_FILE, json.dumps({"lineage": lineage}, indent=1) + "\n")


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None; cheap: file sizes and indexes, no tensors."""
    path = Path(path)
    try:
        read_trainer_state(path)
    except CheckpointReadError as err:
        return str(err)
    if (path / ".metadata").is_file():
        from megatron_wedlm.conversion.megatron_checkpoint import torch_dist_problem  # imports safetensors

        problem = torch_dist_problem(path)
        if problem is not None:
            return problem
    for file in sorted(path.rglob("*.pt")):
        if not zipfile.is_zipfile(file):
            return f"{file} is not a complete torch.save archive (truncated?)"
    return None


def find_latest_checkpoint(root: str | Path, warn: Callable[[str], None] = _stderr) -> Path | None:
    """The newest readable checkpoint of the current lineage under ``root`` (None if none), passing over
    unreadable ones with a warning; :class:`CheckpointReadError` when checkpoints exist but none is readable."""
    found = complete_checkpoints(root)
    lineage = current_lineage(root)
    problems = []
    for _, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is not None:
            problems.append(f"{path.name}: {problem}")
            warn(f"warning: checkpoint {path} cannot be read ({problem}); trying the previous one")
            continue
        if lineage is not None and not _state_on_lineage(read_trainer_state(path), lineage):
            warn(f"note: {path.name} belongs to an abandoned branch (the last run resumed from an earlier "
                 "checkpoint); not loaded, pass it by path to resume it")
            continue
        return path
    if problems:
        raise CheckpointReadError(
            f"no checkpoint under {root} can be read ({'; '.join(problems)}); resume one by path after "
            "repairing it, or move the directory aside to start fresh"
        )
    return None


def resolve_resume_path(resume: str, root: str | Path, warn: Callable[[str], None] = _stderr) -> Path | None:
    """``none``: None; ``auto``: :func:`find_latest_checkpoint`; else a complete, readable checkpoint (or root)."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest_checkpoint(root, warn)
    path = Path(resume)
    if path.is_dir() and not _NAME.match(path.name):
        latest = find_latest_checkpoint(path, warn)  # a checkpoints root was given
        if latest is not None:
            return latest
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(
            f"checkpointing.resume={resume!r} is not a complete checkpoint (an iter_NNNNNNN directory "
            f"holding {TRAINER_STATE_FILE}); use 'auto' to pick the newest complete one"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointReadError(
            f"checkpointing.resume={resume}: this checkpoint cannot be read ({problem}); resume an earlier "
            "one by path, or use 'auto' to fall back to the newest readable one"
        )
    return path


def host_rng_state() -> dict[str, Any]:
    """The process's python, numpy, torch (and CUDA) generators, which exact resume restores."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_host_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointDirectory:
    """The checkpoints under ``root``: ``.partial`` saves, publication, pruning (rank 0 moves files)."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0

    def begin_save(self, step: int) -> tuple[Path, Path]:
        """Collective: ``(final, partial)`` for ``step``, ``partial`` created fresh (killed saves'
        leftovers removed) before any rank writes."""
        final = self.root / checkpoint_name(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            for suffix in (PARTIAL_SUFFIX, PRUNED_SUFFIX):  # left by a save or a prune that was killed
                for stale in self.root.glob(f"*{suffix}"):
                    shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        return final, partial

    def finish_save(
        self, partial: Path, final: Path, state: dict[str, Any], files: dict[str, str | Path]
    ) -> Path:
        """Collective, once every rank wrote its tensors: rank 0 writes ``files`` (text, or a
        :class:`Path` to copy) and the trainer state last (it marks completion), publishes and prunes."""
        _barrier()
        if self.is_writer:
            for name, content in files.items():
                if isinstance(content, Path):
                    shutil.copyfile(content, partial / name)
                else:
                    (partial / name).write_text(content)
            (partial / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
            self.publish(partial, final)
            self.prune(state.get("lineage"))
        _barrier()
        return final

    def publish(self, partial: Path, final: Path) -> None:
        """The commit point: the checkpoint becomes visible under its final name."""
        # an existing ``final`` is an abandoned future of an earlier resume: it is replaced
        publish_directory(partial, final, aside=final.with_name(final.name + ".replaced"))
        _fsync_dir(self.root)
        step = _NAME.match(final.name).group(1).lstrip("0") or "0"  # type: ignore[union-attr]
        atomic_write_text(self.root / LATEST_FILE, f"{step}\n")

    def prune(self, lineage: Lineage | None = None) -> None:
        """Keep the newest ``keep_last`` complete checkpoints of ``lineage``, delete its older ones; other
        branches and unreadable ones are not touched (``lineage`` None: every checkpoint counts)."""
        if self.keep_last <= 0:
            return
        ours = []
        for step, path in complete_checkpoints(self.root):
            if lineage is not None:
                try:
                    if not _state_on_lineage(read_trainer_state(path), lineage):
                        continue
                except CheckpointReadError:
                    continue
            ours.append(path)
        for path in ours[: -self.keep_last]:
            # renamed first, so a reader (--follow, an export) sees it whole or gone, never half deleted
            doomed = path.with_name(path.name + PRUNED_SUFFIX)
            try:
                path.rename(doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``; :class:`CheckpointReadError` naming the file when
    it is missing, empty or not a trainer state."""
    file = Path(path) / TRAINER_STATE_FILE
    if not file.is_file():
        raise CheckpointReadError(f"{path} is not a complete checkpoint (no {TRAINER_STATE_FILE})")
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointReadError(f"{file} cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointReadError(f"{file} is not a trainer state (no integer 'step')")
    return state


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
