"""A run's lock under SLURM, against a real one-node cluster (:mod:`megatron_wedlm.testing.slurm`).

The job that continues a run after a time limit or a preemption often starts on another head
node, where the pid in the lock the stopped job left means nothing. The lock names its SLURM
job, and SLURM decides: held while that job runs, taken over once it has ended; a requeued job
(same id, one more restart) takes over the lock of its own earlier start.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from megatron_wedlm.runtime.slurm import current_job, job_is_live, job_state
from megatron_wedlm.testing.slurm import SlurmCluster, why_unavailable
from megatron_wedlm.training.run_dir import LOCK_FILE, RunDirError, RunLock, run_in_progress

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=4, gpus=1) as started:
        yield started


@pytest.fixture
def outside_a_job(monkeypatch, cluster):
    """This process as a login node sees it: SLURM's commands reach the cluster, no job of its own."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def left_on_another_host(run: Path, slurm_job: dict | None) -> None:
    """The lock a job's rank 0 on another node left (pid meaningless here)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_FILE).write_text(json.dumps({"host": "another-node", "pid": 4242, "started": "then",
                                             "run_id": "earlier", "slurm_job": slurm_job}))


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.3)


def test_a_lock_from_another_node_is_held_while_its_job_runs_and_taken_over_once_it_ended(
        cluster, outside_a_job, tmp_path):
    job = int(cluster.run("sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 300").stdout.strip())
    wait_for(lambda: job_state(job) == "RUNNING", f"job {job} running")
    run = tmp_path / "run"
    left_on_another_host(run, {"job_id": job, "restart_count": 0})
    assert run_in_progress(run)
    with pytest.raises(RunDirError, match=f"SLURM job {job}"):
        RunLock(run, "next").acquire(print)

    cluster.run("scancel", str(job))
    wait_for(lambda: job_is_live(job) is False, f"job {job} ended")
    assert job_state(job) in ("CANCELLED", "")  # listed for a while after it ended, then forgotten
    assert not run_in_progress(run)
    warnings: list[str] = []
    lock = RunLock(run, "next")
    lock.acquire(warnings.append)
    assert lock.held and "stale lock" in warnings[0]
    assert json.loads((run / LOCK_FILE).read_text())["run_id"] == "next"
    lock.release()


def test_a_job_slurm_has_forgotten_has_ended(cluster, outside_a_job):
    assert job_state(987654) == "" and job_is_live(987654) is False


def test_a_lock_taken_inside_a_job_names_the_job(cluster, tmp_path):
    code = ("import json, sys; from megatron_wedlm.training.run_dir import RunLock; "
            "lock = RunLock(sys.argv[1], 'in-a-job'); lock.acquire(print); "
            "print(json.dumps(json.load(open(lock.path)))); lock.release()")
    out = tmp_path / "job.out"
    result = cluster.run("sbatch", "--parsable", "--wait", f"--output={out}", "--wrap",
                         f"{sys.executable} -c \"{code}\" {tmp_path / 'run'}", timeout=120)
    job = int(result.stdout.strip().split(";")[0])
    holder = json.loads(out.read_text().strip().splitlines()[-1])
    assert holder["slurm_job"] == {"job_id": job, "restart_count": 0}


def test_a_requeued_job_takes_over_the_lock_of_its_own_earlier_start(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert current_job() == {"job_id": 77, "restart_count": 1}
    left_on_another_host(tmp_path / "run", {"job_id": 77, "restart_count": 0})
    lock = RunLock(tmp_path / "run", "restarted")
    lock.acquire(print)
    assert lock.held
    lock.release()
    # the same start of the same job on another node is a step running beside this one: held
    left_on_another_host(tmp_path / "beside", {"job_id": 77, "restart_count": 1})
    with pytest.raises(RunDirError, match="SLURM job 77"):
        RunLock(tmp_path / "beside", "second").acquire(print)


def test_a_lock_from_another_node_without_a_job_cannot_be_checked_and_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    left_on_another_host(tmp_path / "run", None)
    assert run_in_progress(tmp_path / "run")
    with pytest.raises(RunDirError, match="delete"):
        RunLock(tmp_path / "run", "next").acquire(print)
