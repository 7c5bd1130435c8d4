"""The layering of docs/architecture.md holds and nothing imports in a cycle: ``lint-imports``
keeps the ``.importlinter`` contracts.

Function-local imports count too (grimp reads every import statement), so a lazy import cannot
hide a dependency that points up.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"), "--no-cache", "--no-logo"],
        capture_output=True, text=True, timeout=120, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""},
    )


def test_the_package_keeps_its_layers():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_an_import_pointing_up_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "megatron_wedlm", tmp_path / "megatron_wedlm", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "megatron_wedlm" / "config" / "loading.py", "a") as handle:
        handle.write("\n\ndef _upwards():\n    from megatron_wedlm.training import loop  # noqa: F401\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode == 1
    assert "megatron_wedlm.config.loading -> megatron_wedlm.training.loop" in proc.stdout


def test_two_sibling_modules_importing_each_other_break_the_contract(tmp_path):
    shutil.copytree(ROOT / "megatron_wedlm", tmp_path / "megatron_wedlm", ignore=shutil.ignore_patterns("__pycache__"))
    decoding = tmp_path / "megatron_wedlm" / "decoding"
    for module, other in (("settings", "result"), ("result", "settings")):
        with open(decoding / f"{module}.py", "a") as handle:
            handle.write(f"\nfrom . import {other}  # noqa: F401\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode == 1
    assert "No cycles are allowed in megatron_wedlm.decoding." in proc.stdout
    assert "- .settings -> .result (1 import)" in proc.stdout or "- .result -> .settings (1 import)" in proc.stdout
