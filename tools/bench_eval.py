#!/usr/bin/env python
"""Evaluation wall time: one prompt at a time vs accuracy mode (batched) vs accuracy mode on 2 processes.

Three runs of the real command line, ``inference/evaluate.py``, on the same model, tasks and
prompts, one after the other in one invocation so the ratios come from one machine state:

1. **one at a time**: ``--speed-examples all``, every example decoded alone and timed, methods
   interleaved per example (the single-stream protocol, what every evaluation did before
   accuracy mode);
2. **accuracy mode, 1 process**: ``--speed-examples 0 --batch-size B``, every example in
   continuous batches (a finished row's place goes to the next prompt);
3. **accuracy mode, N processes**: the same under ``torchrun --nproc_per_node N`` (one model
   replica and one thread per process), one report.

Each process decodes with one thread (``OMP_NUM_THREADS=1``). Printed per run: the wall time of
the whole command (start-up and model load included) and of the evaluation alone (what
``evaluate.py`` reports). Then the ratios against the targets (accuracy mode >= 3x faster than
one at a time; N = 2 processes <= 0.6x the wall time of one), and whether the per-example
outputs (completion, tokens, forwards) of all three runs are equal and the 1- and N-process
reports equal without their timings.

``--model`` takes an HF export, e.g. the quickstart's WeDLM model (``<quickstart out>/hf/wedlm``);
without it a random model of the quickstart's shape (6 layers, hidden 128, FFN 256, 4 query /
2 KV heads) is built and saved to a temporary directory, its output layer scaled up so parallel
decoding fills several slots per forward, as a trained model does on these tasks.

    python tools/bench_eval.py                                   # 100 prompts per built-in task
    python tools/bench_eval.py --model runs/quickstart/hf/wedlm --num-examples 100
    python tools/bench_eval.py --num-examples 10                 # a quick check that it works
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_wedlm.eval import EvalReport
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"seconds", "tokens_per_second", "speedup_vs_ar", "timed_examples", "timed_tokens"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF export to evaluate (default: a random quickstart-shaped model)")
    p.add_argument("--tasks", default="counting,copying,arithmetic")
    p.add_argument("--num-examples", type=int, default=100, help="prompts per built-in task")
    p.add_argument("--methods", default="streaming,blockwise,ar")
    p.add_argument("--taus", default="0.4")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--nproc", type=int, default=2, help="processes of the sharded run")
    p.add_argument("--output-scale", type=float, default=60.0, help="output-layer scale of the random model")
    p.add_argument("--work-dir", default=None, help="where reports go (default: a temporary directory)")
    return p


def random_export(directory: Path, output_scale: float) -> Path:
    """A random model of the quickstart's shape, with the tiny test tokenizer, saved as an HF export."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch="qwen2", hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(output_scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run(name: str, launcher: list[str], args: argparse.Namespace, model: str, out: Path,
        extra: list[str]) -> tuple[float, float, EvalReport]:
    cmd = [*launcher, str(ROOT / "inference" / "evaluate.py"), "--model", model, "--tasks", args.tasks,
           "--num-examples", str(args.num_examples), "--methods", args.methods, "--taus", args.taus,
           "--device", "cpu", "--dtype", "float32", "--quiet", "--out", str(out), *extra]
    if args.max_new_tokens is not None:
        cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    print(f"[{name}] {' '.join(cmd[len(launcher):][:1] + extra)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"[{name}] failed ({done.returncode}):\n{done.stderr[-4000:]}")
    found = re.search(r"\(evaluation ([\d.]+) s\)", done.stderr)
    return wall, float(found.group(1)) if found else float("nan"), EvalReport.load(str(out / "report.json"))


def per_example(report: EvalReport) -> list[tuple]:
    return [(s.task, s.method, s.tau, s.uid, s.completion, s.new_tokens, s.forwards) for s in report.samples]


def without_timings(report: EvalReport) -> dict:
    d = copy.deepcopy(report.to_dict())
    for section in ("results", "samples"):
        d[section] = [{k: v for k, v in row.items() if k not in TIMING} for row in d[section]]
    for key in ("time", "processes"):
        d["settings"].pop(key, None)
    return d


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as tmp:
        work = Path(args.work_dir or tmp)
        model = args.model or str(random_export(work / "model", args.output_scale))
        python = [sys.executable]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        batched = ["--speed-examples", "0", "--batch-size", str(args.batch_size)]
        runs = {
            "one at a time": run("one at a time", python, args, model, work / "alone", ["--speed-examples", "all"]),
            "accuracy mode, 1 process": run("accuracy mode, 1 process", python, args, model, work / "batched",
                                            batched),
            f"accuracy mode, {args.nproc} processes": run(f"accuracy mode, {args.nproc} processes", torchrun, args,
                                                          model, work / "sharded", batched),
        }
        (alone, one, many) = runs.values()
        print(f"\nmodel {model}; tasks {args.tasks}, {args.num_examples} prompts each; methods {args.methods}, "
              f"taus {args.taus}; batch {args.batch_size}; {torch.get_num_threads()} threads here, 1 per run process")
        print(f"{'run':<28} {'command wall (s)':>16} {'evaluation (s)':>15}")
        for name, (wall, evaluation, _) in runs.items():
            print(f"{name:<28} {wall:>16.1f} {evaluation:>15.1f}")
        print(f"\naccuracy mode vs one at a time: {alone[1] / one[1]:.2f}x faster (evaluation; target >= 3x), "
              f"{alone[0] / one[0]:.2f}x (command)")
        print(f"{args.nproc} processes vs 1: {many[1] / one[1]:.2f}x the wall time (evaluation; target <= 0.6x), "
              f"{many[0] / one[0]:.2f}x (command)")
        same = per_example(alone[2]) == per_example(one[2]) == per_example(many[2])
        print(f"per-example outputs equal in all three runs: {'yes' if same else 'NO'}")
        print(f"1- and {args.nproc}-process reports equal (timings aside): "
              f"{'yes' if without_timings(one[2]) == without_timings(many[2]) else 'NO'}")
        rows = [(r.task, r.label, f"{r.accuracy:.1%}") for r in one[2].results]
        print("accuracy: " + "; ".join(f"{t} {m} {a}" for t, m, a in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
