"""The one directory where the project keeps what it can recompute (converted GGUF checkpoints,
the checks of Megatron indexed datasets), so tests, restarts and the other ranks of a node pay once."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "default_cache_dir"]

#: Names the cache directory when set (a shared or larger disk than the home directory).
CACHE_ENV = "MEGATRON_WEDLM_CACHE"


def default_cache_dir() -> Path:
    """``$MEGATRON_WEDLM_CACHE``, else ``$XDG_CACHE_HOME/megatron_wedlm``, else ``~/.cache/megatron_wedlm``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron_wedlm"
