#!/usr/bin/env python
"""Decode speed of streaming vs block-wise vs AR decoding of one model, measured side by side.

A random model is built from a config (nothing downloaded); its output layer is scaled up so
predictions are confident (a stand-in for low-entropy output such as counting, where parallel
decoding fills many slots per forward). ``--preset quickstart`` (default) is the quickstart's
model shape (6 layers, hidden 128, FFN 256, 4 query / 2 KV heads, vocab 1024); ``--preset 31m``
a 31M-parameter Qwen3. Every measurement runs once per ``--threads`` setting (default: 1
thread, then torch's default), so the ratios below come from one run on one machine state.

1. One prompt, greedy, with each method and both refill schedules (``fused``: the reference
   engine's, the default; ``paper``: Algorithm 1's step order), warmed up once, then timed
   ``--repeats`` times round-robin (best run kept). Per method: tokens, forwards, tokens/forward,
   p_cache, tokens/s, time per forward step, and the share of wall time spent *outside* the
   model forward (decoding logic). The forward is timed by wrapping the transformer body and the
   output layer. ``ar`` is the AR baseline the product measures (next-token rows of the decoding
   batch, as the server decodes them); ``hf generate`` is HF's own loop on the same model, the
   tool that baseline must keep pace with.
2. ``--batch`` prompts of different lengths, streaming: one at a time vs one batched call (and
   AR the same way). Outputs of the batched call must equal one-at-a-time decoding. The batched
   wall time is compared with two padding-free replays of its forwards, with nothing of the
   decoding around them: *its forwards alone* (exactly the rows of each step, at their own
   widths and cache lengths, attention per row as the decoder runs it), and the *alike-rows
   bound* (each row of a step at the step's mean width and cache length, so the rows share one
   attention call per layer). The first gap is the decoding logic; the second adds what
   separate attention calls per row cost (a fixed cost per call, one call per row and layer),
   which a batch of different prompts cannot avoid without a variable-length attention kernel
   (flash-attention's ``varlen`` on a GPU; padding rows into shared calls costs more, see
   ``megatron_wedlm/decoding/packed_attention.py``).

Summary lines, against the decoder's speed targets: streaming step / AR step (<= 1.4x at W = 16),
time outside the forward (<= 10% of streaming wall time), batched gain (>= 6x, or within 10% of a
padding-free batched forward of the same slots where that is lower: both replays are printed).
Measured figures are kept in docs/results.md.

    python tools/bench_decode.py                          # quickstart shape, CPU, ~2-4 minutes
    python tools/bench_decode.py --preset 31m --threads 0 --batch 0
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megatron_wedlm.decoding import DecodeSettings, generate
from megatron_wedlm.decoding.autoregressive import ar_decode
from megatron_wedlm.decoding.lean_body import lean_body, project
from megatron_wedlm.decoding.model_runner import cache_keyword
from megatron_wedlm.decoding.packed_attention import Packing, packed_attention
from megatron_wedlm.decoding.parallel import decode
from megatron_wedlm.decoding.row_cache import RowKVCache
from megatron_wedlm.testing.forward_clock import ForwardClock

PRESETS = {  # name -> (family, hidden, ffn, layers, heads, kv heads, vocab)
    "quickstart": ("qwen2", 128, 256, 6, 4, 2, 1024),
    "31m": ("qwen3", 512, 1408, 8, 8, 2, 8192),
}
METHODS = {  # row name -> settings overrides
    "stream/fused": {"method": "streaming", "fused_refill": True},
    "block/fused": {"method": "blockwise", "fused_refill": True},
    "stream/paper": {"method": "streaming", "fused_refill": False},
    "block/paper": {"method": "blockwise", "fused_refill": False},
    "ar": {"method": "ar"},
    "hf generate": None,  # HF generate, the reference of the AR row
}


def build_model(args):
    family, hidden, ffn, layers, heads, kv_heads, vocab = PRESETS[args.preset]
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        family
    ]
    torch.manual_seed(args.seed)
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=1024, tie_word_embeddings=False, mask_token_id=vocab - 1,
    )
    model = model_class(config).to(args.device, getattr(torch, args.dtype)).eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        model.lm_head.weight.mul_(args.output_scale)
    return model


def single_prompt(model, timer, prompt, settings, repeats):
    """Per method: (best result, forward seconds of that run)."""
    def run(overrides):
        if overrides is None:
            return ar_decode(model, [prompt], DecodeSettings.build(settings, method="ar"))[0]
        return generate(model, prompt, settings, **overrides)

    for overrides in METHODS.values():
        run(overrides)  # warm-up
    rows = {}
    for _ in range(repeats):  # round-robin, so load from other processes hits every method alike
        for name, overrides in METHODS.items():
            timer.seconds = 0.0
            result = run(overrides)
            if name not in rows or result.seconds < rows[name][0].seconds:
                rows[name] = (result, timer.seconds)
    print(f"{'method':<12} {'tokens':>6} {'fwds':>5} {'tok/fwd':>8} {'p_cache':>8} {'tok/s':>8} {'ms/step':>8} "
          f"{'outside fwd':>11}")
    for name, (r, forward_s) in rows.items():
        print(f"{name:<12} {r.num_generated:>6} {r.num_forwards:>5} {r.tokens_per_forward:>8.2f} {r.p_cache:>8.3f} "
              f"{r.tokens_per_second:>8.1f} {1e3 * r.seconds / r.num_forwards:>8.2f} {1 - forward_s / r.seconds:>10.1%}")
    return rows


@torch.inference_mode()
def replay(model, steps, uniform: bool, repeats: int = 2) -> float:
    """Seconds the forwards of ``steps`` (``ModelRunner.steps``) take on their own, with no decoding
    around them (best of ``repeats``; the first also allocates the cache buffers, as the real first
    step does).

    ``uniform=False``: the decoder's own packed forward of exactly those rows (their widths and
    cache lengths; attention per row). ``uniform=True``: every row of a step gets the step's mean
    width and cache length, so all rows share one attention call: what a step would cost if rows
    were alike, which no real batch of different prompts is.
    """
    with packed_attention(model):  # switched on once, as the decoder does
        return sum(_replay_step(model, step, uniform, repeats) for step in steps)


def _replay_step(model, step, uniform: bool, repeats: int) -> float:
    body, head = lean_body(model)[0] or model.base_model, model.get_output_embeddings()  # as the runner takes them
    lengths, cached = list(step.lengths), list(step.cached)
    if uniform:
        rows = len(lengths)
        lengths, cached = [math.ceil(sum(lengths) / rows)] * rows, [round(sum(cached) / rows)] * rows
    cache = RowKVCache(model.config.num_hidden_layers, len(lengths),
                       capacity=max(n + c for n, c in zip(lengths, cached)), device=model.device)
    packing = Packing.build(lengths, cached, cache, head.weight.dtype)
    ids = torch.randint(0, model.config.vocab_size - 1, (1, sum(lengths)), device=model.device)
    positions = torch.cat([c + torch.arange(n) for n, c in zip(lengths, cached)])[None].to(model.device)
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": True, "wedlm_packing": packing,
              cache_keyword(body): cache}
    best = math.inf
    for _ in range(repeats):
        cache.commit(cached)
        cache.packing = packing
        start = time.perf_counter()
        hidden = body(**inputs).last_hidden_state
        project(head, hidden.reshape(-1, hidden.shape[-1])[: step.masks])
        best = min(best, time.perf_counter() - start)
    return best


def batched(model, prompts, settings, method: str, repeats: int):
    """(one-at-a-time seconds, batched seconds, batched results, runner or None), each the best of
    ``repeats`` runs taken alternately; the outputs are checked equal."""
    config = DecodeSettings.build(settings, method=method)
    decode(model, prompts[:2], config)  # warm-up
    one, seconds = math.inf, math.inf
    for _ in range(repeats):
        single = [generate(model, p, config) for p in prompts]
        one = min(one, sum(r.seconds for r in single))
        start = time.perf_counter()
        together, runner = decode(model, prompts, config)
        seconds = min(seconds, time.perf_counter() - start)
    assert [r.token_ids for r in together] == [r.token_ids for r in single], "batched != one at a time"
    return one, seconds, together, runner


def thread_round(args, model, timer: ForwardClock, prompt, prompts, settings, threads: int) -> dict:
    """One thread count's rows: the single prompt's methods, then the batched comparison."""
    torch.set_num_threads(threads)
    print(f"\n== torch threads {torch.get_num_threads()} ==")
    rows = single_prompt(model, timer, prompt, settings, args.repeats)
    step = {name: r.seconds / r.num_forwards for name, (r, _) in rows.items()}
    line = {"threads": torch.get_num_threads(),
            "step_fused": step["stream/fused"] / step["ar"], "step_paper": step["stream/paper"] / step["ar"],
            "outside": 1 - rows["stream/fused"][1] / rows["stream/fused"][0].seconds,
            "tps_vs_ar": rows["stream/fused"][0].tokens_per_second / rows["ar"][0].tokens_per_second,
            "ar_vs_hf": rows["ar"][0].tokens_per_second / rows["hf generate"][0].tokens_per_second}
    if args.batch:
        one, together, results, runner = batched(model, prompts, settings, "streaming", args.repeats)
        bound = replay(model, runner.steps, uniform=True, repeats=args.repeats)
        forwards = replay(model, runner.steps, uniform=False, repeats=args.repeats)
        ar_one, ar_together, _, _ = batched(model, prompts, settings, "ar", 1)
        tokens = sum(r.num_generated for r in results)
        print(f"batch of {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
              f"{tokens} tokens: streaming one at a time {one:.2f}s, batched {together:.2f}s "
              f"({one / together:.2f}x); its forwards alone {forwards:.2f}s (batched = {together / forwards:.2f}x); "
              f"alike-rows bound {bound:.2f}s (batched = {together / bound:.2f}x, forwards alone = "
              f"{forwards / bound:.2f}x); AR one at a time {ar_one:.2f}s, batched {ar_together:.2f}s "
              f"({ar_one / ar_together:.2f}x); batched outputs = one at a time")
        line |= {"gain": one / together, "vs_bound": together / bound, "vs_forwards": together / forwards,
                 "ar_gain": ar_one / ar_together, "bound_gain": one / bound}
    return line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="quickstart")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output-scale", type=float, default=60.0, help="multiplies lm_head: higher = lower entropy")
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--window-size", type=int, default=16)
    p.add_argument("--entropy-threshold", type=float, default=0.4)
    p.add_argument("--distance-penalty", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="prompts of the batched comparison (0 = skip it)")
    p.add_argument("--threads", default="1,0", help="comma-separated torch thread counts; 0 = torch's default")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = build_model(args)
    timer = ForwardClock(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab - 1, (args.prompt_length,), generator=g).tolist()
    prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist()
               for n in torch.randint(args.prompt_length // 2, args.prompt_length + 1, (args.batch,), generator=g)]
    settings = DecodeSettings(window_size=args.window_size, entropy_threshold=args.entropy_threshold,
                              distance_penalty=args.distance_penalty, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=())  # no stop: every method decodes the same number of tokens
    params = sum(p.numel() for p in model.parameters()) / 1e6
    default_threads = torch.get_num_threads()
    print(f"model: random {args.preset} ({type(model).__name__}) {params:.2f}M params, lm_head x{args.output_scale}; "
          f"{args.device} {args.dtype}")
    print(f"prompt {args.prompt_length} tokens, max_new_tokens {args.max_new_tokens}, W={args.window_size}, "
          f"tau={args.entropy_threshold}, lambda={args.distance_penalty}, greedy, best of {args.repeats}")

    summary = []
    with timer.installed():
        for threads in (int(t) for t in args.threads.split(",")):
            summary.append(thread_round(args, model, timer, prompt, prompts, settings, threads or default_threads))

    print("\n== summary (targets: step ratio <= 1.4x, outside forward <= 10%, batched gain >= 6x or <= 1.1x bound) ==")
    for s in summary:
        text = (f"threads {s['threads']:>2}: streaming step / AR step {s['step_fused']:.2f}x (paper order "
                f"{s['step_paper']:.2f}x); outside forward {s['outside']:.1%}; tokens/s vs AR {s['tps_vs_ar']:.2f}x; "
                f"AR tokens/s vs HF generate {s['ar_vs_hf']:.2f}x")
        if "gain" in s:
            which = ("gain >= 6x" if s["bound_gain"] >= 6 else f"even the alike-rows bound gains only "
                     f"{s['bound_gain']:.2f}x < 6x: within 10% of a padding-free forward applies")
            text += (f"; batched gain {s['gain']:.2f}x (AR {s['ar_gain']:.2f}x) [{which}]: batched / its forwards "
                     f"alone {s['vs_forwards']:.2f}x, / alike-rows bound {s['vs_bound']:.2f}x")
        print(text)


if __name__ == "__main__":
    main()
