#!/usr/bin/env python
"""The whole WeDLM story on one CPU machine, in one command, on built-in data.

    python tools/quickstart.py [--out DIR] [--preset full|ci] [--seed N]

Builds a corpus (built-in low-entropy tasks + Python standard-library source), trains a
tokenizer, prepares webdataset shards, pretrains a small Qwen-style model with next-token
prediction (torchrun, 2 processes), continues it with WeDLM pretraining, WeDLM-fine-tunes it on
prompt/answer pairs of the built-in tasks (sft/sft_wedlm.py), exports the base and final models to
HF, chooses the streaming operating point (the entropy threshold tau) on calibration prompts and
writes it into the exported model's generation_config.json, decodes the held-out test prompts
(disjoint from the calibration ones) with AR, streaming and block-wise decoding, and prints a
table (accuracy with its 95% interval, tokens/forward, p_cache, tokens/s, speed-up vs AR) with the
targets at that tau, writing report.json, report.md and speed_accuracy.png under --out. Each step runs the project's own
entry point (printed before it runs); see megatron_wedlm/quickstart/pipeline.py. So it needs a
checkout of the repository, installed with ``pip install -e .``: an installed wheel has the package
but not the entry points and configs, and the quickstart says so before it starts.

Presets: ``full`` (the README's command; about 21 minutes on 2 cores) and ``ci`` (a small
model and few steps, for tests). ``--compare-with OLD/report.json`` checks that this run
reproduced every non-timing number of an earlier run with the same seed;
``tools/bench_quickstart.py --seeds 0,1,2`` runs it per seed and tabulates the spread.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_wedlm.quickstart.settings import PRESETS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="quickstart_out", help="output directory (default: quickstart_out)")
    p.add_argument("--preset", choices=PRESETS, default="full", help="full (default), ci (seconds-scale) or smollm (a real pretrained model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, training and evaluation")
    p.add_argument("--settings", help="a quickstart settings YAML instead of the preset's")
    p.add_argument("--compare-with", help="report.json of an earlier run with the same seed and preset")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seed < 0:
        raise SystemExit("--seed must be >= 0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from megatron_wedlm.quickstart.launch import run_quickstart
    from megatron_wedlm.quickstart.stages import StageError

    try:
        paths = run_quickstart(args.out, preset=args.preset, seed=args.seed, settings_path=args.settings,
                               compare_with=args.compare_with)
    except StageError as err:
        print(f"quickstart failed: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"quickstart: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {paths['markdown']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
