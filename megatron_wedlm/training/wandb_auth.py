"""Whether a run can log to wandb as configured, decided before any process group exists:
``WANDB_MODE`` wins over ``logging.wandb.mode``, and an online run without credentials is refused
at once rather than failing inside ``wandb.init`` after the job queued and started.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from megatron_wedlm.config.schema import TrainConfig

__all__ = ["ONLINE_MODES", "wandb_mode", "has_wandb_credentials", "wandb_refusal"]

#: wandb's modes that reach its server
ONLINE_MODES = ("online", "run")
DEFAULT_HOST = "https://api.wandb.ai"


def wandb_mode(configured: str, environ: Mapping[str, str] = os.environ) -> str:
    """The mode a run logs in: ``WANDB_MODE`` when set, else ``logging.wandb.mode``."""
    return environ.get("WANDB_MODE") or configured


def has_wandb_credentials(environ: Mapping[str, str] = os.environ) -> bool:
    """An API key or identity token in the environment, or a netrc entry for the wandb host (what
    ``wandb login`` writes; ``NETRC`` or ``~/.netrc``), as ``wandb.init`` looks them up."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).netloc
    home = Path(environ.get("HOME") or Path.home())
    path = Path(environ["NETRC"]) if environ.get("NETRC") else home / ".netrc"
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_refusal(cfg: TrainConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this run cannot start logging to wandb here, or None when it can (or does not log)."""
    w = cfg.logging.wandb
    if not w.enabled or wandb_mode(w.mode, environ) not in ONLINE_MODES or has_wandb_credentials(environ):
        return None
    return ("logging.wandb.enabled=true logs online, but this machine has no W&B credentials (WANDB_API_KEY, "
            "or the ~/.netrc entry `wandb login` writes), so wandb.init would fail in the job. Run `wandb login` "
            "once (the key in ~/.netrc reaches jobs on a shared home), export WANDB_API_KEY, or log offline with "
            "WANDB_MODE=offline (or logging.wandb.mode=offline) and `wandb sync <output_dir>/wandb/offline-run-*` "
            "later; logging.wandb.enabled=false logs to metrics.jsonl only")
