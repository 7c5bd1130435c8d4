"""WeDLM decoding defaults stored with an exported model, under ``"wedlm"`` in its
``generation_config.json`` (clear of HF's keys); keys outside :data:`DECODING_KEYS` are refused.
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
    """The stored settings, ``{}`` without a file; an unreadable file is an error."""
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
    """Merge ``settings`` into ``generation_config.json`` (atomic; HF's keys kept)."""
    path = Path(model_dir) / GENERATION_CONFIG
    data: dict[str, Any] = {}
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
    merged = {**data.get(SECTION, {}), **_validate(settings, str(path))}
    data[SECTION] = merged
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
