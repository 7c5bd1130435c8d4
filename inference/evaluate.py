#!/usr/bin/env python
"""Evaluate a WeDLM checkpoint: accuracy and speed of streaming, block-wise and AR decoding.

Example::

    python inference/evaluate.py --model /ckpt/wedlm-8b \\
        --tasks counting,copying,arithmetic,humaneval,gsm8k:/data/gsm8k_test.jsonl \\
        --methods streaming,blockwise,ar --taus 0.2,0.4,0.6 --limit 50 --out runs/eval

Writes ``report.json``, ``report.md`` and ``speed_accuracy.png`` into ``--out``; the settings in
``report.json`` record the refill schedule used (``--refill fused``, the reference engine's, by
default; ``paper`` for Algorithm 1's step order) and whether EOS stopped generation.
Window size, distance penalty, refill order and (without ``--taus``) the entropy threshold
default to the values stored with the model (``"wedlm"`` in ``generation_config.json``), else
to the built-in ones; ``settings.decoding_sources`` in ``report.json`` says for each whether it
came from the command line, the model or the built-in default. Task specs and
jsonl fields are documented in ``megatron_wedlm.eval`` (``registry``, ``jsonl_tasks``,
``code_tasks``). Generated code (humaneval, mbpp) is executed in a resource-limited subprocess
that is *not* a security sandbox: run on a machine without network or valuable data.

Accuracy and speed are measured apart: the first ``--speed-examples`` examples of each task are
decoded one at a time, interleaved over the methods, and give tokens/s and the speed-up; every
other example is decoded in batches of ``--batch-size`` rows (``megatron_wedlm.eval.runner``).
Spread over devices and nodes with torchrun, one model replica per process, one report::

    torchrun --nproc_per_node 8 inference/evaluate.py --model /ckpt/wedlm-8b --tasks gsm8k:/data/gsm8k.jsonl \
        --out runs/eval

Every finished decode is kept in ``<out>/parts/rank{r}.jsonl``; running the same command again
after an interruption decodes only what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_wedlm.decoding import METHODS
from megatron_wedlm.decoding.cli import add_decoding_arguments, cli_values, float_list
from megatron_wedlm.decoding.inputs import DTYPES
from megatron_wedlm.decoding.options import describe, resolve_decoding_settings, window_settings
from megatron_wedlm.decoding.settings import DecodeSettings
from megatron_wedlm.eval import evaluate, load_tasks, write_report
from megatron_wedlm.eval.follow import FollowSettings, follow_run
from megatron_wedlm.eval.runner import BATCH_SIZE, SPEED_EXAMPLES, EvalPlan
from megatron_wedlm.eval.sharding import Shard
from megatron_wedlm.training.hf_export import load_checkpoint, training_checkpoint


def _mapping(text: str) -> dict[str, str]:
    """``"gsm8k=8,arc=25"`` -> ``{"gsm8k": "8", "arc": "25"}``."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE items, got {item!r}")
        out[key.strip().lower()] = value.strip()
    return out


def _count_or_all(text: str) -> int | None:
    """``"16"`` -> 16, ``"all"`` -> None."""
    if text.strip().lower() == "all":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'all', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model",
                        help="HF checkpoint directory, or a Megatron training checkpoint (iter_N) or run directory "
                             "(its newest complete checkpoint)")
    source.add_argument("--follow", metavar="RUN_DIR", default=None,
                        help="instead of --model: evaluate each checkpoint of a training run once it is complete, "
                             "while it trains; rows in RUN_DIR/evals.jsonl and the run's wandb run, reports in "
                             "--out/iter_N (see megatron_wedlm.eval.follow)")
    p.add_argument("--follow-until", type=int, default=None,
                   help="stop once the run saved a checkpoint at or past this step and those up to it are "
                        "evaluated (default: the run's train_steps)")
    p.add_argument("--follow-wait", type=float, default=0.0, metavar="SECONDS",
                   help="once no run is training in RUN_DIR and every checkpoint is evaluated, wait this long for "
                        "a job that continues the run (the next job of a SLURM chain, a requeue) before ending "
                        "(default 0)")
    p.add_argument("--poll-interval", type=float, default=60.0, help="seconds between looks for new checkpoints")
    p.add_argument("--tasks", default="counting,copying,arithmetic",
                   help="comma-separated task specs: NAME or NAME:PATH.jsonl")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--taus", type=float_list, default=None,
                   help="entropy thresholds swept for streaming and block-wise (default: the model's "
                        "entropy_threshold, else 0.4)")
    p.add_argument("--out", required=True, help="output directory for report.json/.md/.png")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most N examples per task")
    p.add_argument("--num-examples", type=int, default=50, help="examples per built-in task")
    p.add_argument("--seed", type=int, default=0, help="seed of built-in tasks and of sampling")
    p.add_argument("--shots", type=_mapping, default={}, help="shots per task, e.g. gsm8k=8,arc=25")
    p.add_argument("--shots-file", type=_mapping, default={},
                   help="few-shot source per task, e.g. gsm8k=/data/gsm8k_train.jsonl")
    add_decoding_arguments(p, entropy_threshold=False)
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on every task's budget")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="wrap prompts with the chat template")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                   help="rows decoded together in accuracy mode (streaming/block-wise: a finished row's place "
                        "goes to the next prompt; AR: batches of one token budget)")
    p.add_argument("--speed-examples", type=_count_or_all, default=SPEED_EXAMPLES,
                   help="examples per task decoded one at a time and timed (tokens/s, speed-up); 'all' times "
                        "every example")
    p.add_argument("--device", default=None,
                   help="default: cuda if available (under torchrun: cuda:LOCAL_RANK), else cpu")
    p.add_argument("--device-map", default=None,
                   help="place a model too big for one GPU over several, e.g. 'auto' (transformers' device_map); "
                        "under torchrun each process gets its node's GPUs in equal shares")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--mask-token-id", type=int, default=None, help="override config.mask_token_id")
    p.add_argument("--sandbox-timeout", type=float, default=10.0, help="seconds per program")
    p.add_argument("--sandbox-memory-mb", type=int, default=1024)
    p.add_argument("--sandbox-workers", type=int, default=4)
    p.add_argument("--no-samples", action="store_true", help="leave per-example outputs out of the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


@record  # under torchrun, a failing rank's traceback is what the launcher reports
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be at least 1, got {args.batch_size}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        shots = {k: int(v) for k, v in args.shots.items()}
    except ValueError:
        raise SystemExit(f"--shots values must be integers, got {args.shots}") from None
    shard = Shard.from_environment()
    try:
        return _evaluate(args, methods, shots, shard)
    finally:
        shard.close()


def _evaluate(args: argparse.Namespace, methods: list[str], shots: dict[str, int], shard: Shard) -> int:
    talk = not args.quiet and shard.rank == 0
    tasks = load_tasks(
        args.tasks, shots=shots, shots_paths=args.shots_file, limit=args.limit,
        num_examples=args.num_examples, seed=args.seed, sandbox_timeout_s=args.sandbox_timeout,
        sandbox_memory_mb=args.sandbox_memory_mb, sandbox_workers=args.sandbox_workers,
    )
    if talk:
        for task in tasks:
            if task.data_files:
                print(f"{task.name}: read {', '.join(task.data_files)}", file=sys.stderr)
    if args.follow:
        if shard.world > 1:
            raise SystemExit("--follow evaluates checkpoints one after another in one process: run it without torchrun")
        return _follow(args, tasks, methods)
    model, tokenizer = load_checkpoint(
        args.model, device=_device(args.device, shard), dtype=args.dtype,
        require_mask_token=args.mask_token_id is None and methods != ["ar"], **_placement(args.device_map, shard),
    )
    given = cli_values(args) | {"entropy_threshold": args.taus[0] if args.taus else None}
    values, sources = resolve_decoding_settings(given, args.model)
    taus = args.taus or [values["entropy_threshold"]]
    if taus == [None]:
        raise SystemExit(f"{args.model} stores entropy_threshold null (one slot per forward), which cannot be swept; "
                         "pass --taus")
    if talk:
        print(f"model {args.model} on {next(model.parameters()).device}"
              + (f" ({shard.world} processes)" if shard.world > 1 else "") + "; tasks: "
              + ", ".join(f"{t.name} ({len(t.examples)})" for t in tasks), file=sys.stderr)
        print(f"decoding settings: {describe(values, sources)}", file=sys.stderr)
    start = time.perf_counter()
    plan = _plan(args, tasks, methods, progress=talk)
    plan = dataclasses.replace(
        plan, taus=taus, model_name=args.model, shard=shard,
        settings=DecodeSettings.build(plan.settings, **window_settings(values)), parts_dir=os.path.join(args.out, "parts"),
        identity=_checkpoint_identity(training_checkpoint(args.model) or args.model),
    )
    report = evaluate(model, tokenizer, plan)
    if report is None:  # not rank 0: its decodes went into rank 0's report
        return 0
    report.settings["decoding_sources"] = sources  # where window, tau, lambda, refill and stop fill came from
    paths = write_report(report, args.out)
    with open(paths["markdown"], encoding="utf-8") as f:
        print(f.read())
    print("wrote " + ", ".join(paths.values()) + f" (evaluation {time.perf_counter() - start:.1f} s)",
          file=sys.stderr)
    return 0


def _follow(args: argparse.Namespace, tasks: list, methods: list[str]) -> int:
    """``--follow``: evaluate every checkpoint of a training run as it appears."""
    plan = _plan(args, tasks, methods, progress=not args.quiet)
    settings = FollowSettings(plan, device=args.device, dtype=args.dtype, decoding=cli_values(args),
                              report_dir=args.out)
    follow_run(args.follow, settings, until_step=args.follow_until, poll_interval_s=args.poll_interval,
               wait_for_run_s=args.follow_wait)
    return 0


def _plan(args: argparse.Namespace, tasks: list, methods: list[str], progress: bool) -> EvalPlan:
    """The evaluation the command line asks for, less what each model adds: its window settings and tau."""
    sampling = DecodeSettings(mask_token_id=args.mask_token_id, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p)
    return EvalPlan(tasks, methods, taus=args.taus or (), settings=sampling, max_new_tokens=args.max_new_tokens,
                    stop_at_eos=args.stop_at_eos, seed=args.seed, chat=args.chat, batch_size=args.batch_size,
                    speed_examples=args.speed_examples, keep_samples=not args.no_samples, progress=progress)


def _device(device: str | None, shard: Shard) -> str | None:
    """``--device``; under torchrun a plain ``cuda`` (or the default on a GPU machine) is this process's GPU."""
    if device in (None, "cuda") and torch.cuda.is_available() and shard.world > 1:
        return f"cuda:{shard.local_rank}"
    return device


def _placement(device_map: str | None, shard: Shard) -> dict:
    """``device_map`` and, with several processes on a node, ``max_memory`` limiting each to its share of GPUs."""
    if device_map is None:
        return {}
    if not torch.cuda.is_available():
        raise SystemExit("--device-map spreads a model over GPUs, and none is available here: leave it out on CPU")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = torch.cuda.device_count() // per_node
    if share < 1:
        raise SystemExit(f"--device-map with {per_node} processes per node needs at least {per_node} GPUs, "
                         f"this node has {torch.cuda.device_count()}")
    if per_node == 1:
        return {"device_map": device_map}
    mine = range(shard.local_rank * share, (shard.local_rank + 1) * share)
    return {"device_map": device_map,
            "max_memory": {i: torch.cuda.get_device_properties(i).total_memory for i in mine}}


def _checkpoint_identity(path: str) -> dict[str, list[int]]:
    """Size and modification time of every checkpoint file: a retrained model makes kept decodes stale."""
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


if __name__ == "__main__":
    sys.exit(main())
