"""Decoding settings a caller gives: what the user gave, else what the model stores, else built-in.

A model exported by the quickstart (or by hand, :mod:`.generation_defaults`) stores the
operating point its trainer calibrated (window, tau, lambda, refill order, stop fill, stop
penalty) under ``"wedlm"`` in ``generation_config.json``, as HF keeps a model's own generation
settings next to its weights.
``inference/generate.py``, ``inference/evaluate.py`` and the ``lm_eval`` adapter resolve each of
these settings here, in one order, and report where each value came from (the command-line flags
themselves are the decoding command line, :mod:`.cli`):

* ``cli``: given on the command line (or in lm_eval's ``--model_args``);
* ``model``: stored with the model;
* ``built-in``: the default of :class:`~.settings.DecodeSettings`.
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
    """Each setting of :data:`DECODING_KEYS`: ``given`` (not None), else stored with the model, else built-in.

    Returns ``(values, sources)``; ``sources[key]`` is ``"cli"``, ``"model"`` or ``"built-in"``.
    """
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
    """``values`` less ``entropy_threshold``: the settings an evaluation applies to every tau of its sweep."""
    return {key: value for key, value in values.items() if key != "entropy_threshold"}


def describe(values: dict[str, Any], sources: dict[str, str]) -> str:
    """One line for the log: ``window_size=16 (model), entropy_threshold=0.4 (built-in), ...``."""
    return ", ".join(f"{key}={values[key]} ({sources[key]})" for key in values)
