"""The decoding flags shared by the decoding entry points; unset ones (None) are resolved by
:func:`megatron_wedlm.decoding.options.resolve_decoding_settings`.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_wedlm.decoding.options import FALLBACKS, ONE_SLOT, REFILL_ORDERS, STOP_FILLS


def add_decoding_arguments(parser: argparse.ArgumentParser, entropy_threshold: bool = True) -> None:
    """The decoding flags; all but ``--stop-at-eos`` default to None, "not given"."""
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
    parser.add_argument("--stop-fill", choices=sorted(STOP_FILLS), default=None,
                        help="anywhere: a stop token may fill any window slot (the reference engine); contiguous: "
                             "only a slot whose earlier slots are all filled, so a reply's end is not placed "
                             "before its text (default: the model's, else anywhere)")
    parser.add_argument("--stop-penalty", action=argparse.BooleanOptionalAction, default=None,
                        help="score a slot after masks that may hold a stop token by the chance that the reply "
                             "goes on (-log P(no stop before it) is added to its penalised entropy), so text past "
                             "a likely end is not filled on confidence alone; --no-stop-penalty is the reference "
                             "engine's rule (default: the model's, else off)")
    parser.add_argument("--fallback", choices=sorted(FALLBACKS), default=None,
                        help="the slot filled when none passes the threshold: argmin, the least penalised "
                             "entropy (the reference engine; it need not be the leftmost, and then the next "
                             "forward commits nothing); leftmost: the first mask, so every forward commits at "
                             "least one token (default: the model's, else argmin)")
    parser.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="end generation at the tokenizer's / model's EOS token(s) (default, as the reference "
                             "engine; --no-stop-at-eos decodes past them)")


def float_list(text: str) -> list[float]:
    """argparse type of ``--taus``: ``"0.2,0.3"`` -> ``[0.2, 0.3]``."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding settings given on the command line, keyed as in ``DECODING_KEYS``."""
    tau = getattr(args, "entropy_threshold", None)
    return {
        "window_size": args.window_size,
        "entropy_threshold": ONE_SLOT if tau is not None and tau < 0 else tau,
        "distance_penalty": args.distance_penalty,
        "fused_refill": None if args.refill is None else REFILL_ORDERS[args.refill],
        "contiguous_stop": None if args.stop_fill is None else STOP_FILLS[args.stop_fill],
        "stop_penalty": args.stop_penalty,
        "leftmost_fallback": None if getattr(args, "fallback", None) is None else FALLBACKS[args.fallback],
    }
