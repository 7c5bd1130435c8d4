#!/usr/bin/env python
"""Score saved completions without generating again: accuracy per task and configuration.

Examples::

    # a report's samples, against the data file the report was made from
    python inference/score.py --task paper:gsm8k:/data/gsm8k/main/test-00000-of-00001.parquet \\
        --samples runs/eval/report.json
    # jsonl lines holding a dataset record's fields plus "completion" (paper's suite only)
    python inference/score.py --task paper:math --samples completions.jsonl --out verdicts.jsonl

Completions are cut at the task's stop strings and judged by the task's own scorer, as
``inference/evaluate.py`` does. ``--out`` writes one JSON line per sample: ``task``, ``method``,
``tau``, ``uid``, ``correct``, ``extracted``, ``reference``, ``detail``. Task specs are those of
``inference/evaluate.py`` (``megatron_wedlm.eval.registry``); code tasks run the programs in the
same resource-limited subprocess, which is not a security sandbox.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_wedlm.eval.scoring import score_file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, action="append",
                   help="task spec (repeatable): NAME:PATH for a report, NAME alone for jsonl samples")
    p.add_argument("--samples", required=True, help="report.json of inference/evaluate.py, or a jsonl file")
    p.add_argument("--out", default=None, help="write each sample's verdict here as jsonl")
    p.add_argument("--sandbox-timeout", type=float, default=10.0, help="seconds per program")
    p.add_argument("--sandbox-memory-mb", type=int, default=1024)
    p.add_argument("--sandbox-workers", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sandbox = dict(sandbox_timeout_s=args.sandbox_timeout, sandbox_memory_mb=args.sandbox_memory_mb,
                   sandbox_workers=args.sandbox_workers)
    try:
        runs = [run for spec in args.task for run in score_file(args.samples, spec, **sandbox)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        correct = sum(j.correct for j in run.judgements)
        print(f"{run.task:>16} | {run.label:<24} accuracy {run.accuracy:6.1%} ({correct}/{len(run.judgements)})")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for run in runs:
                for row in run.verdicts():
                    f.write(json.dumps(row) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
