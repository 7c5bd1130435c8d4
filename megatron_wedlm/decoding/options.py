"""Decoding settings of the command lines: what the user gave, else what the model stores, else built-in.

A model exported by the quickstart (or by hand, :mod:`.generation_defaults`) stores the
operating point its trainer calibrated (window, tau, lambda, refill order) under ``"wedlm"`` in
``generation_config.json``, as HF keeps a model's own generation settings next to its weights.
``inference/generate.py``, ``inference/evaluate.py`` and the ``lm_eval`` adapter resolve each of
these settings here, in one order, and report where each value came from:

* ``cli``: given on the command line (or in lm_eval's ``--model_args``);
* ``model``: stored with the model;
* ``built-in``: the default of :class:`~.settings.DecodeSettings`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .generation_defaults import DECODING_KEYS, read_decoding_defaults
from .settings import DecodeSettings

CLI, MODEL, BUILT_IN = "cli", "model", "built-in"
REFILL_ORDERS = {"fused": True, "paper": False}  # name -> fused_refill
#: ``entropy_threshold`` given as "one slot per forward" (tau = None, which otherwise means "not given")
ONE_SLOT = "one-slot"


def add_decoding_arguments(parser: argparse.ArgumentParser, entropy_threshold: bool = True) -> None:
    """``--window-size``, ``--entropy-threshold``, ``--distance-penalty``, ``--refill`` and ``--stop-at-eos``.

    The first four default to None = "not given", so the model's stored value can apply.
    """
    parser.add_argument("--window-size", type=int, default=None,
                        help="window W (default: the model's generation_config.json, else 16)")
    if entropy_threshold:
        parser.add_argument("--entropy-threshold", type=float, default=None,
                            help="fill every slot whose penalised entropy is below this; negative = one slot per "
                                 "step (default: the model's, else 0.4)")
    parser.add_argument("--distance-penalty", type=float, default=None, help="lambda (default: the model's, else 0.02)")
    parser.add_argument("--refill", choices=sorted(REFILL_ORDERS), default=None,
                        help="fused: the reference engine's schedule (the window is refilled before the forward, "
                             "so committing needs no forward of its own); paper: Algorithm 1's step order "
                             "(default: the model's, else fused)")
    parser.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="end generation at the tokenizer's / model's EOS token(s) (default, as the reference "
                             "engine; --no-stop-at-eos decodes past them)")


def float_list(text: str) -> list[float]:
    """argparse type of ``--taus``: ``"0.2,0.3"`` -> ``[0.2, 0.3]``; a bad item is an error naming the flag."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding settings given on the command line (None: not given), keyed as in :data:`DECODING_KEYS`."""
    tau = getattr(args, "entropy_threshold", None)
    return {
        "window_size": args.window_size,
        "entropy_threshold": ONE_SLOT if tau is not None and tau < 0 else tau,
        "distance_penalty": args.distance_penalty,
        "fused_refill": None if args.refill is None else REFILL_ORDERS[args.refill],
    }


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


def describe(values: dict[str, Any], sources: dict[str, str]) -> str:
    """One line for the log: ``window_size=16 (model), entropy_threshold=0.4 (built-in), ...``."""
    return ", ".join(f"{key}={values[key]} ({sources[key]})" for key in values)
