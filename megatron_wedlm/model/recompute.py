"""The activation-recomputation modes, listed once: ``BuildSettings.recompute`` and the config's
``parallelism.recompute`` read this table. A light module (no torch), so loading a config stays light."""

from __future__ import annotations

__all__ = ["RECOMPUTE_MODES"]

#: recompute nothing, core attention (``selective``), or whole layers (``full``)
RECOMPUTE_MODES = ("none", "selective", "full")
