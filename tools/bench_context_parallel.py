"""Context parallelism for one long dual-stream row: per-rank attention time and peak memory at
CP=1 vs CP=2, and the allowed-pair balance of the split, side by side in one run.

    python tools/bench_context_parallel.py [--tokens 2048] [--heads 8] [--head-dim 64] [--repeats 3]

One row of ``tokens`` document tokens (a long document plus two short ones, packed, 2 x tokens
slots rounded up to a multiple of 64) goes through the dense backend's core attention
(:class:`megatron_wedlm.model.attention.WeDLMSDPAttention`, forward + backward) on 1 process and
on a CP group of 2 gloo processes: each CP rank holds its half of the slots (the mask-balanced
split of :mod:`megatron_wedlm.model.context_parallel`), all-gathers keys/values and builds the
mask of its queries against the whole row -- exactly the training path.

Reported per rank: median seconds of forward + backward over ``--repeats`` calls, and peak
memory = growth of the process's peak resident set during the first call on the long row (mask,
plan, scores, gathered keys/values, gradients; the inputs are allocated before, and a call on a
tiny row first keeps one-time library and collective set-up out of it). Pair balance: allowed
(query, key) pairs whose query each rank holds, for the balanced split and for a contiguous one,
at CP=2 and CP=4. Timings on a shared CPU are noisy; the memory ratio and the pair balance are
not.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="document tokens in the row (2x slots)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dense-tile", type=int, default=64, help="dense backend query tile")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the measured first one")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    if args.tokens < 64:
        p.error("--tokens must be >= 64")
    return args


def long_row(tokens: int, block_size: int):
    """The benchmark row: 70% / 20% / 10% of ``tokens`` as three packed documents, padded."""
    import torch

    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches

    g = torch.Generator().manual_seed(0)
    lengths = [tokens * 7 // 10, tokens // 5]
    lengths.append(tokens - sum(lengths))
    docs = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    row = build_dual_stream_batch(docs, RowFormat(block_size, 1000), g)
    padded = -(-2 * tokens // 64) * 64
    return stack_dual_stream_batches([row], pad_to=padded)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def attention_worker(settings: dict, cp: int) -> dict:
    """One rank: time forward + backward of the core attention on its part of the row."""
    import torch

    from megatron.core.transformer.spec_utils import build_module

    from megatron_wedlm.model.attention_backends import get_attention_backend
    from megatron_wedlm.model.context_parallel import shard_batch
    from megatron_wedlm.model.hf_config import ModelArgs
    from megatron_wedlm.model.wedlm_model import BuildSettings, wedlm_transformer_config
    from megatron_wedlm.testing.gpt_equivalence import init_layout

    init_layout(1, 1, seed=0, cp=cp)
    torch.set_num_threads(1)
    heads, groups, dim = settings["heads"], settings["groups"], settings["head_dim"]
    model = ModelArgs(
        architecture="llama", num_layers=1, hidden_size=heads * dim, ffn_hidden_size=4 * heads * dim,
        num_attention_heads=heads, num_query_groups=groups, head_dim=dim, vocab_size=1024, padded_vocab_size=1024,
        max_position_embeddings=settings["tokens"], rope_theta=10000.0, rms_norm_eps=1e-6, qk_layernorm=False,
        add_qkv_bias=False, tie_word_embeddings=False, dtype="float32",
    )
    config = wedlm_transformer_config(model, BuildSettings())
    dense = get_attention_backend("dense").core_attention_spec(tile_size=settings["dense_tile"])
    attention = build_module(dense, config=config, layer_number=1)  # the core attention a WeDLM layer builds

    def prepare(tokens: int):
        """This rank's inputs for a row of ``tokens``, and a timed forward + backward over them."""
        row = long_row(tokens, settings["block_size"])
        shard = shard_batch(row)
        slots = torch.arange(row.seq_len) if shard.slot_order is None else shard.slot_order
        local = slots.numel() // cp
        mine = slots[torch.distributed.get_rank() * local:(torch.distributed.get_rank() + 1) * local]
        g = torch.Generator().manual_seed(1)
        full = [torch.randn(row.seq_len, 1, n, dim, generator=g) for n in (heads, groups, groups)]
        q, k, v = (t.index_select(0, mine).requires_grad_() for t in full)

        def call() -> float:
            start = time.perf_counter()
            out = attention(q, k, v, shard.attention_mask)
            out.float().square().mean().backward()
            return time.perf_counter() - start

        return local, call

    prepare(64)[1]()  # warm-up on a tiny row: library and collective set-up stay out of the peak
    local, call = prepare(settings["tokens"])
    base = _rss_bytes()
    first = call()
    peak = _peak_rss_bytes() - base
    times = [call() for _ in range(settings["repeats"])]
    return {
        "rank": torch.distributed.get_rank(),
        "local_slots": local,
        "seconds": statistics.median(times) if times else first,
        "peak_memory_mib": round(peak / 2**20, 1),
    }


def pair_balance(tokens: int, block_size: int) -> dict:
    """Allowed pairs per rank (as shares of an equal split) for the balanced and contiguous splits."""
    from megatron_wedlm.model.context_parallel import balanced_slot_order, contiguous_slot_order, pairs_per_rank

    meta = long_row(tokens, block_size).attention_metadata()
    out = {}
    for cp in (2, 4):
        for name, order in (("balanced", balanced_slot_order(meta, cp)),
                            ("contiguous", contiguous_slot_order(meta.seq_len, cp))):
            pairs = pairs_per_rank(meta, order, cp)
            out[f"cp{cp}_{name}"] = {
                "pairs": pairs.tolist(),
                "share_of_equal": [round(float(p) * cp / float(pairs.sum()), 4) for p in pairs],
            }
    return out


def main(argv: list[str] | None = None) -> int:
    from megatron_wedlm.runtime.multiprocess import run_distributed

    args = parse_args(argv)
    settings = {k: getattr(args, k) for k in ("tokens", "heads", "groups", "head_dim", "block_size", "dense_tile",
                                              "repeats")}
    with tempfile.TemporaryDirectory():
        cp1 = run_distributed(attention_worker, 1, settings, 1, timeout_s=1200)
        cp2 = run_distributed(attention_worker, 2, settings, 2, timeout_s=1200)
    worst_cp2 = max(r["peak_memory_mib"] for r in cp2)
    report = {
        "row_slots": long_row(args.tokens, args.block_size).seq_len,
        "settings": settings,
        "cp1": cp1,
        "cp2": cp2,
        "cp2_over_cp1_peak_memory": round(worst_cp2 / cp1[0]["peak_memory_mib"], 3),
        "cp2_over_cp1_seconds": round(max(r["seconds"] for r in cp2) / cp1[0]["seconds"], 3),
        "pair_balance": pair_balance(args.tokens, args.block_size),
    }
    if not args.json:
        print(f"row of {report['row_slots']} slots; per rank: forward+backward seconds, peak memory MiB")
        for name in ("cp1", "cp2"):
            for r in report[name]:
                print(f"  {name} rank {r['rank']}: {r['local_slots']} slots  {r['seconds']:.3f} s  "
                      f"{r['peak_memory_mib']:.1f} MiB")
        print(f"  CP=2 / CP=1: memory {report['cp2_over_cp1_peak_memory']}, time {report['cp2_over_cp1_seconds']}")
        for name, b in report["pair_balance"].items():
            print(f"  pairs {name}: {b['share_of_equal']} of an equal share")
    print(json.dumps(report, indent=None if not args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
