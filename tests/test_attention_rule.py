"""The attention rule's forms (dense, FlexAttention, BlockMask tiles, pair count) vs the table of
docs/method.md §2.3."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_wedlm
from megatron_wedlm.data import (
    AttentionMetadata,
    RowFormat,
    build_block_mask,
    build_dual_stream_batch,
    classify_tiles,
    allowed_keys_per_query,
    count_allowed_pairs,
    dense_attention_mask,
    flex_mask_mod,
    stack_dual_stream_batches,
)

MASK = 0


def spec_table_mask(batch) -> torch.Tensor:
    """The table of docs/method.md §2.3, pair by pair, in its own words (positions, blocks, physical
    order)."""
    B = batch.block_size
    pos = batch.position_ids.tolist()
    mem = batch.is_memory.tolist()
    doc = batch.doc_ids.tolist()
    pad = batch.is_padding.tolist()
    S = len(pos)
    out = torch.zeros(S, S, dtype=torch.bool)
    for q in range(S):
        for k in range(S):
            if pad[q] or pad[k] or doc[q] != doc[k]:
                continue
            if mem[q] and mem[k]:
                ok = pos[k] <= pos[q]
            elif not mem[q] and mem[k]:
                ok = pos[k] < (pos[q] // B) * B
            elif not mem[q] and not mem[k]:
                ok = pos[k] // B == pos[q] // B and k <= q
            else:
                ok = False
            out[q, k] = ok
    return out


@st.composite
def rows(draw, max_docs=4, max_len=20, block_size=None):
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_docs))
    block_size = block_size or draw(st.integers(1, 8))
    prompts = [draw(st.integers(0, n - 1)) for n in lengths]
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    documents = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    extra = draw(st.integers(0, 9))
    return build_dual_stream_batch(documents, RowFormat(block_size, MASK), gen, prompt_lengths=prompts,
                                   pad_to=2 * sum(lengths) + extra)


@settings(max_examples=40, deadline=None)
@given(batch=rows())
def test_dense_mask_equals_spec_table(batch):
    dense = batch.dense_attention_mask()
    assert torch.equal(dense, spec_table_mask(batch))
    safe = batch.dense_attention_mask(padding_attends_self=True)
    pad = batch.is_padding
    assert torch.equal(safe[~pad], dense[~pad])
    assert torch.equal(safe[pad][:, pad], torch.eye(int(pad.sum()), dtype=torch.bool))
    assert safe.any(-1).all()  # kernel-safe form: no empty row at all


def tiles_agree_with_dense(meta, tile, padding_attends_self=False):
    mask = dense_attention_mask(meta.batched(), padding_attends_self)
    b, s, _ = mask.shape
    n = s // tile
    blocks = mask.view(b, n, tile, n, tile).permute(0, 1, 3, 2, 4)
    any_true, all_true = blocks.any(-1).any(-1), blocks.all(-1).all(-1)
    classes = classify_tiles(meta, tile, padding_attends_self)
    assert not (classes.full & classes.partial).any()
    assert all_true[classes.full].all(), "a tile classified full has a disallowed pair"
    empty = ~classes.full & ~classes.partial
    assert not any_true[empty].any(), "a tile classified empty has an allowed pair"
    return classes, any_true, all_true


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 8), tile=st.sampled_from([1, 2, 4, 8, 16]), safe=st.booleans())
def test_tile_classification_never_wrong(data, block_size, tile, safe):
    batches = data.draw(st.lists(rows(max_docs=3, max_len=24, block_size=block_size), min_size=1, max_size=3))
    longest = max(b.seq_len for b in batches)
    stacked = stack_dual_stream_batches(batches, pad_to=-(-longest // tile) * tile)
    meta = stacked.attention_metadata()
    tiles_agree_with_dense(meta, tile, safe)
    dense = stacked.dense_attention_mask()
    assert torch.equal(allowed_keys_per_query(meta), dense.sum(dim=-1))
    assert torch.equal(count_allowed_pairs(meta), dense.sum(dim=(-1, -2)))


def test_tile_classification_is_tight_for_aligned_documents():
    """Documents aligned to tiles: every partial tile really is mixed (no wasted kernel work)."""
    docs = [torch.randint(1, 50, (64,)), torch.randint(1, 50, (32,))]
    batch = build_dual_stream_batch(docs, RowFormat(8, MASK), torch.Generator().manual_seed(0))
    classes, any_true, all_true = tiles_agree_with_dense(batch.attention_metadata(), 16)
    assert torch.equal(classes.full, all_true)
    assert torch.equal(classes.partial, any_true & ~all_true)


def test_block_mask_matches_tile_classes_and_dense():
    batches = [
        build_dual_stream_batch([torch.randint(1, 50, (n,)) for n in lens], RowFormat(4, MASK),
                                torch.Generator().manual_seed(i))
        for i, lens in enumerate([(40, 17), (90,)])
    ]
    stacked = stack_dual_stream_batches(batches, pad_to=192)
    meta = stacked.attention_metadata()
    block_mask = build_block_mask(meta, tile_size=32)
    classes = classify_tiles(meta, 32)
    assert block_mask.shape == (2, 1, 192, 192)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), classes.full | classes.partial)
    # the BlockMask's mask_mod is the rule: evaluate it everywhere and compare with dense
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(192), torch.arange(192), indexing="ij")
    mm = block_mask.mask_mod(b, torch.zeros_like(b), q, k)
    assert torch.equal(mm, stacked.dense_attention_mask())
    with pytest.raises(ValueError, match="multiple of tile_size"):
        build_block_mask(meta, tile_size=128)


def test_flex_attention_forward_equals_sdpa_with_dense_mask():
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    batches = [
        build_dual_stream_batch([torch.randint(1, 50, (n,), generator=gen) for n in lens], RowFormat(8, MASK), gen,
                                prompt_lengths=[3] * len(lens))
        for lens in [(50, 21, 30), (100,)]
    ]
    stacked = stack_dual_stream_batches(batches, pad_to=256)
    meta = stacked.attention_metadata()
    q, k, v = (torch.randn(2, 2, 256, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is unfused
        out_flex = flex_attention(q, k, v, block_mask=build_block_mask(meta, 128))
        out_flex_safe = flex_attention(q, k, v, block_mask=build_block_mask(meta, 128, padding_attends_self=True))
    dense_safe = stacked.dense_attention_mask(padding_attends_self=True)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_safe.unsqueeze(1))
    real = ~stacked.is_padding
    assert torch.allclose(out_flex.permute(0, 2, 1, 3)[real], out_sdpa.permute(0, 2, 1, 3)[real], atol=1e-10)
    assert torch.allclose(out_flex_safe, out_sdpa, atol=1e-10)
    assert (out_flex.permute(0, 2, 1, 3)[~real] == 0).all()  # flex gives 0 for rows that attend nothing
    # a plain eager softmax (scale 1/sqrt(16)) is finite everywhere with the safe form
    scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~dense_safe.unsqueeze(1), float("-inf"))
    eager = scores.softmax(-1) @ v
    assert torch.allclose(eager, out_sdpa, atol=1e-10) and not eager.isnan().any()


def test_mask_mod_works_under_vmap_on_scalar_indices():
    batch = build_dual_stream_batch([torch.arange(1, 20)], RowFormat(4, MASK), torch.Generator().manual_seed(0))
    mm = flex_mask_mod(batch.attention_metadata())
    dense = batch.dense_attention_mask()
    for q, k in [(0, 0), (5, 3), (3, 5), (25, 2), (25, 20), (37, 19)]:
        assert bool(mm(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(k))) == bool(dense[q, k])


def test_block_mask_at_64k_slots_does_not_materialise_s_by_s():
    """S = 2 x 32768: the dense bool mask alone would be 4 GiB; the build must stay far below."""
    script = (
        "import resource, torch\n"
        "from megatron_wedlm.data import RowFormat, build_dual_stream_batch, build_block_mask, count_allowed_pairs\n"
        "b = build_dual_stream_batch([torch.randint(1, 1000, (32768,))], RowFormat(32, 0), "
        "torch.Generator().manual_seed(0))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "bm = build_block_mask(b.attention_metadata())\n"
        "pairs = int(count_allowed_pairs(b.attention_metadata())[0])\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(after - before, pairs, tuple(bm.shape))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_wedlm.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120, env=env)
    grown_kib, pairs, shape = out.stdout.split(maxsplit=2)
    assert int(grown_kib) < 1024 * 1024, f"peak memory grew by {int(grown_kib) // 1024} MiB"
    # exact count: memory slot p sees p + 1 keys; a prediction slot in block b at rank r sees 32 b + r + 1
    L, B = 32768, 32
    memory = L * (L + 1) // 2
    prediction = sum(B * b * B + B * (B + 1) // 2 for b in range(L // B))
    assert int(pairs) == memory + prediction
    assert shape.strip() == "(1, 1, 65536, 65536)"


def test_metadata_round_trip_and_validation():
    batch = stack_dual_stream_batches([
        build_dual_stream_batch([torch.arange(1, 6)], RowFormat(2, MASK)),
        build_dual_stream_batch([torch.arange(1, 3)], RowFormat(2, MASK)),
    ])
    meta = batch.attention_metadata()
    again = AttentionMetadata.from_dict({k: v.clone() for k, v in meta.as_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(meta.as_dict().values(), again.as_dict().values()))
    with pytest.raises(ValueError, match="share one shape"):
        AttentionMetadata(meta.doc_ids, meta.is_memory[:, :3], meta.block_ids)
    with pytest.raises(ValueError, match="bool"):
        AttentionMetadata(meta.doc_ids, meta.is_memory.long(), meta.block_ids)
