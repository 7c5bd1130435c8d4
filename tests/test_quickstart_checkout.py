"""The quickstart runs the repository's entry points: without a checkout around the package it
says so, naming where it looked, before it writes anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_wedlm.quickstart.pipeline import CHECKOUT_PATHS, require_checkout

ROOT = Path(__file__).resolve().parents[1]


def test_this_checkout_has_everything_the_quickstart_runs():
    require_checkout(ROOT)
    assert {"pretrain/pretrain_wedlm.py", "sft/sft_wedlm.py", "inference/evaluate.py"} <= set(CHECKOUT_PATHS)


def test_a_directory_without_the_entry_points_is_refused_with_the_path_and_the_remedy(tmp_path):
    with pytest.raises(ValueError) as err:
        require_checkout(tmp_path)
    message = str(err.value)
    assert "needs a checkout" in message and str(tmp_path) in message and "pip install -e ." in message
    assert all(path in message for path in CHECKOUT_PATHS)


def test_quickstart_from_an_installed_copy_of_the_package_says_it_needs_a_checkout(tmp_path):
    site = tmp_path / "site-packages"  # the package alone, as a wheel installs it
    shutil.copytree(ROOT / "megatron_wedlm", site / "megatron_wedlm", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "quickstart.py"), "--preset", "ci", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a checkout" in proc.stderr and "pip install -e ." in proc.stderr
    assert f"{site} has no tools/prepare_data.py, pretrain/pretrain_wedlm.py" in proc.stderr
    assert not out.exists()
