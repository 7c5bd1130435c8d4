"""A run owns its ``trainer.output_dir``: one run at a time, never mixed with an earlier one.

* **Lock.** Rank 0 creates ``run.lock``; a second run is refused, naming the holder. A lock whose
  process is gone on this host, or whose SLURM job has ended, is taken over with a warning.
* **Fresh over old.** A run without ``--resume`` into a directory holding checkpoints is refused
  unless ``trainer.overwrite=true``, which moves the earlier run aside (nothing is deleted).
* **Lineage.** The run's lineage is its parent checkpoint's plus itself (:mod:`.checkpoint_index`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


from megatron_wedlm.config.schema import ConfigError, TrainConfig
from megatron_wedlm.runtime.atomic_output import pid_alive
from megatron_wedlm.runtime.rank_zero import agreed
from megatron_wedlm.runtime.slurm import current_job, job_is_live

from .checkpoint_index import (
    Lineage,
    _stderr,
    complete_checkpoints,
    read_trainer_state,
    record_lineage,
    resolve_resume_path,
)

__all__ = ["LOCK_FILE", "RunClaim", "RunDirError", "RunLock", "claim_output_dir", "new_run_id", "run_in_progress"]

LOCK_FILE = "run.lock"


class RunDirError(ConfigError):
    """The output directory is in use, or holds a run this one would silently mix with."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), which tells a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


class RunLock:
    """``<output_dir>/run.lock``: taken by rank 0 of the run that writes there."""

    def __init__(self, output_dir: str | Path, run_id: str) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "run_id": run_id,
            "command": " ".join(sys.argv),
            "slurm_job": current_job(),  # None outside SLURM
        }
        self.held = False

    def acquire(self, warn: Callable[[str], None]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released between our attempt and the read
                if not self._stale(holder):
                    job = holder.get("slurm_job")
                    in_job = f", SLURM job {job['job_id']}" if isinstance(job, dict) and "job_id" in job else ""
                    raise RunDirError(
                        f"{self.path.parent} is in use by another run (host {holder.get('host')}, pid "
                        f"{holder.get('pid')}{in_job}, started {holder.get('started')}, run {holder.get('run_id')}). Wait "
                        f"for it to end or choose another trainer.output_dir; if that run is gone (e.g. it ran "
                        f"on another host), delete {self.path}"
                    )
                warn(
                    f"warning: taking over the stale lock {self.path}: its run (pid {holder.get('pid')}, started "
                    f"{holder.get('started')}) is no longer running"
                )
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(self.holder, indent=1) + "\n")
            self.held = True
            return
        raise RunDirError(f"could not take the lock {self.path}: other runs keep taking it")

    def _read(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            return holder if isinstance(holder, dict) else {}
        except ValueError:
            return {}  # cut short by a kill between create and write: no live run writes that slowly

    def _stale(self, holder: dict[str, Any]) -> bool:
        if "pid" not in holder:
            return True
        if holder.get("host") != self.holder["host"]:
            return _slurm_job_ended(holder.get("slurm_job"))
        pid = int(holder["pid"])
        if not pid_alive(pid):
            return True
        start = holder.get("process_start")
        return start is not None and _process_start(pid) not in (None, start)  # pid reused

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("run_id") == self.holder["run_id"] and holder.get("pid") == self.holder["pid"]:
            self.path.unlink(missing_ok=True)


def _slurm_job_ended(job: Any) -> bool:
    """Whether the SLURM job a lock from another host names has ended (False: running, or cannot tell)."""
    if not isinstance(job, dict) or not isinstance(job.get("job_id"), int):
        return False
    own = current_job()
    if own is not None and own["job_id"] == job["job_id"]:
        # one job runs once at a time: a lock from an earlier start of it was left by a killed incarnation
        return int(job.get("restart_count") or 0) < own["restart_count"]
    return job_is_live(job["job_id"]) is False


def run_in_progress(output_dir: str | Path) -> bool:
    """Whether a run holds ``output_dir`` now: its lock exists and is not stale (a lock from
    another host that SLURM cannot vouch for counts as held)."""
    lock = RunLock(output_dir, run_id="")
    holder = lock._read()
    return holder is not None and not lock._stale(holder)


@dataclass
class RunClaim:
    """What :func:`claim_output_dir` decided, the same on every rank (the lock lives on rank 0)."""

    run_id: str
    resume_path: Path | None
    lineage: Lineage
    checkpoint_root: Path  # checkpointing.dir, or its default <output_dir>/checkpoints
    lock: RunLock | None = field(default=None, repr=False)

    @property
    def parent(self) -> str | None:
        return None if self.resume_path is None else str(self.resume_path)

    def checkpoint_fields(self) -> dict[str, Any]:
        """What every checkpoint of this run records about where it comes from."""
        return {"run_id": self.run_id, "parent": self.parent, "lineage": self.lineage}

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _move_aside(output_dir: Path, ckpt_root: Path, run_id: str) -> Path:
    """Move the earlier run's files (not the lock) and its checkpoints to a sibling directory."""
    aside = output_dir.with_name(f"{output_dir.name}.replaced-{run_id}")
    aside.mkdir()
    for child in sorted(output_dir.iterdir()):
        if child.name != LOCK_FILE:
            shutil.move(str(child), str(aside / child.name))
    if ckpt_root.exists():  # a checkpointing.dir outside output_dir
        shutil.move(str(ckpt_root), str(aside / "checkpoints"))
    return aside


def _claim(cfg: TrainConfig, lock: RunLock, ckpt_root: Path, warn: Callable[[str], None]) -> RunClaim:
    """Rank 0, holding ``lock``: refuse or clear a directory with an earlier run, find the
    checkpoint to resume, record the new lineage."""
    output_dir = Path(cfg.trainer.output_dir)
    run_id = lock.holder["run_id"]
    resume = cfg.checkpointing.resume
    if resume == "none":
        existing = [path.name for _, path in complete_checkpoints(ckpt_root)]
        if existing and not cfg.trainer.overwrite:
            raise RunDirError(
                f"{ckpt_root} already holds checkpoints of an earlier run ({', '.join(existing)}); a fresh run "
                "would restart at step 1 over its metrics, config and checkpoints. Continue it with --resume auto "
                "(or --resume <checkpoint>), choose another trainer.output_dir, or set trainer.overwrite=true "
                f"to move the earlier run aside to {output_dir.name}.replaced-<run id>"
            )
        leftovers = [p for p in output_dir.iterdir() if p.name != LOCK_FILE] if output_dir.is_dir() else []
        if cfg.trainer.overwrite and (leftovers or ckpt_root.exists()):
            aside = _move_aside(output_dir, ckpt_root, run_id)
            warn(f"trainer.overwrite=true: moved the earlier run in {output_dir} to {aside}")
    resume_path = resolve_resume_path(resume, ckpt_root, warn)
    if resume_path is None:
        lineage: Lineage = [{"run_id": run_id, "from_step": 0}]
    else:
        parent = read_trainer_state(resume_path)
        # a checkpoint saved before runs had ids stands for one run without an id
        before = parent.get("lineage") or [{"run_id": None, "from_step": 0}]
        lineage = [*before, {"run_id": run_id, "from_step": int(parent["step"])}]
    record_lineage(ckpt_root, lineage)
    return RunClaim(run_id=run_id, resume_path=resume_path, lineage=lineage, checkpoint_root=ckpt_root, lock=lock)


def claim_output_dir(cfg: TrainConfig, warn: Callable[[str], None] = _stderr) -> RunClaim:
    """Collective: lock ``trainer.output_dir`` on rank 0, check it against ``checkpointing.resume``
    and ``trainer.overwrite``, resolve the checkpoint root, the checkpoint to resume and the lineage.
    Every rank raises rank 0's refusal; release the claim at the end."""
    output_dir = Path(cfg.trainer.output_dir)
    ckpt_root = Path(cfg.checkpointing.dir or output_dir / "checkpoints")
    held: list[RunLock] = []

    def claim() -> RunClaim:
        lock = RunLock(output_dir, new_run_id())
        lock.acquire(warn)
        held.append(lock)
        try:
            return _claim(cfg, lock, ckpt_root, warn)
        except BaseException:
            lock.release()
            raise

    decided = agreed(claim)
    return RunClaim(decided.run_id, decided.resume_path, decided.lineage, ckpt_root, held[0] if held else None)
