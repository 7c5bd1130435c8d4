"""``tools/quickstart.py``'s one call: load a preset and run the pipeline of its kind.

From-scratch presets run :class:`~megatron_wedlm.quickstart.pipeline.Quickstart`, pretrained ones
:class:`~megatron_wedlm.quickstart.real_model.RealModelQuickstart` (``quickstart/settings.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_wedlm.quickstart.pipeline import Quickstart, require_checkout
from megatron_wedlm.quickstart.real_model import RealModelQuickstart
from megatron_wedlm.quickstart.settings import REPO_ROOT, RealModelSettings, load_settings, preset_path
from megatron_wedlm.quickstart.stages import Console


def run_quickstart(out_dir: str | Path, preset: str = "full", seed: int = 0, settings_path: str | Path | None = None,
                   compare_with: str | Path | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run every stage of the preset (or of the settings file); returns the report stage's paths."""
    require_checkout(REPO_ROOT)
    settings = load_settings(settings_path or preset_path(preset))
    kind = RealModelQuickstart if isinstance(settings, RealModelSettings) else Quickstart
    return kind(out_dir, settings, seed=seed, console=console, compare_with=compare_with).run()
