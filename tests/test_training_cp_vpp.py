"""Pretraining with context parallelism and with the interleaved pipeline, each resumed in a plain layout.

One 2-rank launch (real gloo processes, the tiny CPU config):

* a CP=2 run (each row split over both ranks) for 20 steps saving at 10, then a CP=1 run
  (DP=2) resumed from that step-10 checkpoint;
* a PP=2 x virtual_pp=2 run (4 layers, one per model chunk) the same way, resumed at PP=1.

From the same weights, optimizer state and data, the resumed steps 11..20 must reproduce the
parallel run's: losses, masked-token counts and gradient norms (fp32 reduction order only).
Config-time refusals of combinations that cannot run need no launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_wedlm.config import ConfigError, config_from_yaml_text, load_config
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.training.metrics import read_metrics

from test_training import (  # noqa: F401  (data: the fixture)
    LAUNCH_TIMEOUT, TINY, _base, _train, _validation, data, valid_losses,
)


LAYOUTS = {
    "cp2": ["parallelism.cp=2"],
    "pp2-vpp2": ["parallelism.pp=2", "parallelism.virtual_pp=2", "model.num_layers=4"],
}
PLAIN = {"cp2": [], "pp2-vpp2": ["model.num_layers=4"]}  # what each resumes under (DP=2)


def layouts_worker(data: dict[str, str], root: str) -> dict:
    out = {}
    validation = _validation(data)  # every 10 steps: at 10 and 20
    for name, overrides in LAYOUTS.items():
        parallel, plain = Path(root) / name, Path(root) / f"{name}-resumed"
        _train(str(TINY), [*_base(data["pretrain"], parallel), *overrides, *validation, "trainer.train_steps=20",
                           "checkpointing.save_interval=10"])
        out[name] = _train(str(TINY), [*_base(data["pretrain"], plain), *PLAIN[name], *validation,
                                       "trainer.train_steps=20",
                                       f"checkpointing.resume={parallel / 'checkpoints' / 'iter_0000010'}"])
    return out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("layouts")
    result = run_distributed(layouts_worker, 2, data, str(root), timeout_s=LAUNCH_TIMEOUT)[0]
    return result, root


def test_cp2_run_splits_rows_over_both_ranks(runs):
    _, root = runs
    layout = config_from_yaml_text((root / "cp2" / "config.yaml").read_text()).parallelism
    assert (layout.cp, layout.dp) == (2, 1)


def test_pp2_vpp2_run_has_two_chunks_per_stage(runs):
    _, root = runs
    layout = config_from_yaml_text((root / "pp2-vpp2" / "config.yaml").read_text()).parallelism
    assert (layout.pp, layout.virtual_pp, layout.dp) == (2, 2, 1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_run_trains_and_resumes_in_the_plain_layout_on_the_same_trajectory(runs, name):
    result, root = runs
    parallel = {r["step"]: r for r in read_metrics(root / name)}
    plain = {r["step"]: r for r in read_metrics(root / f"{name}-resumed")}
    assert sorted(parallel) == list(range(1, 21))
    first, last = (sum(parallel[s]["loss"] for s in steps) / 5 for steps in (range(1, 6), range(16, 21)))
    assert last < first - 0.5, (first, last)
    assert result[name]["start_step"] == 10 and sorted(plain) == list(range(11, 21))
    for step in range(11, 21):
        assert plain[step]["masked_tokens"] == parallel[step]["masked_tokens"]  # each row counted once
        assert plain[step]["loss"] == pytest.approx(parallel[step]["loss"], abs=1e-5)
        assert plain[step]["grad_norm"] == pytest.approx(parallel[step]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_run_validates_as_the_plain_layout_does(runs, name):
    """The step-20 validation of the CP=2 (PP=2 x VPP=2) run and of its DP=2 continuation: the same
    held-out rows on the same trajectory give the same number (fp32 reduction order only), with
    every masked token counted once."""
    _, root = runs
    parallel = {r["step"]: r for r in read_metrics(root / name) if "valid/loss" in r}
    plain = {r["step"]: r for r in read_metrics(root / f"{name}-resumed") if "valid/loss" in r}
    assert sorted(parallel) == [10, 20] and sorted(plain) == [20]
    for key in ("valid/loss", "valid/mlm_loss", "valid/ar_loss"):
        assert plain[20][key] == pytest.approx(parallel[20][key], abs=1e-5), key
    for key in ("valid/masked_tokens", "valid/ar_tokens", "valid/tokens"):
        assert plain[20][key] == parallel[20][key] == parallel[10][key], key
    assert valid_losses(root / name)[20] < valid_losses(root / name)[10]


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
