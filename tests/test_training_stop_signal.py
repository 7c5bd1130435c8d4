"""A signalled run saves the step it stopped at and loses nothing (``trainer.exit_signal``).

Two gloo ranks under the real torchrun, signalled the way SLURM signals a job step at its time
limit or on ``scancel`` (SIGTERM to every process of it: torchrun, which passes it on, and its
workers), then resumed with ``--resume auto``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.testing.wandb_offline import read_history
from megatron_wedlm.training.checkpoint_index import complete_checkpoints
from megatron_wedlm.training.stop_signal import StopSignal
from test_training import LAUNCH_TIMEOUT, ROOT, TINY, _base, data, losses, torchrun, torchrun_command  # noqa: F401  (data: the fixture)

TRAIN_STEPS = 200  # far more than the test lets the first launch train


def test_a_blocked_signal_is_seen_pending_and_an_unblocked_one_is_not_asked_for():
    assert not StopSignal("SIGUSR1").armed  # not blocked: the signal keeps its default action
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        stop = StopSignal("SIGUSR1")
        assert stop.armed and stop.requested == 0.0
        # to this thread (pytest has others, which do not block it); SLURM and torchrun both send it
        for _ in range(2):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        assert stop.requested == 1.0 and stop.requested == 1.0  # asking does not take it
        assert signal.sigtimedwait({signal.SIGUSR1}, 0) is not None and stop.requested == 0.0
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    assert StopSignal(None).requested == 0.0


def test_a_signal_that_cannot_be_handled_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="trainer.exit_signal"):
        load_config(str(TINY), ["trainer.exit_signal=SIGKILL"])


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line) >= step:
            return
        assert proc.poll() is None, "the run ended before it was signalled"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {metrics} after {timeout_s} s")


def test_sigterm_saves_the_step_in_flight_and_the_resumed_run_loses_no_step(data, tmp_path):
    out = tmp_path / "run"
    args = ["--config", str(TINY), *_base(data["pretrain"], out), f"trainer.train_steps={TRAIN_STEPS}",
            "checkpointing.save_interval=0",  # no scheduled save: only the signal's
            "logging.wandb.enabled=true", "logging.wandb.mode=offline"]
    cmd, env = torchrun_command("pretrain/pretrain_wedlm.py", args)
    log = tmp_path / "first.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            _wait_for_step(out, 3, proc, LAUNCH_TIMEOUT)
            os.killpg(proc.pid, signal.SIGTERM)  # as slurmstepd does: torchrun and both workers
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    console = log.read_text()

    trained = losses(out)
    stopped_at = max(trained)
    assert 3 <= stopped_at < TRAIN_STEPS and sorted(trained) == list(range(1, stopped_at + 1)), console[-3000:]
    # the step in flight finished on both ranks and was saved whole, though no save was scheduled
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [stopped_at], console[-3000:]
    assert f"stopped by SIGTERM after step {stopped_at} of {TRAIN_STEPS}" in console
    # wandb was closed: every step the run trained is in its offline log (wandb's service runs in a
    # session of its own, out of the signalled process group; under SLURM it is signalled too, and the
    # run goes on without it: tests/test_cluster_guide.py)
    assert sorted(row["_step"] for row in read_history(out / "wandb") if "loss" in row) == list(range(1, stopped_at + 1))

    resumed = torchrun("pretrain/pretrain_wedlm.py", [*args, "--resume", "auto", f"trainer.exit_at_step={stopped_at + 2}"])
    assert f"resumed from {out}/checkpoints/iter_{stopped_at:07d}" in resumed.stderr
    assert sorted(losses(out)) == list(range(1, stopped_at + 3))  # one history, no step lost or repeated
    assert sorted(row["_step"] for row in read_history(out / "wandb") if "loss" in row) == list(range(1, stopped_at + 3))
