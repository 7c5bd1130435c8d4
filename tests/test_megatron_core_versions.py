"""Checkpoints cross Megatron-Core releases: the same tiny run under this environment's release
and under another one (``MEGATRON_WEDLM_OTHER_PYTHON``, the python of a virtual environment with
another megatron-core; ``.ci/run`` points its 3.12 leg at the 3.11 leg's), each through torchrun
and ``pretrain/pretrain_wedlm.py``.

* each release's 20-step loss trajectory equals the other's;
* a ``torch_dist`` checkpoint saved by either release resumes under the other with the next losses
  of the run that saved it;
* the HF export of one checkpoint is the same files under both releases.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_wedlm.runtime.cpu import megatron_core_version
from test_training import LAUNCH_TIMEOUT, TINY, _base, data, losses  # noqa: F401  (data: the fixture)

ROOT = Path(__file__).resolve().parents[1]
OTHER_PYTHON = os.environ.get("MEGATRON_WEDLM_OTHER_PYTHON")
STEPS, SAVED = 20, 10
# Relative difference allowed between the releases' losses at one step: the two environments run
# different torch builds of one release (the CPU wheel and PyPI's CUDA wheel on a CPU).
RELATIVE_TOLERANCE = 1e-4

pytestmark = pytest.mark.skipif(
    not OTHER_PYTHON,
    reason="MEGATRON_WEDLM_OTHER_PYTHON names no python with another megatron-core (.ci/run sets it)",
)


def _run(python: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MEGATRON_WEDLM_CPU", None)
    proc = subprocess.run([python, *args], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{python} {' '.join(args[:4])}: {proc.stderr[-4000:]}"
    return proc


def _release(python: str) -> str:
    code = "from megatron_wedlm.runtime.cpu import megatron_core_version; print(megatron_core_version())"
    return _run(python, ["-c", code]).stdout.strip().splitlines()[-1]


def _train(python: str, out: Path, data_dir: str, *overrides: str) -> None:
    _run(python, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(TINY), *_base(data_dir, out),
                  f"trainer.train_steps={STEPS}", f"checkpointing.save_interval={SAVED}", "checkpointing.keep_last=2",
                  *overrides])


def _export(python: str, checkpoint: Path, out: Path) -> None:
    _run(python, [str(ROOT / "tools" / "convert_checkpoint.py"), "megatron-to-hf",
                  "--input", str(checkpoint), "--output", str(out)])


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, Path]:
    """Per release (``this``, ``other``): a straight run that saves at steps 10 and 20, a run
    resumed from the *other* release's step-10 checkpoint, and an HF export of this release's
    own step-10 checkpoint made by each release."""
    root = tmp_path_factory.mktemp("releases")
    pythons = {"this": sys.executable, "other": OTHER_PYTHON}
    releases = {name: _release(python) for name, python in pythons.items()}
    assert releases["this"] == megatron_core_version()
    assert releases["this"] != releases["other"], f"both environments hold megatron-core {releases['this']}"
    out: dict[str, Path] = {}
    for name, python in pythons.items():
        out[f"{name}/straight"] = root / name / "straight"
        _train(python, out[f"{name}/straight"], data["pretrain"])
    for name, python in pythons.items():
        saver = "other" if name == "this" else "this"
        checkpoint = out[f"{saver}/straight"] / "checkpoints" / f"iter_{SAVED:07d}"
        out[f"{name}/resumed"] = root / name / "resumed"
        _train(python, out[f"{name}/resumed"], data["pretrain"], f"checkpointing.resume={checkpoint}")
        out[f"{name}/export"] = root / name / "export"
        _export(python, out["this/straight"] / "checkpoints" / f"iter_{SAVED:07d}", out[f"{name}/export"])
    return {"releases": releases, **out}


def _assert_close(got: dict[int, float], want: dict[int, float], steps: range, what: str) -> float:
    assert set(steps) <= set(got), f"{what}: steps {sorted(got)}"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst < RELATIVE_TOLERANCE, f"{what}: largest relative difference {worst:.2e}"
    return worst


def test_loss_trajectories_agree_across_releases(runs):
    this, other = losses(runs["this/straight"]), losses(runs["other/straight"])
    assert sorted(this) == sorted(other) == list(range(1, STEPS + 1))
    _assert_close(this, other, range(1, STEPS + 1), f"{runs['releases']} straight runs")


@pytest.mark.parametrize("resumer", ["this", "other"])
def test_a_checkpoint_resumes_under_the_other_release_with_the_next_losses(runs, resumer):
    saver = "other" if resumer == "this" else "this"
    resumed, straight = losses(runs[f"{resumer}/resumed"]), losses(runs[f"{saver}/straight"])
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    what = f"saved under {runs['releases'][saver]}, resumed under {runs['releases'][resumer]}"
    _assert_close(resumed, straight, range(SAVED + 1, STEPS + 1), what)


def test_hf_export_is_the_same_files_under_both_releases(runs):
    this, other = runs["this/export"], runs["other/export"]
    names = sorted(p.name for p in this.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    assert any(name.endswith(".safetensors") for name in names)
    _, mismatch, errors = filecmp.cmpfiles(this, other, names, shallow=False)
    assert not mismatch and not errors, f"files that differ: {mismatch + errors}"
