"""Pretraining with context parallelism: the training loop at CP=2, and its checkpoint resumed at CP=1.

One 2-rank launch (real gloo processes, the tiny CPU config): a CP=2 run (each row split over
both ranks) for 20 steps saving at 10, then a CP=1 run (DP=2) resumed from that step-10
checkpoint. From the same weights, optimizer state and data, the CP=1 steps 11..20 must
reproduce the CP=2 ones: losses, masked-token counts and gradient norms (fp32 reduction order
only). Config-time refusals of combinations that cannot run need no launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_wedlm.config import ConfigError, config_from_yaml_text, load_config
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.training.metrics import read_metrics

from test_training import LAUNCH_TIMEOUT, TINY, _base, _train, data  # noqa: F401  (data: the fixture)


def cp_worker(pretrain: str, root: str) -> dict:
    cp2, cp1 = Path(root) / "cp2", Path(root) / "cp1"
    _train(str(TINY), [*_base(pretrain, cp2), "parallelism.cp=2", "trainer.train_steps=20",
                       "checkpointing.save_interval=10"])
    resumed = _train(str(TINY), [*_base(pretrain, cp1), "trainer.train_steps=20",
                                 f"checkpointing.resume={cp2 / 'checkpoints' / 'iter_0000010'}"])
    return {"resumed": resumed}


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("cp")
    result = run_distributed(cp_worker, 2, data["pretrain"], str(root), timeout_s=LAUNCH_TIMEOUT)[0]
    return result, root


def test_cp2_trains_and_its_checkpoint_resumes_at_cp1_on_the_same_trajectory(runs):
    result, root = runs
    cp2 = {r["step"]: r for r in read_metrics(root / "cp2")}
    cp1 = {r["step"]: r for r in read_metrics(root / "cp1")}
    layout = config_from_yaml_text((root / "cp2" / "config.yaml").read_text()).parallelism
    assert (layout.cp, layout.dp) == (2, 1)  # both ranks held parts of the same rows
    assert sorted(cp2) == list(range(1, 21))
    first, last = (sum(cp2[s]["loss"] for s in steps) / 5 for steps in (range(1, 6), range(16, 21)))
    assert last < first - 0.5, (first, last)
    assert result["resumed"]["start_step"] == 10 and sorted(cp1) == list(range(11, 21))
    for step in range(11, 21):
        assert cp1[step]["masked_tokens"] == cp2[step]["masked_tokens"]  # counted once per row, not per CP rank
        assert cp1[step]["loss"] == pytest.approx(cp2[step]["loss"], abs=1e-5)
        assert cp1[step]["grad_norm"] == pytest.approx(cp2[step]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallelism.cp=2", "model.attention_backend=te"], "attention_backend=te"),
        (["parallelism.cp=4", "data.seq_length=132"], "multiple of 2 x parallelism.cp = 8"),
        (["parallelism.cp=2", "parallelism.tp=4", "parallelism.sequence_parallel=true", "data.seq_length=132"],
         "multiple of parallelism.cp x parallelism.tp = 8"),
        (["parallelism.virtual_pp=2"], "needs parallelism.pp > 1"),
        (["parallelism.pp=2", "parallelism.virtual_pp=3"], "multiple of parallelism.pp x parallelism.virtual_pp"),
    ],
)
def test_combinations_that_cannot_run_are_refused_at_config_time(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(TINY), [*_base(str(tmp_path), tmp_path / "out"), *overrides])
