"""Command line of ``sft/sft_wedlm.py ... trainer.backend=deepspeed``.

    torchrun --nproc_per_node G sft/sft_wedlm.py --config configs/sft/qwen3_8b_deepspeed.yaml \\
        model.init_from=/models/Qwen3-8B data.path=/data/sft trainer.backend=deepspeed

The arguments are the Megatron entry point's (``--config``, ``--resume``, ``--print-config``,
``--result-json``, ``key=value`` overrides); the entry point hands a command line over here when
``trainer.backend=deepspeed`` (override or YAML, :func:`megatron_wedlm.training.cli.requested_backend`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, task: str = "sft") -> int:
    """Exit codes as the Megatron entry point: 0 ok, 1 crash, 2 config error, 3 non-finite stop."""
    from megatron_wedlm.config.loading import config_to_yaml, load_config
    from megatron_wedlm.config.schema import ConfigError
    from megatron_wedlm.training.cli import parse_args

    from .settings import validate_deepspeed_run

    args, overrides = parse_args(argv, task)
    if args.resume is not None:
        overrides = [*overrides, f"checkpointing.resume={args.resume}"]
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.config, overrides, defaults={"trainer": {"task": task}})
        validate_deepspeed_run(cfg)
        if cfg.trainer.task != task:
            raise ConfigError(f"trainer.task={cfg.trainer.task!r} but this is the {task} entry point")
    except (ConfigError, FileNotFoundError) as err:
        if rank == 0:
            print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        if rank == 0:
            print(config_to_yaml(cfg), end="")
        return 0
    from megatron_wedlm.runtime.parallel import destroy_parallel_state
    from megatron_wedlm.training.loop import NonFiniteLossError, result_dict

    from .trainer import run_deepspeed_sft

    try:
        result = run_deepspeed_sft(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"[rank {rank}] error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"[rank {rank}] stopped: {err}", file=sys.stderr)
        return 3
    except Exception:  # noqa: BLE001 - show the traceback, exit non-zero so torchrun stops the job
        traceback.print_exc()
        return 1
    finally:
        destroy_parallel_state()
    if args.result_json and rank == 0:
        with open(args.result_json, "w") as handle:
            json.dump(result_dict(result), handle, indent=1)
    return 0
