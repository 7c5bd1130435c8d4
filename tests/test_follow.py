"""``inference/evaluate.py --follow`` on a real 2-process tiny training run (torchrun, wandb
offline): one row per saved checkpoint, with its training step, in ``evals.jsonl`` and in the
training run's own wandb run, read back from wandb's offline log."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_wedlm.eval.follow import EVALS_FILE, FollowSettings, follow_run, read_evals
from megatron_wedlm.eval.registry import load_task
from megatron_wedlm.eval.runner import EvalPlan
from megatron_wedlm.training.run_dir import RunLock, run_in_progress
from megatron_wedlm.testing.wandb_offline import read_history
from megatron_wedlm.training.checkpoint_index import (
    CheckpointDirectory,
    complete_checkpoints,
    lineage_checkpoints,
    read_trainer_state,
    record_lineage,
)
from test_training import LAUNCH_TIMEOUT, ROOT, TINY, _base, data  # noqa: F401

TASK_METRICS = {f"eval/counting/{config}/{name}" for config in ("streaming_tau0.4", "ar")
                for name in ("accuracy", "tokens_per_forward", "p_cache")}


def follow_command(run: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "inference" / "evaluate.py"), "--follow", str(run), "--tasks", "counting",
            "--num-examples", "2", "--methods", "streaming,ar", "--taus", "0.4", "--max-new-tokens", "8",
            "--device", "cpu", "--out", str(out), "--quiet", "--poll-interval", "0.5", *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> Path:
    """6 steps, DP=2, a checkpoint every 2 steps, all kept, wandb offline; ``--follow`` started
    before the training, running beside it. Its reports go to ``<run>.reports``."""
    out = tmp_path_factory.mktemp("follow") / "run"
    env = {k: v for k, v in ENV.items() if k != "MEGATRON_WEDLM_CPU"}
    training = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(TINY), *_base(data["pretrain"], out),
         "trainer.train_steps=6", "checkpointing.save_interval=2", "checkpointing.keep_last=0",
         "logging.wandb.enabled=true", "logging.wandb.mode=offline"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )
    try:
        follow = subprocess.run(follow_command(out, Path(f"{out}.reports")), capture_output=True, text=True,
                                timeout=LAUNCH_TIMEOUT, env=ENV, cwd=ROOT)
    finally:
        log, _ = training.communicate(timeout=LAUNCH_TIMEOUT)
    assert training.returncode == 0, log[-4000:]
    assert follow.returncode == 0, follow.stderr[-4000:]
    return out


def test_follow_beside_training_logs_one_row_per_checkpoint_to_evals_jsonl_and_the_runs_wandb(run):
    assert [step for step, _ in complete_checkpoints(run / "checkpoints")] == [2, 4, 6]
    rows = read_evals(run)
    assert [row["step"] for row in rows] == [2, 4, 6]
    for row in rows:
        assert row["run_id"] == read_trainer_state(row["checkpoint"])["run_id"]
        assert set(row["metrics"]) == TASK_METRICS
        assert Path(row["checkpoint"]).name == f"iter_{row['step']:07d}"
        report = json.loads((Path(f"{run}.reports") / f"iter_{row['step']:07d}" / "report.json").read_text())
        assert [r["num_correct"] for r in report["results"]] == [r["num_correct"] for r in row["results"]]

    # the training run's own wandb run (same id), eval metrics against the training step
    run_id = read_trainer_state(run / "checkpoints" / "iter_0000006")["wandb_run_id"]
    assert {d.name.rsplit("-", 1)[1] for d in (run / "wandb").glob("offline-run-*")} == {run_id}
    logged = [h for h in read_history(run / "wandb") if "eval/step" in h]
    assert [h["eval/step"] for h in logged] == [2, 4, 6]
    for h, row in zip(logged, rows):
        assert {k: h[k] for k in TASK_METRICS} == pytest.approx(row["metrics"])
    training = [h for h in read_history(run / "wandb") if "loss" in h]
    assert [h["_step"] for h in training] == list(range(1, 7))


def test_a_restarted_follow_carries_on_from_evals_jsonl_and_stops_at_follow_until(run, tmp_path):
    copy = tmp_path / "run"
    _copy_with_evaluated(run, copy, [2])
    proc = subprocess.run(follow_command(copy, tmp_path / "reports", "--follow-until", "4"), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [row["step"] for row in read_evals(copy)] == [2, 4]
    assert [h["eval/step"] for h in read_history(copy / "wandb") if "eval/step" in h] == [4]


def _copy_with_evaluated(run: Path, copy: Path, steps: list[int]) -> None:
    """The run without its wandb files, with ``evals.jsonl`` rows saying ``steps`` are evaluated."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("wandb", EVALS_FILE))
    states = {step: read_trainer_state(path) for step, path in complete_checkpoints(copy / "checkpoints")}
    (copy / EVALS_FILE).write_text("".join(json.dumps({"step": s, "run_id": states[s]["run_id"]}) + "\n"
                                           for s in steps))


def test_follow_ends_once_no_run_holds_the_directory_and_every_checkpoint_is_evaluated(run, tmp_path):
    """Past train_steps nothing ends it but the run: a live lock keeps it waiting, none lets it go."""
    copy = tmp_path / "run"
    _copy_with_evaluated(run, copy, [2, 4, 6])
    lock = RunLock(copy, run_id="live")
    lock.acquire(print)
    try:
        assert run_in_progress(copy)
    finally:
        lock.release()
    assert not run_in_progress(copy)
    settings = FollowSettings(EvalPlan([], ["ar"]))  # nothing is left to evaluate
    assert follow_run(copy, settings, until_step=100, poll_interval_s=0.01) == []


def test_follow_wait_bridges_the_gap_between_two_jobs_of_a_run(run, tmp_path):
    """Between the jobs of a SLURM chain no run holds the directory: without a wait the follower
    ends there; with one, the next job's checkpoint (here step 6, appearing after a second) is
    evaluated and the follower ends at train_steps, long before the wait is over."""
    copy = tmp_path / "run"
    _copy_with_evaluated(run, copy, [2, 4])
    later = tmp_path / "iter_0000006"
    shutil.move(copy / "checkpoints" / "iter_0000006", later)
    settings = FollowSettings(EvalPlan([load_task("counting", num_examples=1)], ["ar"], max_new_tokens=4),
                              device="cpu")
    assert follow_run(copy, settings, poll_interval_s=0.01) == []  # ended at the gap

    said: list[str] = []
    timer = threading.Timer(1.0, shutil.move, (later, copy / "checkpoints" / "iter_0000006"))
    timer.start()
    started = time.monotonic()
    try:
        rows = follow_run(copy, settings, poll_interval_s=0.05, wait_for_run_s=120, say=said.append)
    finally:
        timer.join()
    assert [row["step"] for row in rows] == [6] and time.monotonic() - started < 60
    assert any("waiting up to 120 s" in line for line in said)


def test_follow_passes_over_the_checkpoints_of_an_abandoned_branch(run, tmp_path):
    """A rollback to step 2 (a new run resumed from it) leaves steps 4 and 6 in an abandoned future."""
    copy = tmp_path / "run"
    _copy_with_evaluated(run, copy, [2])
    trained_by = read_trainer_state(copy / "checkpoints" / "iter_0000002")["run_id"]
    lineage = [{"run_id": trained_by, "from_step": 0}, {"run_id": "rollback", "from_step": 2}]
    record_lineage(copy / "checkpoints", lineage)
    assert [step for step, _ in lineage_checkpoints(copy / "checkpoints")] == [2]
    settings = FollowSettings(EvalPlan([], ["ar"]))  # evaluating 4 or 6 would fail: no tasks
    assert follow_run(copy, settings, poll_interval_s=0.01) == []


def test_follow_skips_a_checkpoint_pruned_as_its_turn_comes_and_carries_on(run, tmp_path):
    """keep_last prunes while the follower works (a slow evaluation, a fast training): the
    checkpoint it is about to load goes, and it notes the skip and evaluates the next one. The
    prune renames before deleting, so no reader finds a checkpoint half deleted."""
    copy = tmp_path / "run"
    _copy_with_evaluated(run, copy, [2])
    root = copy / "checkpoints"

    def say(line: str) -> None:
        said.append(line)
        if line.endswith("iter_0000004"):  # "--follow: evaluating <path>": training saved 6, keep_last=1
            CheckpointDirectory(root, keep_last=1).prune()

    said: list[str] = []
    settings = FollowSettings(EvalPlan([load_task("counting", num_examples=1)], ["ar"], max_new_tokens=4),
                              device="cpu")
    rows = follow_run(copy, settings, poll_interval_s=0.01, say=say)
    assert [row["step"] for row in rows] == [6]
    assert any("iter_0000004 was removed before it could be evaluated; skipped" in line for line in said)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000006"]  # nothing left aside
