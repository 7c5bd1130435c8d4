"""What the validation curve costs a run: mean step time with and without validation, side by side.

    python tools/bench_validation.py [--steps 300] [--eval-interval 100] [--eval-iters 10] [--repeats 2]

The tiny CPU pretraining config (``configs/pretrain/tiny_cpu.yaml``: 2 layers, hidden 64, global
batches of 8 rows of 128 slots) on built-in text, prepared with ``--valid-fraction 0.1``; one
process per run (``run_training``, the Megatron engine, fp32, one thread). The two variants run
alternately (A B A B ...) so background load hits both alike; per variant the median over repeats.

* ``mean step``: wall time per training step as the run experiences it, read from
  ``metrics.jsonl``: the steps' ``step_time_s`` plus the validations' ``valid/time_s``, over the
  steps (validation amortised over its interval), leaving out the first ``--warmup`` steps;
* ``validation``: one evaluation (``eval_iters`` global batches, forward only);
* ``rows built``: building the fixed validation rows once at the start of a run (not in the steps).

The overhead is ``mean step with / mean step without``. On a shared machine the two runs see
different background load, so the same overhead is also given from inside the validating runs,
where load hits steps and validations alike: ``(steps + validations) / steps`` of those runs
(``in-run overhead``). At the default interval (100 steps) and
``eval_iters`` (10) an evaluation costs about ``eval_iters`` forward-only passes of a step, i.e.
a few steps' worth per 100 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--eval-interval", type=int, default=100, help="trainer.eval_interval of the validating run")
    p.add_argument("--eval-iters", type=int, default=10, help="trainer.eval_iters (global batches per validation)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant (alternating)")
    p.add_argument("--warmup", type=int, default=10, help="first steps of each run left out of the mean")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    if min(args.steps, args.eval_interval, args.eval_iters, args.repeats) < 1:
        p.error("--steps, --eval-interval, --eval-iters and --repeats must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    return args


def prepare(root: Path) -> Path:
    """Built-in training text with 10% of the documents held out into ``<data>/valid``."""
    from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
    from megatron_wedlm.eval.builtin_tasks import training_corpus
    from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    with open(root / "corpus.jsonl", "w") as handle:
        for doc in training_corpus(1000, seed=0):
            handle.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "data", root / "tok",
                    PrepareOptions(samples_per_shard=100, valid_fraction=0.1))
    return root / "data"


def run_worker(data: str, out: str, steps: int, warmup: int, validation: list[str]) -> dict:
    """One run in this process (a rank of a one-process launch): its step and validation wall
    times after the first ``warmup`` steps."""
    import torch

    from megatron_wedlm.config import load_config
    from megatron_wedlm.training.loop import run_training
    from megatron_wedlm.training.metrics import read_metrics
    from megatron_wedlm.training.run_data import build_valid_data, read_run_manifest, run_row_format

    torch.set_num_threads(1)
    cfg = load_config(str(TINY), [
        f"data.path={data}", f"trainer.output_dir={out}", f"trainer.train_steps={steps}", "logging.progress_bar=false",
        "logging.log_interval=1", "checkpointing.save_interval=0", "checkpointing.save_at_end=false", *validation,
    ])
    run_training(cfg)
    records = [r for r in read_metrics(out) if r["step"] > warmup]
    built = None
    if cfg.data.valid_path is not None:
        started = time.perf_counter()
        build_valid_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), 0, 1)
        built = time.perf_counter() - started
    return {
        "steps": sum(r["step_time_s"] for r in records),
        "validations": [r["valid/time_s"] for r in records if "valid/time_s" in r],
        "rows_built_s": built,
    }


def main(argv: list[str] | None = None) -> int:
    from megatron_wedlm.runtime.multiprocess import run_distributed

    args = parse_args(argv)
    variants = {
        "no validation": [],
        "validation": ["data.valid_path={data}/valid", f"trainer.eval_interval={args.eval_interval}",
                       f"trainer.eval_iters={args.eval_iters}"],
    }
    measured: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="wedlm-bench-validation-") as tmp:
        data = prepare(Path(tmp))
        for repeat in range(args.repeats):
            for name, overrides in variants.items():
                out = Path(tmp) / f"{name.replace(' ', '-')}-{repeat}"
                validation = [o.format(data=data) for o in overrides]
                env = {"OMP_NUM_THREADS": "1"}
                result = run_distributed(run_worker, 1, str(data), str(out), args.steps, args.warmup, validation,
                                         env=env, timeout_s=3600)[0]
                measured[name].append(result)

    def mean_step(run: dict) -> float:
        return (run["steps"] + sum(run["validations"])) / (args.steps - args.warmup)

    without = statistics.median(mean_step(r) for r in measured["no validation"])
    with_valid = statistics.median(mean_step(r) for r in measured["validation"])
    validations = [t for r in measured["validation"] for t in r["validations"]]
    report = {
        "steps": args.steps, "warmup": args.warmup, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters,
        "repeats": args.repeats, "validations_per_run": len(measured["validation"][0]["validations"]),
        "mean_step_s": {"no validation": without, "validation": with_valid},
        "validation_s": statistics.median(validations),
        "rows_built_s": statistics.median(r["rows_built_s"] for r in measured["validation"]),
        "overhead_ratio": with_valid / without,
        "in_run_overhead_ratio": statistics.median(
            (r["steps"] + sum(r["validations"])) / r["steps"] for r in measured["validation"]),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"tiny CPU config, {args.steps} steps, global batch 8 x 128 slots; validation every {args.eval_interval} "
          f"steps and at the end, {args.eval_iters} global batches each; median of {args.repeats} runs per variant")
    print(f"{'variant':<16}{'mean step (ms)':>16}{'validation (ms each)':>24}")
    print(f"{'no validation':<16}{without * 1e3:>16.1f}")
    print(f"{'validation':<16}{with_valid * 1e3:>16.1f}{report['validation_s'] * 1e3:>24.1f}")
    print(f"rows built once per run: {report['rows_built_s'] * 1e3:.1f} ms")
    print(f"overhead: {report['overhead_ratio']:.3f}x ({(report['overhead_ratio'] - 1) * 100:+.1f}%) between the runs, "
          f"{report['in_run_overhead_ratio']:.3f}x ({(report['in_run_overhead_ratio'] - 1) * 100:+.1f}%) inside the "
          "validating runs")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
