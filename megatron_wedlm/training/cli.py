"""Command line of ``pretrain/pretrain_wedlm.py`` and ``sft/sft_wedlm.py``: ``--config`` YAML,
``key=value`` overrides, ``--resume``, ``--dry-run [--world-size N]`` (:mod:`.memory_plan`). The
config is loaded and checked on every rank before any process group exists, so a typo fails at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from megatron_wedlm.config.data_check import check_data_files
from megatron_wedlm.config.loading import config_to_yaml, load_config
from megatron_wedlm.config.schema import ConfigError

from .stop_signal import block_stop_signal
from .wandb_auth import wandb_refusal

if TYPE_CHECKING:
    from megatron_wedlm.config.schema import TrainConfig

__all__ = ["MEGATRON", "Backends", "main", "parse_args", "run_entry_point"]

#: the backends an entry point runs: ``trainer.backend`` -> (check(cfg), train(cfg)); the check
#: raises ConfigError to refuse before any process group exists
Backends = Mapping[str, "tuple[Callable[[TrainConfig], None], Callable[[TrainConfig], Any]]"]


def parse_args(argv: Sequence[str] | None, task: str) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog=f"{task}_wedlm.py",
        description=f"WeDLM {task} on Megatron-Core (launch with torchrun).",
        epilog="Any other argument of the form key=value overrides the config (e.g. optimizer.lr=1e-5).",
    )
    parser.add_argument("--config", help="YAML config (see configs/); keys not given keep the schema defaults")
    parser.add_argument(
        "--resume", help="'auto' (newest complete checkpoint, if any), 'none', or a checkpoint directory; "
        "same as checkpointing.resume=...",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="check the config and its layout, print the parameter count, the parallel layout, tokens per step "
        "and memory per GPU, and exit; builds nothing, writes nothing, needs no GPU (docs/training.md)",
    )
    parser.add_argument(
        "--world-size", type=int, metavar="N",
        help="with --dry-run: the number of processes (GPUs) to plan for; default $WORLD_SIZE, else tp x pp x cp",
    )
    parser.add_argument("--result-json", help="write a JSON summary of the run here (rank 0)")
    args, rest = parser.parse_known_args(argv)
    bad = [item for item in rest if item.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.world_size is not None and (not args.dry_run or args.world_size < 1):
        parser.error("--world-size N (N >= 1) goes with --dry-run; a run's world size is torchrun's")
    return args, rest


def run_entry_point(argv: Sequence[str] | None, task: str, backends: Backends) -> int:
    """Load the config, pick its ``trainer.backend`` from ``backends``, check, train, report; exit
    codes 0 ok, 1 crash, 2 config error, 3 non-finite stop."""
    args, overrides = parse_args(argv, task)
    if args.resume is not None:
        overrides = [*overrides, f"checkpointing.resume={args.resume}"]
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.config, overrides, defaults={"trainer": {"task": task}})
        check_data_files(cfg)  # the data the config names, before any process group exists
        if cfg.trainer.task != task:
            raise ConfigError(f"trainer.task={cfg.trainer.task!r} but this is the {task} entry point")
        if cfg.trainer.backend not in backends:
            raise ConfigError(
                f"trainer.backend={cfg.trainer.backend!r}: the {task} entry point trains with "
                f"{' or '.join(backends)} (the DeepSpeed backend is for SFT: sft/sft_wedlm.py ... "
                "trainer.backend=deepspeed)"
            )
        check, train = backends[cfg.trainer.backend]
        check(cfg)
        if args.dry_run:
            plan = _dry_run(cfg, args.world_size)
        elif not args.print_config:
            refusal = wandb_refusal(cfg)  # a batch job would otherwise fail inside wandb.init, after its queue time
            if refusal:
                raise ConfigError(refusal)
    except (ConfigError, FileNotFoundError) as err:
        if rank == 0:
            print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.print_config or args.dry_run:
        if rank == 0:
            if args.print_config:
                print(config_to_yaml(cfg), end="")
            if args.dry_run:
                print(plan)
        return 0
    # before torch starts a thread: every thread and helper process inherits the blocked signal
    if not block_stop_signal(cfg.trainer.exit_signal) and cfg.trainer.exit_signal is not None and rank == 0:
        print(f"trainer.exit_signal={cfg.trainer.exit_signal} is not armed (threads were running already): "
              "the signal kills the run without a save", file=sys.stderr)
    from megatron_wedlm.runtime.parallel import destroy_parallel_state  # imports torch

    from .checkpoint_index import CheckpointReadError  # imports torch
    from .step_record import NonFiniteLossError, result_dict  # imports torch

    try:
        result = train(cfg)
    except (ConfigError, FileNotFoundError, CheckpointReadError) as err:
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


def _dry_run(cfg: TrainConfig, world_size: int | None) -> str:
    """What ``--dry-run`` prints (:mod:`.memory_plan`): world size from ``--world-size``, else
    ``$WORLD_SIZE``, else the smallest layout (dp 1)."""
    from .memory_plan import describe_plan, plan_run  # imports torch and Megatron-Core

    p = cfg.parallelism
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", p.tp * p.pp * p.cp))
    return describe_plan(plan_run(cfg, world_size), cfg)


def _no_further_checks(cfg: TrainConfig) -> None:
    """The schema's own validation (in ``load_config``) covers the Megatron backend."""


def _run_megatron(cfg: TrainConfig):
    from .loop import run_training  # imports torch

    return run_training(cfg)


MEGATRON: Backends = {"megatron": (_no_further_checks, _run_megatron)}


def main(argv: Sequence[str] | None = None, task: str = "pretrain") -> int:
    """The Megatron-Core entry point (``trainer.backend=megatron``)."""
    return run_entry_point(argv, task, MEGATRON)
