#!/usr/bin/env python
"""Decode speed of streaming vs block-wise vs AR decoding of one model, measured side by side.

A random Qwen3-style model is built from a config (nothing downloaded); its output layer is
scaled up so predictions are confident (a stand-in for low-entropy output such as counting,
where parallel decoding fills many slots per forward). The same prompt is decoded greedily with
each method; every method is warmed up once, then timed ``--repeats`` times (best run kept).

Printed per method: generated tokens, forwards, tokens/forward, p_cache, tokens/s, mean time
per forward step, and the share of the wall clock spent *outside* the model forward (decoding
logic: reordering, entropy, sampling, bookkeeping; for AR, HF ``generate``'s own loop). The
forward is timed by wrapping the transformer body and the output layer. Then the ratios
streaming/AR and streaming/block-wise.

    python tools/bench_decode.py                 # CPU defaults, ~1 minute
    python tools/bench_decode.py --device cuda --hidden 1024 --layers 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from megatron_wedlm.decoding import generate  # noqa: E402


class ForwardTimer:
    """Accumulates wall time spent inside the model body and output layer (the 'forward')."""

    def __init__(self, model):
        self.seconds = 0.0
        self.sync = model.device.type == "cuda"
        for module in (model.base_model, model.get_output_embeddings()):
            module.forward = self._timed(module.forward)

    def _timed(self, forward):
        def run(*args, **kwargs):
            if self.sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            if self.sync:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            return out

        return run


def build_model(args) -> Qwen3ForCausalLM:
    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, mask_token_id=args.vocab - 1,
    )
    model = Qwen3ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        model.lm_head.weight.mul_(args.output_scale)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--output-scale", type=float, default=60.0, help="multiplies lm_head: higher = lower entropy")
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--window-size", type=int, default=16)
    p.add_argument("--entropy-threshold", type=float, default=0.4)
    p.add_argument("--distance-penalty", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = build_model(args)
    timer = ForwardTimer(model)
    prompt = torch.randint(0, args.vocab - 1, (args.prompt_length,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    settings = dict(window_size=args.window_size, entropy_threshold=args.entropy_threshold,
                    distance_penalty=args.distance_penalty, max_new_tokens=args.max_new_tokens)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: random Qwen3 {params:.1f}M params, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"lm_head x{args.output_scale}; {args.device} {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"prompt {args.prompt_length} tokens, max_new_tokens {args.max_new_tokens}, W={args.window_size}, "
          f"tau={args.entropy_threshold}, lambda={args.distance_penalty}, greedy, best of {args.repeats}")

    # name -> (method, extra settings); "fused" is the reference engine's schedule (the default),
    # "paper" Algorithm 1's step order (see decoding.parallel)
    configs = {
        "stream/fused": ("streaming", {"fused_refill": True}),
        "block/fused": ("blockwise", {"fused_refill": True}),
        "stream/paper": ("streaming", {"fused_refill": False}),
        "block/paper": ("blockwise", {"fused_refill": False}),
        "ar": ("ar", {}),
    }
    for method, extra in configs.values():
        generate(model, prompt, method=method, **settings, **extra)  # warm-up
    rows = {}
    for _ in range(args.repeats):  # round-robin, so load from other processes hits every method alike
        for name, (method, extra) in configs.items():
            timer.seconds = 0.0
            result = generate(model, prompt, method=method, **settings, **extra)
            if name not in rows or result.seconds < rows[name][0].seconds:
                rows[name] = (result, timer.seconds)

    header = (f"{'method':<12} {'tokens':>6} {'fwds':>5} {'tok/fwd':>8} {'p_cache':>8} {'tok/s':>8} {'ms/step':>8} "
              f"{'outside fwd':>11}")
    print(header)
    print("-" * len(header))
    for method, (r, forward_s) in rows.items():
        outside = 1.0 - forward_s / r.seconds
        print(f"{method:<12} {r.num_generated:>6} {r.num_forwards:>5} {r.tokens_per_forward:>8.2f} {r.p_cache:>8.3f} "
              f"{r.tokens_per_second:>8.1f} {1e3 * r.seconds / r.num_forwards:>8.2f} {outside:>10.1%}")
    a = rows["ar"][0]
    for label, (s_name, b_name) in {" (fused)": ("stream/fused", "block/fused"),
                                    " (paper)": ("stream/paper", "block/paper")}.items():
        s, b = rows[s_name][0], rows[b_name][0]
        print(f"streaming / AR{label:<9}: {s.tokens_per_second / a.tokens_per_second:.2f}x tokens/s, "
              f"{s.tokens_per_forward / a.tokens_per_forward:.2f}x tokens/forward")
        print(f"streaming / block-wise{label:<1}: {s.tokens_per_second / b.tokens_per_second:.2f}x tokens/s, "
              f"{s.tokens_per_forward / b.tokens_per_forward:.2f}x tokens/forward")


if __name__ == "__main__":
    main()
