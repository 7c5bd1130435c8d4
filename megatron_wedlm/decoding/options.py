"""Decoding settings a caller gives: the command line's, else the model's stored ones
(:mod:`.generation_defaults`), else :class:`~.settings.DecodeSettings`' defaults, with sources.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .generation_defaults import DECODING_KEYS, read_decoding_defaults
from .settings import DecodeSettings

CLI, MODEL, BUILT_IN = "cli", "model", "built-in"
REFILL_ORDERS = {"fused": True, "paper": False}  # name -> fused_refill
STOP_FILLS = {"anywhere": False, "contiguous": True}  # name -> contiguous_stop
FALLBACKS = {"argmin": False, "leftmost": True}  # name -> leftmost_fallback
#: ``entropy_threshold`` given as "one slot per forward" (tau = None, which otherwise means "not given")
ONE_SLOT = "one-slot"


def resolve_decoding_settings(
    given: dict[str, Any], model_dir: str | Path | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, sources)`` of :data:`DECODING_KEYS`; sources: cli, model or built-in."""
    stored = read_decoding_defaults(model_dir) if model_dir is not None else {}
    built_in = DecodeSettings()
    values, sources = {}, {}
    for key in DECODING_KEYS:
        if given.get(key) is not None:
            values[key], sources[key] = (None if given[key] == ONE_SLOT else given[key]), CLI
        elif key in stored:
            values[key], sources[key] = stored[key], MODEL
        else:
            values[key], sources[key] = getattr(built_in, key), BUILT_IN
    return values, sources


def window_settings(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` less ``entropy_threshold`` (what a tau sweep shares)."""
    return {key: value for key, value in values.items() if key != "entropy_threshold"}


def describe(values: dict[str, Any], sources: dict[str, str]) -> str:
    """One log line: ``window_size=16 (model), ...``."""
    return ", ".join(f"{key}={values[key]} ({sources[key]})" for key in values)
