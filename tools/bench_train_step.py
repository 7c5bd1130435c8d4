"""Training-step cost of WeDLM's dual stream vs plain autoregressive training, side by side.

    python tools/bench_train_step.py [--tokens 256] [--rows 2] [--hidden 512] [--layers 4]

Same model weights, same documents (``rows`` rows of ``tokens`` tokens each), one process,
Megatron's schedule (forward + backward, no optimizer: its cost is identical for both):

* ``wedlm``: the dual-stream batch, 2 x tokens slots per row, WeDLM mask, MLM + AR losses;
* ``ar_same_model``: the same WeDLM model and kernels as a causal LM over the tokens;
* ``ar_megatron_gpt``: Megatron's stock ``GPTModel`` (local spec) on the tokens;
* ``wedlm_dense_all_slot_logits``: the WeDLM step with logits at every slot, as stock
  ``GPTModel`` computes them, against the model's default of logits at labelled slots only
  (``--prompt-tokens`` leaves each row's first tokens unlabelled, as an SFT prompt is).

Runs are interleaved (A B C A B C ...) and the median is reported, so background load hits
all variants alike. The dual stream processes 2L tokens, so ~2x is the floor. The dense
backend skips key tiles a query tile never attends (``--dense-tile``, 0 = full-mask SDPA),
which keeps WeDLM attention near L^2 pairs instead of (2L)^2. The flex backend is timed only
where CUDA exists. Use ``--threads 1`` (default) on a shared machine: oversubscribed threads
make the timings meaningless.

``--bf16`` adds the same two steps on the model built in bf16 (Megatron's mixed precision, as
``trainer.precision=bf16`` trains it; the optimizer step is left out here too) and prints the
bf16/fp32 ratios. On a CPU bf16 pays only with native bf16 matrix instructions
(:mod:`megatron_wedlm.runtime.precision`); the result says whether this one has them. E.g. a
SmolLM2-135M-shaped layer stack: ``--hidden 576 --heads 9 --groups 3 --ffn 1536 --vocab 49280
--layers 6 --tokens 256 --rows 2 --bf16``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="document tokens per row (L)")
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="KV heads (GQA)")
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="each row's first tokens are an SFT prompt: no loss, no masks (0: pretraining rows)")
    p.add_argument("--dense-tile", type=int, default=64, help="dense backend query tile (0: no tile skipping)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: stable numbers on a shared machine; 0: torch's default)")
    p.add_argument("--bf16", action="store_true",
                   help="also time the WeDLM and AR steps of the model built in bf16, with bf16/fp32 ratios")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    return p.parse_args(argv)


def _model_args(args):
    """The benchmarked model (Llama-shaped, fp32) as the one model description."""
    from megatron_wedlm.model.hf_config import ModelArgs

    return ModelArgs(
        architecture="llama", num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, head_dim=args.hidden // args.heads,
        vocab_size=args.vocab, padded_vocab_size=args.vocab, max_position_embeddings=2 * args.tokens,
        rope_theta=1e6, rms_norm_eps=1e-6, qk_layernorm=False, add_qkv_bias=False, tie_word_embeddings=False,
        mask_token_id=args.vocab - 1, dtype="float32",
    )


def _wedlm_model(args, backend: str, device, dtype: torch.dtype = torch.float32):
    """The WeDLM model as training builds it, with ``backend`` attention, in ``dtype``."""
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks

    options = {"tile_size": args.dense_tile} if backend == "dense" else {}
    settings = BuildSettings(params_dtype=dtype, device=device, attention_backend=backend, backend_options=options)
    (model,) = build_model_chunks(_model_args(args), settings)
    return model


def _megatron_gpt(args, device):
    """Megatron's stock GPTModel (local spec) on the same config."""
    from megatron_wedlm.model.wedlm_model import BuildSettings
    from megatron_wedlm.testing.gpt_equivalence import build_gpt

    return build_gpt(_model_args(args), BuildSettings(device=device))


def _ar_forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    out = model(tokens, positions, attention_mask=None, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _step_fn(model, forward_step, batch, seq_length: int, rows: int):
    """One training step's forward and backward of ``batch`` through training's schedule call."""
    from megatron_wedlm.training.megatron_engine import run_schedule

    def run():
        model.zero_grad(set_to_none=True)
        run_schedule([model], forward_step, [batch], seq_length, rows)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from megatron_wedlm.data import build_dual_stream_batch, stack_dual_stream_batches
    from megatron_wedlm.model import global_loss_normalizer
    from megatron_wedlm.training.megatron_engine import megatron_forward_step
    from megatron_wedlm.training.objective import Objective
    from megatron_wedlm.runtime.parallel import ParallelConfig, initialize_parallel_state

    layout = initialize_parallel_state(ParallelConfig(), device="auto")
    device = layout.device
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, args.vocab - 1, (args.tokens,), generator=g) for _ in range(args.rows)]
    prompts = [args.prompt_tokens] if args.prompt_tokens else None
    dual = stack_dual_stream_batches(
        [build_dual_stream_batch([d], args.block_size, args.vocab - 1, g, prompt_lengths=prompts) for d in docs]
    ).to(device)
    tokens = torch.stack(docs).to(device)
    ar_batch = (tokens, torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1))

    dense = _wedlm_model(args, "dense", device)
    all_slots = _wedlm_model(args, "dense", device)
    all_slots.load_state_dict(dense.state_dict())
    all_slots.all_slot_logits = True
    gpt = _megatron_gpt(args, device)
    gpt.load_state_dict(dense.state_dict())
    normalizer = global_loss_normalizer([dual], group=None)
    wedlm_step = megatron_forward_step(Objective(), normalizer, 1)
    variants = {
        "wedlm_dense": _step_fn(dense, wedlm_step, dual, 2 * args.tokens, args.rows),
        "wedlm_dense_all_slot_logits": _step_fn(all_slots, wedlm_step, dual, 2 * args.tokens, args.rows),
        "ar_same_model": _step_fn(dense, _ar_forward_step, ar_batch, args.tokens, args.rows),
        "ar_megatron_gpt": _step_fn(gpt, _ar_forward_step, ar_batch, args.tokens, args.rows),
    }
    if args.bf16:
        dense_bf16 = _wedlm_model(args, "dense", device, torch.bfloat16)
        dense_bf16.load_state_dict(dense.state_dict())
        variants["wedlm_dense_bf16"] = _step_fn(dense_bf16, wedlm_step, dual, 2 * args.tokens, args.rows)
        variants["ar_same_model_bf16"] = _step_fn(dense_bf16, _ar_forward_step, ar_batch, args.tokens, args.rows)
    if torch.cuda.is_available():
        flex = _wedlm_model(args, "flex", device)
        flex.load_state_dict(dense.state_dict())
        padded = dual  # rows of 2 x tokens slots; tokens should make this a multiple of 128
        variants["wedlm_flex"] = _step_fn(flex, wedlm_step, padded, 2 * args.tokens, args.rows)

    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up (allocations, mask cache, compile)
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "shape": {"rows": args.rows, "tokens_per_row": args.tokens, "dual_stream_slots_per_row": 2 * args.tokens,
                  "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.groups,
                  "ffn": args.ffn, "vocab": args.vocab, "block_size": args.block_size,
                  "dense_tile": args.dense_tile, "prompt_tokens": args.prompt_tokens},
        "labelled_slots": round(float((Objective().labels(dual) >= 0).float().mean()), 3),
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "ratio_wedlm_dense_vs_all_slot_logits": round(median["wedlm_dense"] / median["wedlm_dense_all_slot_logits"], 3),
        "ratio_wedlm_dense_vs_ar_same_model": round(median["wedlm_dense"] / median["ar_same_model"], 3),
        "ratio_wedlm_dense_vs_ar_megatron_gpt": round(median["wedlm_dense"] / median["ar_megatron_gpt"], 3),
        "flex": "timed" if "wedlm_flex" in median else "skipped (no CUDA device)",
    }
    if args.bf16:
        from megatron_wedlm.runtime.precision import native_bf16_reason

        result["bf16_native"] = native_bf16_reason(device) or "no"
        result["ratio_wedlm_dense_bf16_vs_fp32"] = round(median["wedlm_dense_bf16"] / median["wedlm_dense"], 3)
        result["ratio_ar_same_model_bf16_vs_fp32"] = round(median["ar_same_model_bf16"] / median["ar_same_model"], 3)
    if "wedlm_flex" in median:
        result["ratio_wedlm_flex_vs_ar_megatron_gpt"] = round(median["wedlm_flex"] / median["ar_megatron_gpt"], 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
