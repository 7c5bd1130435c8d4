"""WeDLM decoding defaults that travel with an exported model, in its ``generation_config.json``.

HF keeps what a model needs to be decoded next to its weights (``generation_config.json``);
we do the same for the knobs of streaming parallel decoding, so a user who evaluates an
exported model by hand gets the operating point its trainer calibrated, not the CLI's generic
defaults. They live in one nested object so they never collide with HF's own keys::

    {"eos_token_id": 2, ..., "wedlm": {"window_size": 16, "entropy_threshold": 0.3,
                                       "distance_penalty": 0.05}}

Only the keys in :data:`DECODING_KEYS` are read or written; anything else under ``"wedlm"``
is refused, so a typo in a hand-edited file is reported instead of silently ignored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_wedlm.runtime.atomic_output import atomic_write_text

__all__ = ["DECODING_KEYS", "GENERATION_CONFIG", "read_decoding_defaults", "write_decoding_defaults"]

GENERATION_CONFIG = "generation_config.json"
SECTION = "wedlm"
# key -> type check (None is allowed for entropy_threshold: "commit one slot per forward").
DECODING_KEYS: dict[str, type | tuple[type, ...]] = {
    "window_size": int,
    "entropy_threshold": (int, float, type(None)),
    "distance_penalty": (int, float),
    "fused_refill": bool,
    "contiguous_stop": bool,
    "stop_penalty": bool,
    "leftmost_fallback": bool,
}


def _validate(values: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(values) - set(DECODING_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: unknown WeDLM decoding setting(s) {unknown}; known: {sorted(DECODING_KEYS)}"
        )
    for key, value in values.items():
        expected = DECODING_KEYS[key]
        if isinstance(value, bool) and expected is not bool:
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        if not isinstance(value, expected):
            raise ValueError(f"{where}: {key} has the wrong type ({type(value).__name__}: {value!r})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be finite, got {value!r}")
    if "window_size" in values and values["window_size"] < 1:
        raise ValueError(f"{where}: window_size must be >= 1, got {values['window_size']}")
    if values.get("distance_penalty", 0) < 0:
        raise ValueError(f"{where}: distance_penalty must be >= 0, got {values['distance_penalty']}")
    return dict(values)


def read_decoding_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The WeDLM decoding settings stored with a model; ``{}`` when it stores none.

    A missing ``generation_config.json`` is not an error (plain HF checkpoints have none); a
    present but unreadable one is, because silently falling back would change the operating point.
    """
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the generation config ({exc}); fix or delete the file") from exc
    section = data.get(SECTION, {}) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"{path}: '{SECTION}' must be an object of decoding settings, got {section!r}")
    return _validate(section, str(path))


def write_decoding_defaults(model_dir: str | Path, settings: dict[str, Any]) -> Path:
    """Merge ``settings`` into the model's ``generation_config.json`` (created if absent).

    HF keys already in the file are kept; the file is replaced atomically so a crash never
    leaves a half-written config next to good weights.
    """
    path = Path(model_dir) / GENERATION_CONFIG
    data: dict[str, Any] = {}
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
    merged = {**data.get(SECTION, {}), **_validate(settings, str(path))}
    data[SECTION] = merged
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
