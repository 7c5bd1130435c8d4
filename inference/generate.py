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

``--refill fused`` (default) is the reference engine's schedule: the window is refilled before
the forward, so a forward commits the filled run and predicts the new masks at once;
``--refill paper`` is Algorithm 1's step order (a fixed window of W slots per forward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_wedlm.decoding import METHODS, generate, load_tokenizer, load_wedlm_model  # noqa: E402

REFILL_ORDERS = ("fused", "paper")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint directory (HF format, with tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and metrics")
    p.add_argument("--method", choices=METHODS, default="streaming")
    p.add_argument("--window-size", type=int, default=16)
    p.add_argument("--entropy-threshold", type=float, default=0.4,
                   help="fill every slot whose penalised entropy is below this; negative = one slot per step")
    p.add_argument("--distance-penalty", type=float, default=0.02)
    p.add_argument("--refill", choices=REFILL_ORDERS, default="fused",
                   help="fused: the reference engine's schedule (default); paper: Algorithm 1's step order")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="end generation at the tokenizer's / model's EOS token(s) (default, as the engine)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of sampling (temperature > 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    return p


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return sorted(ids)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--chat: this tokenizer has no chat template; drop --chat or add one to tokenizer_config.json")
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model = load_wedlm_model(args.model, device=args.device, dtype=DTYPES[args.dtype],
                             require_mask_token=args.method != "ar")
    tokenizer = load_tokenizer(args.model)
    generator = torch.Generator(device=model.device).manual_seed(args.seed)
    result = generate(
        model,
        encode_prompt(tokenizer, args.prompt, args.chat),
        method=args.method,
        window_size=args.window_size,
        entropy_threshold=None if args.entropy_threshold < 0 else args.entropy_threshold,
        distance_penalty=args.distance_penalty,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_token_ids=stop_token_ids(model, tokenizer) if args.stop_at_eos else [],
        stop_strings=args.stop,
        tokenizer=tokenizer,
        generator=generator,
        fused_refill=args.refill == "fused",
    )
    report = {"text": result.text, "token_ids": result.token_ids, **result.metrics(),
              "refill": None if args.method == "ar" else args.refill}
    print(json.dumps(report) if args.json else result.text)
    return report


if __name__ == "__main__":
    main()
