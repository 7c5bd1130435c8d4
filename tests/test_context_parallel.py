"""Context parallelism for dual-stream rows, on one process: the split, the mask on global slots,
and the FlexAttention form. The multi-process equivalence (loss and gradients of CP layouts vs
one process) lives in tests/test_wedlm_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_wedlm.data import RowFormat, build_dual_stream_batch, pack_attention_metadata, stack_dual_stream_batches
from megatron_wedlm.data.attention_rule import allowed_pairs_per_query_tile, dense_attention_mask
from megatron_wedlm.model.attention import _context_parallel_block_mask
from megatron_wedlm.model.context_parallel import (
    balanced_slot_order,
    chunks_per_rank_for,
    contiguous_slot_order,
    pairs_per_rank,
    shard_batch,
)


def packed_rows(doc_lengths: list[list[int]], row_length: int, block_size: int = 8, seed: int = 0):
    """Rows of packed dual-stream documents, padded to ``row_length`` (SFT prompt on the first)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in doc_lengths:
        docs = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
        prompts = [3] + [0] * (len(lengths) - 1)
        rows.append(build_dual_stream_batch(docs, RowFormat(block_size, 127), g, prompt_lengths=prompts))
    return stack_dual_stream_batches(rows, pad_to=row_length)


def test_mask_of_chosen_query_slots_is_the_full_mask_at_those_rows():
    meta = packed_rows([[20, 9], [30]], 64).attention_metadata()
    queries = torch.tensor([40, 3, 17, 63, 21])
    full = dense_attention_mask(meta, padding_attends_self=True)
    chosen = dense_attention_mask(meta, padding_attends_self=True, query_slots=queries)
    assert torch.equal(chosen, full[:, queries])


def test_pairs_per_query_tile_count_the_dense_mask_rows():
    meta = packed_rows([[20, 9], [13, 7, 6]], 64).attention_metadata()
    per_tile = allowed_pairs_per_query_tile(meta, tile_size=8)
    dense = dense_attention_mask(meta).sum(-1).reshape(2, 8, 8).sum(-1)
    assert torch.equal(per_tile, dense)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_balanced_split_gives_every_rank_its_share_of_pairs(cp_size):
    # a long packed row with padding: one big document, two small ones, 10% padding
    meta = packed_rows([[700, 150, 70]], 2048, block_size=32).attention_metadata()
    order = balanced_slot_order(meta, cp_size)
    assert torch.equal(order.sort().values, torch.arange(2048))  # every slot once
    for rank_slots in order.reshape(cp_size, -1):
        assert torch.all(rank_slots[1:] > rank_slots[:-1])  # physical order within a rank
    share = pairs_per_rank(meta, order, cp_size).double()
    assert share.sum() == dense_attention_mask(meta).sum()
    assert (share / share.mean() - 1).abs().max() < 0.10
    contiguous = pairs_per_rank(meta, contiguous_slot_order(2048, cp_size), cp_size).double()
    assert (contiguous / contiguous.mean() - 1).abs().max() > 0.10  # the naive split is not


def test_rank_shards_cover_every_slot_once_with_its_fields():
    batch = packed_rows([[20, 9], [30]], 64)
    shards = [shard_batch(batch, rank, 2) for rank in range(2)]
    order = shards[0].slot_order
    assert torch.equal(shards[1].slot_order, order)  # both ranks compute the same split alone
    joined = torch.cat([s.batch.position_ids for s in shards], dim=-1)
    assert torch.equal(joined, batch.position_ids[:, order])
    assert torch.equal(torch.cat([s.batch.is_masked for s in shards], -1), batch.is_masked[:, order])
    packed = shards[0].attention_mask
    assert packed.shape == (2, 4, 64)
    assert torch.equal(packed[:, :3], pack_attention_metadata(batch.attention_metadata()))


def test_row_that_does_not_split_evenly_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of 2 x CP = 8"):
        chunks_per_rank_for(60, 4)


def test_flex_mask_of_local_queries_over_the_whole_row_matches_dense_attention():
    from torch.nn.attention.flex_attention import flex_attention

    batch = packed_rows([[20, 9], [30]], 64)
    cp_size, rank = 2, 1
    shard = shard_batch(batch, rank, cp_size)
    order = shard.slot_order
    queries = order[rank * 32:(rank + 1) * 32]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 32, 16, generator=g)
    k, v = torch.randn(2, 2, 64, 16, generator=g), torch.randn(2, 2, 64, 16, generator=g)
    block_mask = _context_parallel_block_mask(shard.attention_mask, queries, tile=16)
    flex = flex_attention(q, k, v, block_mask=block_mask)
    allowed = dense_attention_mask(batch.attention_metadata(), True, query_slots=queries)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=0)


def test_bench_tool_reports_both_layouts_and_a_balanced_split():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "bench_context_parallel.py"), "--tokens", "256", "--repeats", "1",
         "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert [r["local_slots"] for r in report["cp1"]] == [512]
    assert sorted(r["local_slots"] for r in report["cp2"]) == [256, 256]
    assert all(r["seconds"] > 0 and r["peak_memory_mib"] >= 0 for r in report["cp1"] + report["cp2"])
    for cp in (2, 4):
        shares = report["pair_balance"][f"cp{cp}_balanced"]["share_of_equal"]
        assert len(shares) == cp and max(abs(s - 1) for s in shares) < 0.10
    assert max(report["pair_balance"]["cp4_contiguous"]["share_of_equal"]) > 1.2  # what balancing fixes
