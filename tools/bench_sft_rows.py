"""SFT pairs per training step with and without pruned prediction blocks, side by side.

    python tools/bench_sft_rows.py --data outputs/smollm/data/sft_shards --seq-length 512 \
        --block-size 16 --num-learnable-end-tokens 8 --random-block-offset --mask-after-masked-end 1.0

``--data`` is an SFT directory written by ``tools/prepare_data.py --task sft`` (the quickstarts
write theirs under ``<out>/data/sft_shards``). The loader packs ``--rows`` rows from it twice,
with the settings given, once as the method builds rows (both streams whole) and once with
``wedlm.prune_unmasked_blocks`` (docs/method.md §2.3: the prediction blocks without a masked slot,
an SFT prompt's, left out). It prints what the rows hold (pairs, and the shares of their slots
that are padding, memory stream, prediction stream, prediction blocks without a mask, and slots
with a loss, the only ones the model computes logits for), then
times a forward and backward of a small Llama-shaped model (``--layers``/``--hidden``; the vocabulary
is the data's) on micro-batches of each, interleaved, median of ``--repeats``, and prints pairs
per second and their ratio. Rows have the same length either way, so a step costs about the same
and the ratio is that of the pairs per row; the timing shows it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from itertools import islice

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="SFT directory from tools/prepare_data.py --task sft")
    p.add_argument("--seq-length", type=int, default=512, help="slots per row (data.seq_length)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-learnable-end-tokens", type=int, default=8)
    p.add_argument("--random-block-offset", action="store_true")
    p.add_argument("--mask-after-masked-end", type=float, default=0.0)
    p.add_argument("--rows", type=int, default=64, help="rows packed per variant")
    p.add_argument("--micro-batch", type=int, default=2, help="rows per timed step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    return p.parse_args(argv)


def rows_of(spec, count: int) -> list:
    """``count`` rows, the streams read in turn (as the global row order deals them)."""
    from megatron_wedlm.data.webdataset_loader import StreamPosition, stream_rows

    streams = [stream_rows(spec, s, StreamPosition()) for s in range(spec.num_streams)]
    return [next(streams[i % spec.num_streams]) for i in range(count)]


def describe(items: list) -> dict:
    """Pairs per row and the shares of the rows' slots."""
    from megatron_wedlm.training.objective import Objective

    total = sum(item.batch.seq_len for item in items)
    share = {"padding": 0, "memory": 0, "prediction": 0, "prediction_without_a_mask": 0, "labelled": 0}
    pairs = 0
    for item in items:
        b = item.batch
        prediction = ~b.is_memory & ~b.is_padding
        share["padding"] += int(b.is_padding.sum())
        share["memory"] += int((b.is_memory & ~b.is_padding).sum())
        share["prediction"] += int(prediction.sum())
        share["labelled"] += int((Objective().labels(b) >= 0).sum())
        masked = {(int(d), int(k)) for d, k in zip(b.doc_ids[b.is_masked], b.block_ids[b.is_masked])}
        share["prediction_without_a_mask"] += sum((int(d), int(k)) not in masked
                                                  for d, k in zip(b.doc_ids[prediction], b.block_ids[prediction]))
        # a document id per piece: a pair cut across rows counts once per row it is in
        pairs += len(torch.unique(b.doc_ids[b.doc_ids >= 0]))
    return {"pairs_per_row": round(pairs / len(items), 3),
            "slot_shares": {k: round(v / total, 3) for k, v in share.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from megatron_wedlm.data import stack_dual_stream_batches
    from megatron_wedlm.data.webdataset_loader import loader_spec_from_manifest, manifest_row_format
    from megatron_wedlm.model import global_loss_normalizer
    from megatron_wedlm.model.hf_config import ModelArgs
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks
    from megatron_wedlm.runtime.parallel import ParallelConfig, initialize_parallel_state
    from megatron_wedlm.training.megatron_engine import megatron_forward_step, run_schedule
    from megatron_wedlm.training.objective import Objective

    row_format = manifest_row_format(
        args.data, block_size=args.block_size, random_block_offset=args.random_block_offset,
        num_learnable_end_tokens=args.num_learnable_end_tokens, mask_after_masked_end=args.mask_after_masked_end,
    )
    plain = loader_spec_from_manifest(args.data, row_format, num_streams=1, seq_length=args.seq_length, wedlm=True,
                                      task="sft", seed=0)
    pruned = replace(plain, row_format=replace(row_format, prune_unmasked_blocks=True))
    variants = {"both_streams_whole": plain, "pruned": pruned}
    rows = {name: rows_of(spec, args.rows) for name, spec in variants.items()}
    result: dict = {"data": args.data, "seq_length": args.seq_length, "block_size": args.block_size,
                    "rows": args.rows, **{name: describe(items) for name, items in rows.items()}}

    layout = initialize_parallel_state(ParallelConfig(), device="auto")
    vocab = 1 + max(row_format.mask_token_id, *(int(i.batch.input_ids.max()) for items in rows.values() for i in items))
    model_args = ModelArgs(
        architecture="llama", num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, num_query_groups=args.heads, head_dim=args.hidden // args.heads,
        vocab_size=vocab, padded_vocab_size=vocab, max_position_embeddings=args.seq_length, rope_theta=1e4,
        rms_norm_eps=1e-6, qk_layernorm=False, add_qkv_bias=False, tie_word_embeddings=True,
        mask_token_id=plain.mask_token_id, dtype="float32",
    )
    (model,) = build_model_chunks(model_args, BuildSettings(device=layout.device, attention_backend="dense"))
    batches = {name: [stack_dual_stream_batches([i.batch for i in items[k:k + args.micro_batch]]).to(layout.device)
                      for k in range(0, len(items) - args.micro_batch + 1, args.micro_batch)]
               for name, items in rows.items()}

    def step(batch) -> None:
        model.zero_grad(set_to_none=True)
        forward = megatron_forward_step(Objective(), global_loss_normalizer([batch], group=None), 1)
        run_schedule([model], forward, [batch], args.seq_length, args.micro_batch)

    times: dict[str, list[float]] = {name: [] for name in batches}
    for name in batches:
        step(batches[name][0])  # warm-up
    for k in islice(range(len(batches["pruned"])), args.repeats):
        for name, steps in batches.items():
            start = time.perf_counter()
            step(steps[k])
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    pairs_per_s = {name: result[name]["pairs_per_row"] * args.micro_batch / median[name] for name in batches}
    result.update({
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": vocab, "micro_batch": args.micro_batch,
                  "threads": torch.get_num_threads()},
        "median_step_s": {k: round(v, 4) for k, v in median.items()},
        "pairs_per_s": {k: round(v, 3) for k, v in pairs_per_s.items()},
        "ratio_pairs_per_s_pruned_vs_whole": round(pairs_per_s["pruned"] / pairs_per_s["both_streams_whole"], 3),
        "ratio_step_s_pruned_vs_whole": round(median["pruned"] / median["both_streams_whole"], 3),
    })
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
