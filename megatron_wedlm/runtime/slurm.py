"""Which SLURM job this process runs in, and whether another job still runs.

A run's lock records its SLURM job, since the job continuing a run usually starts on another
host, where the lock's pid cannot be checked; a requeued job keeps its id and counts restarts.
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["LIVE_STATES", "current_job", "job_state", "job_is_live"]

#: job states in which a job's processes may still run (``squeue``'s long names)
LIVE_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING",
                         "RESIZING", "STAGE_OUT"})


def current_job() -> dict[str, int] | None:
    """``{"job_id", "restart_count"}`` of the SLURM job this process runs in, or None outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not job_id.isdigit():
        return None
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"job_id": int(job_id), "restart_count": int(restarts) if restarts.isdigit() else 0}


def job_state(job_id: int, timeout_s: float = 30.0) -> str | None:
    """The job's state as ``squeue`` names it (``RUNNING``, ``PENDING``, ...); ``""`` for a job
    SLURM no longer lists (it ended a while ago); None when SLURM cannot be asked."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        result = subprocess.run([squeue, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                                timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        # squeue answers an id it has forgotten with an error naming it; anything else is SLURM down
        return "" if "Invalid job id" in result.stderr else None
    return result.stdout.strip().upper()


def job_is_live(job_id: int) -> bool | None:
    """Whether the job's processes may still run (:data:`LIVE_STATES`); None when SLURM cannot say."""
    state = job_state(job_id)
    return None if state is None else state in LIVE_STATES
