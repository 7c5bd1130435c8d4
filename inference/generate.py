#!/usr/bin/env python
"""Generate text from a WeDLM checkpoint with streaming parallel decoding (or a baseline).

Example::

    python inference/generate.py --model /ckpt/wedlm-8b-instruct --chat \\
        --prompt "Solve: 2x + 5 = 13" --window-size 16 --entropy-threshold 0.4 --json

Prints the generated text, or with ``--json`` one JSON object: ``text``, ``token_ids``,
``forwards``, ``tokens_per_forward``, ``p_cache``, ``tokens_per_sec`` (plus the other fields of
``GenerationResult.metrics()``, and ``refill``: the schedule used). Generation stops at the
tokenizer's / model's EOS token(s) (as the reference WeDLM engine does; ``--no-stop-at-eos``
decodes past them), at ``--stop`` strings, or after ``--max-new-tokens``.

``--refill fused`` is the reference engine's schedule: the window is refilled before the
forward, so a forward commits the filled run and predicts the new masks at once; ``--refill
paper`` is Algorithm 1's step order (a fixed window of W slots per forward).

Window size, entropy threshold, distance penalty and refill order default to the values stored
with the model (``"wedlm"`` in its ``generation_config.json``), else to the built-in defaults
(16, 0.4, 0.02, fused); a value on the command line wins. The values used and where each came
from (``cli`` / ``model`` / ``built-in``) are printed to stderr, and with ``--json`` reported
under ``decoding_settings``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megatron_wedlm.decoding.cli import add_decoding_arguments, cli_values
from megatron_wedlm.decoding import METHODS, generate
from megatron_wedlm.decoding.inputs import DTYPES, encode_prompt, eos_token_ids
from megatron_wedlm.training.hf_export import load_checkpoint
from megatron_wedlm.decoding.options import describe, resolve_decoding_settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF checkpoint directory (with tokenizer), or a Megatron training checkpoint (iter_N) or run "
                        "directory (its newest complete checkpoint)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and metrics")
    p.add_argument("--method", choices=METHODS, default="streaming")
    add_decoding_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of sampling (temperature > 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model, tokenizer = load_checkpoint(args.model, device=args.device, dtype=args.dtype,
                                       require_mask_token=args.method != "ar")
    values, sources = resolve_decoding_settings(cli_values(args), args.model)
    if not args.json:
        print(f"decoding settings: {describe(values, sources)}", file=sys.stderr)
    generator = torch.Generator(device=model.device).manual_seed(args.seed)
    result = generate(
        model,
        encode_prompt(tokenizer, args.prompt, args.chat),
        method=args.method,
        **values,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_token_ids=eos_token_ids(model, tokenizer) if args.stop_at_eos else [],
        stop_strings=args.stop,
        tokenizer=tokenizer,
        generator=generator,
    )
    parallel = args.method != "ar"
    report = {"text": result.text, "token_ids": result.token_ids, **result.metrics(),
              "refill": ("fused" if values["fused_refill"] else "paper") if parallel else None,
              "decoding_settings": {k: {"value": v, "source": sources[k]} for k, v in values.items()}}
    print(json.dumps(report) if args.json else result.text)
    return report


if __name__ == "__main__":
    main()
