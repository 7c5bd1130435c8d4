"""Benchmark the dual-stream batch builder and the WeDLM mask forms (CPU, one run, side by side).

Prints:
1. build time of ``build_dual_stream_batch`` vs a straightforward per-block Python loop
   (8 documents x 4096 tokens, block 32) and the ratio;
2. per row length L (S = 2L slots): dense bool mask bytes vs BlockMask bytes, BlockMask build
   time (dense mask materialised only where it is small; otherwise its size is computed);
3. the work a block-sparse kernel does: exact fraction of allowed (q, k) pairs, fraction of
   pairs inside visited tiles, vs dense S x S (1.0) and a plain causal kernel (~0.5).

Run: python tools/bench_mask.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from megatron_wedlm.data import (
    RowFormat,
    build_block_mask,
    build_dual_stream_batch,
    classify_tiles,
    count_allowed_pairs,
)

MASK = 0
DENSE_LIMIT_SLOTS = 8192  # materialise the dense S x S mask only up to here (64 MiB); the rule's temporaries are larger


def naive_per_block_build(documents, block_size, mask_token_id, generator, prompt_lengths=None, eps=1e-8):
    """The obvious implementation: a Python loop over documents and blocks (the baseline)."""
    prompt_lengths = prompt_lengths or [0] * len(documents)
    parts = {k: [] for k in ("input_ids", "position_ids", "is_memory", "is_masked", "target_ids", "doc_ids",
                             "mask_ratio", "mlm_weights", "ar_labels")}
    for d, (doc, prompt) in enumerate(zip(documents, prompt_lengths)):
        length = doc.numel()
        positions = torch.arange(length)
        ar = torch.full((length,), -100)
        ar[:-1] = doc[1:]
        ar[: max(prompt - 1, 0)] = -100
        for name, value in (("input_ids", doc), ("position_ids", positions), ("is_memory", torch.ones(length, dtype=torch.bool)),
                            ("is_masked", torch.zeros(length, dtype=torch.bool)), ("target_ids", doc),
                            ("doc_ids", torch.full((length,), d)), ("mask_ratio", torch.zeros(length)),
                            ("mlm_weights", torch.zeros(length)), ("ar_labels", ar)):
            parts[name].append(value)
        for start in range(0, length, block_size):
            end = min(start + block_size, length)
            block, pos = doc[start:end], positions[start:end]
            gamma = max(1.0 - float(torch.rand(1, generator=generator, dtype=torch.float64)), eps)
            maskable = (pos >= prompt).nonzero().flatten()
            count = int(gamma * maskable.numel() + 0.5)
            chosen = maskable[torch.randperm(maskable.numel(), generator=generator)[:count]]
            masked = torch.zeros(end - start, dtype=torch.bool)
            masked[chosen] = True
            order = torch.cat([(~masked).nonzero().flatten(), masked.nonzero().flatten()])
            n = end - start
            parts["input_ids"].append(torch.where(masked, torch.full_like(block, mask_token_id), block)[order])
            parts["position_ids"].append(pos[order])
            parts["is_memory"].append(torch.zeros(n, dtype=torch.bool))
            parts["is_masked"].append(masked[order])
            parts["target_ids"].append(block[order])
            parts["doc_ids"].append(torch.full((n,), d))
            parts["mask_ratio"].append(torch.full((n,), gamma))
            parts["mlm_weights"].append(torch.where(masked, 1.0 / gamma, 0.0)[order])
            parts["ar_labels"].append(torch.full((n,), -100))
    return {name: torch.cat(values) for name, values in parts.items()}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_mask_bytes(block_mask) -> int:
    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
               block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
               block_mask.full_q_num_blocks, block_mask.full_q_indices]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def bench_build(repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    documents = [torch.randint(1, 50000, (4096,), generator=gen) for _ in range(8)]
    ours = median_time(lambda: build_dual_stream_batch(documents, RowFormat(32, MASK),
                                                       torch.Generator().manual_seed(1)), repeats)
    naive = median_time(lambda: naive_per_block_build(documents, 32, MASK, torch.Generator().manual_seed(1)), repeats)
    print("== build: 8 documents x 4096 tokens, block 32 (S = 65536 slots), median of", repeats)
    print(f"{'vectorised build_dual_stream_batch':<40}{ours * 1e3:>10.2f} ms")
    print(f"{'naive per-block Python loop':<40}{naive * 1e3:>10.2f} ms")
    print(f"{'speed-up (naive / ours)':<40}{naive / ours:>10.1f} x   (requirement: >= 4 x)")


def bench_masks(repeats: int, tile: int = 128) -> None:
    print(f"\n== masks: dense bool vs FlexAttention BlockMask (tile {tile}), median of {repeats}")
    header = (f"{'row':<22}{'S':>7}{'dense bytes':>13}{'dense build':>13}{'BlockMask':>12}{'BM build':>11}"
              f"{'allowed':>9}{'BM visits':>11}{'causal':>8}")
    print(header)
    gen = torch.Generator().manual_seed(0)
    cases = [(f"1 doc x {L}", [L]) for L in (4096, 16384, 32768)] + [("8 docs x 4096", [4096] * 8)]
    for name, lengths in cases:
        docs = [torch.randint(1, 50000, (n,), generator=gen) for n in lengths]
        batch = build_dual_stream_batch(docs, RowFormat(32, MASK), gen, pad_to_multiple_of=tile)
        meta = batch.attention_metadata()
        S = batch.seq_len
        if S <= DENSE_LIMIT_SLOTS:
            dense_time = median_time(lambda: batch.dense_attention_mask(), repeats)
            dense_bytes = batch.dense_attention_mask().numel()
            dense_cell = f"{dense_time * 1e3:.1f} ms"
        else:
            dense_bytes, dense_cell = S * S, "skipped*"
        bm_time = median_time(lambda: build_block_mask(meta, tile), repeats)
        block_mask = build_block_mask(meta, tile)
        classes = classify_tiles(meta, tile)
        allowed = float(count_allowed_pairs(meta)[0]) / S**2
        visited = float((classes.full | classes.partial).sum()) * tile * tile / S**2
        causal = (S + 1) / (2 * S)
        print(f"{name:<22}{S:>7}{human(dense_bytes):>13}{dense_cell:>13}{human(block_mask_bytes(block_mask)):>12}"
              f"{bm_time * 1e3:>8.1f} ms{allowed:>9.3f}{visited:>11.3f}{causal:>8.3f}")
    print(f"* dense S x S mask not materialised above S = {DENSE_LIMIT_SLOTS} (its bool size is shown; building it "
          "takes several times that in temporaries)")
    print("allowed = exact fraction of (q, k) pairs the rule allows; BM visits = fraction of pairs inside tiles the "
          "block-sparse kernel visits (full + partial); dense kernel = 1.0; causal = a plain causal kernel")

    # reference point: torch's create_block_mask evaluates the mask_mod on every pair
    from torch.nn.attention.flex_attention import create_block_mask

    docs = [torch.randint(1, 50000, (4096,), generator=gen)]
    batch = build_dual_stream_batch(docs, RowFormat(32, MASK), gen)
    meta = batch.attention_metadata()
    ours = median_time(lambda: build_block_mask(meta, tile), repeats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = median_time(lambda: create_block_mask(batch.block_mask(tile).mask_mod, 1, None, batch.seq_len,
                                                       batch.seq_len, device="cpu", BLOCK_SIZE=tile), max(1, repeats // 2))
        same = torch.equal(
            create_block_mask(batch.block_mask(tile).mask_mod, 1, None, batch.seq_len, batch.seq_len,
                              device="cpu", BLOCK_SIZE=tile).to_dense(),
            build_block_mask(meta, tile).to_dense(),
        )
    print(f"\nBlockMask at S = 8192: ours (per-tile summaries) {ours * 1e3:.1f} ms vs torch create_block_mask "
          f"(evaluates all S^2 pairs) {theirs * 1e3:.1f} ms -> {theirs / ours:.1f} x; same tiles: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: batches are built in data-loader workers, "
                             "one thread each; also keeps timings stable on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)")
    bench_build(args.repeats)
    bench_masks(args.repeats)


if __name__ == "__main__":
    main()
