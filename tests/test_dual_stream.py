"""Dual-stream batch layout against an obvious per-block reference, plus options and errors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_wedlm.data import (
    IGNORE_INDEX,
    RowFormat,
    build_dual_stream_batch,
    pack_documents_into_rows,
    pad_dual_stream_batch,
    rank_generator,
    rank_seed,
    stack_dual_stream_batches,
)

MASK = 0


def reference_row(documents, block_size, prompts, masked_positions, offsets=None):
    """Spec section 2 written out per document and per block, with the masking decision given.

    ``masked_positions[d]`` is the set of logical positions of document d that are masked;
    ``offsets[d]`` how many positions before token 0 document d's block grid starts (default 0).
    Returns a dict of per-slot Python lists.
    """
    row = {k: [] for k in ("input_ids", "position_ids", "is_memory", "is_masked", "target_ids", "doc_ids", "ar_labels")}

    def put(token, pos, memory, masked, doc, ar):
        row["input_ids"].append(MASK if masked else token)
        row["position_ids"].append(pos)
        row["is_memory"].append(memory)
        row["is_masked"].append(masked)
        row["target_ids"].append(token)
        row["doc_ids"].append(doc)
        row["ar_labels"].append(ar)

    for d, doc in enumerate(documents):
        x = doc.tolist()
        for p, token in enumerate(x):
            nxt = p + 1
            ar = x[nxt] if nxt < len(x) and nxt >= prompts[d] else IGNORE_INDEX
            put(token, p, True, False, d, ar)
        shift = offsets[d] if offsets else 0
        for start in range(-shift, len(x), block_size):
            block = list(range(max(start, 0), min(start + block_size, len(x))))
            observed = [p for p in block if p not in masked_positions[d]]
            masked = [p for p in block if p in masked_positions[d]]
            for p in observed:
                put(x[p], p, False, False, d, IGNORE_INDEX)
            for p in masked:
                put(x[p], p, False, True, d, IGNORE_INDEX)
    return row


def masked_positions_of(batch, num_docs):
    sel = batch.is_masked
    out = [set() for _ in range(num_docs)]
    for d, p in zip(batch.doc_ids[sel].tolist(), batch.position_ids[sel].tolist()):
        out[d].add(p)
    return out


def check_against_reference(batch, documents, block_size, prompts, eps=1e-8, offsets=None):
    prompts = prompts or [0] * len(documents)
    offsets = offsets or [0] * len(documents)
    n = 2 * sum(len(d) for d in documents)
    expected = reference_row(documents, block_size, prompts, masked_positions_of(batch, len(documents)), offsets)
    for name, values in expected.items():
        assert getattr(batch, name)[:n].tolist() == values, name
    shift = torch.tensor([offsets[d] if d >= 0 else 0 for d in batch.doc_ids.tolist()], dtype=torch.long)
    assert batch.block_ids.tolist() == ((batch.position_ids + shift) // block_size).tolist()
    # padding
    assert batch.is_padding.tolist() == [False] * n + [True] * (batch.seq_len - n)
    pad = batch.is_padding
    assert (batch.doc_ids[pad] == -1).all() and (batch.ar_labels[pad] == IGNORE_INDEX).all()
    assert (batch.mlm_weights[pad] == 0).all() and not batch.is_masked[pad].any()
    # per block: one gamma, masked count = round-half-up(gamma * maskable), prompts never masked
    pred = ~batch.is_memory & ~pad
    assert (batch.mask_ratio[~pred] == 0).all()
    for d, doc in enumerate(documents):
        for b in range(math.ceil((len(doc) + offsets[d]) / block_size)):
            sel = pred & (batch.doc_ids == d) & (batch.block_ids == b)
            if not sel.any():
                continue
            gammas = batch.mask_ratio[sel].unique()
            assert gammas.numel() == 1 and eps * 0.999 <= float(gammas) <= 1.0
            pos = batch.position_ids[sel]
            maskable = int((pos >= prompts[d]).sum())
            count = int(batch.is_masked[sel].sum())
            exact = float(gammas) * maskable + 0.5
            if abs(exact - round(exact)) > 1e-4:  # mask_ratio is float32; skip exact ties
                assert count == math.floor(exact)
            assert not (batch.is_masked[sel] & (pos < prompts[d])).any()
            w = batch.mlm_weights[sel]
            assert torch.allclose(w[batch.is_masked[sel]], 1.0 / gammas.expand(count))
            assert (w[~batch.is_masked[sel]] == 0).all()


documents_strategy = st.lists(st.integers(1, 24), min_size=1, max_size=5).flatmap(
    lambda lengths: st.tuples(
        st.just(lengths),
        st.lists(st.integers(1, 50), min_size=sum(lengths), max_size=sum(lengths)),
        st.lists(st.floats(0, 1), min_size=len(lengths), max_size=len(lengths)),
    )
)


@settings(max_examples=60, deadline=None)
@given(
    docs=documents_strategy,
    block_size=st.integers(1, 9),
    use_prompts=st.booleans(),
    ratio_mode=st.sampled_from(["block", "document"]),
    random_offset=st.booleans(),
    pad=st.integers(0, 7),
    seed=st.integers(0, 2**31),
)
def test_layout_matches_per_block_reference(docs, block_size, use_prompts, ratio_mode, random_offset, pad, seed):
    lengths, flat, prompt_fracs = docs
    documents, at = [], 0
    for n in lengths:
        documents.append(torch.tensor(flat[at : at + n]))
        at += n
    prompts = [min(int(f * n), n - 1) for f, n in zip(prompt_fracs, lengths)] if use_prompts else None
    n_slots = 2 * sum(lengths)
    row_format = RowFormat(block_size, MASK, ratio_mode=ratio_mode, random_block_offset=random_offset)
    batch = build_dual_stream_batch(documents, row_format, generator=torch.Generator().manual_seed(seed),
                                    prompt_lengths=prompts, pad_to=n_slots + pad)
    # documented draw order: with random offsets, one per document comes first
    offsets = (torch.randint(0, block_size, (len(documents),), generator=torch.Generator().manual_seed(seed)).tolist()
               if random_offset else None)
    check_against_reference(batch, documents, block_size, prompts, offsets=offsets)
    if ratio_mode == "document":
        pred = ~batch.is_memory & ~batch.is_padding
        for d in range(len(documents)):
            assert batch.mask_ratio[pred & (batch.doc_ids == d)].unique().numel() == 1


def test_gammas_and_counts_follow_documented_draw_order():
    """Replaying the generator as documented gives the gammas, so the rounding rule is checked exactly."""
    documents = [torch.randint(1, 100, (n,)) for n in (70, 33, 5)]
    block_size = 8
    batch = build_dual_stream_batch(documents, RowFormat(block_size, MASK), torch.Generator().manual_seed(7),
                                    prompt_lengths=[10, 0, 2])
    blocks = [math.ceil(len(d) / block_size) for d in documents]
    gamma = (1.0 - torch.rand(sum(blocks), generator=torch.Generator().manual_seed(7), dtype=torch.float64)).clamp(min=1e-8)
    g = 0
    for d, (doc, prompt) in enumerate(zip(documents, [10, 0, 2])):
        for b in range(blocks[d]):
            sel = ~batch.is_memory & (batch.doc_ids == d) & (batch.block_ids == b)
            maskable = int((batch.position_ids[sel] >= prompt).sum())
            assert int(batch.is_masked[sel].sum()) == math.floor(float(gamma[g]) * maskable + 0.5)
            assert torch.allclose(batch.mask_ratio[sel], gamma[g].float().expand(int(sel.sum())))
            g += 1


def test_random_block_offsets_move_block_starts_and_leave_default_batches_unchanged():
    """Offsets differ between documents and cover 0..B-1; without them the batch is the default one."""
    documents = [torch.randint(1, 100, (40,)) for _ in range(200)]
    shifted = build_dual_stream_batch(documents, RowFormat(8, MASK, random_block_offset=True),
                                      torch.Generator().manual_seed(5))
    offsets = torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(5))
    assert set(offsets.tolist()) == set(range(8))
    first_block_len = [int(((shifted.doc_ids == d) & shifted.is_memory & (shifted.block_ids == 0)).sum()) for d in range(200)]
    assert first_block_len == (8 - offsets).tolist()
    plain = build_dual_stream_batch(documents, RowFormat(8, MASK), torch.Generator().manual_seed(5))
    assert torch.equal(plain.block_ids, plain.position_ids // 8)  # off: docs/method.md §2.2, grid from 0
    assert not torch.equal(shifted.block_ids, shifted.position_ids // 8)
    again = build_dual_stream_batch(documents, RowFormat(8, MASK, random_block_offset=False),
                                    torch.Generator().manual_seed(5))
    for name in plain.tensor_field_names():
        assert torch.equal(getattr(plain, name), getattr(again, name)), name


@settings(max_examples=60, deadline=None)
@given(
    docs=documents_strategy,
    block_size=st.integers(1, 9),
    random_offset=st.booleans(),
    end=st.integers(1, 6),
    seed=st.integers(0, 2**31),
    probability=st.sampled_from([1.0, 0.5, 0.0]),
)
def test_a_masked_end_masks_the_rest_of_its_block(docs, block_size, random_offset, end, seed, probability):
    """``mask_after_masked_end``: the uniform draw (same generator), plus every non-prompt token after a
    masked end token of its block in the blocks drawn with that probability (their draw
    replayed: one float64 per block after the selection keys; none at 1), checked token by token;
    gammas and 1/gamma weights unchanged."""
    lengths, tokens, prompt_fracs = docs
    tokens = [1 + t % 6 for t in tokens]  # small ids, so end tokens occur often (also inside prompts)
    documents, at = [], 0
    for n in lengths:
        documents.append(torch.tensor(tokens[at:at + n]))
        at += n
    prompts = [int(f * n) // 2 for f, n in zip(prompt_fracs, lengths)]
    plain_format = RowFormat(block_size, MASK, random_block_offset=random_offset)
    ended_format = RowFormat(block_size, MASK, random_block_offset=random_offset, end_token_id=end,
                             mask_after_masked_end=probability)
    plain = build_dual_stream_batch(documents, plain_format, torch.Generator().manual_seed(seed), prompts)
    ended = build_dual_stream_batch(documents, ended_format, torch.Generator().manual_seed(seed), prompts)
    drawn, got = masked_positions_of(plain, len(documents)), masked_positions_of(ended, len(documents))
    replay = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, block_size, (len(documents),), generator=replay).tolist() \
        if random_offset else [0] * len(documents)
    first_block = [0]  # global index of each document's first block, blocks in document order
    for n, offset in zip(lengths, offsets):
        first_block.append(first_block[-1] + (n - 1 + offset) // block_size + 1)
    torch.rand(first_block[-1], generator=replay, dtype=torch.float64)  # the gammas
    torch.randint(0, 2**31, (sum(lengths),), generator=replay)  # the selection keys
    applies = (torch.rand(first_block[-1], generator=replay, dtype=torch.float64) < probability).tolist() \
        if probability < 1 else [True] * first_block[-1]
    for d, doc in enumerate(documents):
        x = doc.tolist()
        expected = set(drawn[d])
        for p in range(prompts[d], len(x)):
            block = (p + offsets[d]) // block_size
            if applies[first_block[d] + block] and any(x[q] == end and q in drawn[d] and (q + offsets[d]) // block_size == block for q in range(p)):
                expected.add(p)
        assert got[d] == expected, d
    assert torch.equal(ended.mask_ratio, plain.mask_ratio)
    expected_rows = reference_row(documents, block_size, prompts, got, offsets)
    n = 2 * sum(lengths)
    for name, values in expected_rows.items():
        assert getattr(ended, name)[:n].tolist() == values, name
    assert torch.allclose(ended.mlm_weights[ended.is_masked], 1.0 / ended.mask_ratio[ended.is_masked])
    assert (ended.mlm_weights[~ended.is_masked] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    docs=documents_strategy,
    block_size=st.integers(1, 9),
    random_offset=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_pruning_keeps_every_memory_slot_and_exactly_the_prediction_blocks_with_a_mask(
    docs, block_size, random_offset, seed
):
    """``prune_unmasked_blocks``: the same draws, and the full row's slots less each prediction
    block (document, block) without a masked slot, in the same order; padding only after them."""
    lengths, tokens, prompt_fracs = docs
    documents, at = [], 0
    for n in lengths:
        documents.append(torch.tensor(tokens[at:at + n]))
        at += n
    prompts = [min(int(f * n), n - 1) for f, n in zip(prompt_fracs, lengths)]
    full_format = RowFormat(block_size, MASK, random_block_offset=random_offset, end_token_id=3,
                            mask_after_masked_end=1.0)
    full = build_dual_stream_batch(documents, full_format, torch.Generator().manual_seed(seed), prompts)
    pruned = build_dual_stream_batch(documents, replace(full_format, prune_unmasked_blocks=True),
                                     torch.Generator().manual_seed(seed), prompts, pad_to=full.seq_len)
    with_mask = {(int(d), int(b)) for d, b, m in zip(full.doc_ids, full.block_ids, full.is_masked) if m}
    kept = [bool(memory) or (int(d), int(b)) in with_mask
            for memory, d, b in zip(full.is_memory, full.doc_ids, full.block_ids)]
    n = sum(kept)
    assert n < full.seq_len or all(kept)
    for name in full.tensor_field_names():
        assert torch.equal(getattr(pruned, name)[:n], getattr(full, name)[torch.tensor(kept)]), name
    assert pruned.is_padding[n:].all() and int(pruned.is_masked.sum()) == int(full.is_masked.sum())


def test_selection_is_uniform_within_block_and_counts_follow_gamma():
    """Many 8-token documents in one row: each position masked equally often; counts ~ U(0,1] x 8 rounded."""
    docs = [torch.arange(1, 9)] * 4000
    batch = build_dual_stream_batch(docs, RowFormat(8, MASK), generator=torch.Generator().manual_seed(3))
    pred = ~batch.is_memory
    pos = batch.position_ids[pred].view(4000, 8)
    masked = batch.is_masked[pred].view(4000, 8)
    per_position = torch.zeros(8).index_add_(0, pos[masked], torch.ones(int(masked.sum())))
    expected = float(masked.sum()) / 8
    assert (per_position - expected).abs().max() < 5 * math.sqrt(expected)
    counts = torch.bincount(masked.sum(1), minlength=9).double() / 4000
    # count = floor(8g + 0.5): P(0) = P(8) = 1/16, P(1..7) = 1/8
    expected_p = torch.tensor([1 / 16] + [1 / 8] * 7 + [1 / 16], dtype=torch.float64)
    assert (counts - expected_p).abs().max() < 0.02


def test_deterministic_given_generator_and_ranks_differ():
    docs = [torch.randint(1, 1000, (300,)), torch.randint(1, 1000, (100,))]

    def build(gen):
        return build_dual_stream_batch(docs, RowFormat(32, MASK), gen).input_ids

    assert torch.equal(build(torch.Generator().manual_seed(5)), build(torch.Generator().manual_seed(5)))
    assert not torch.equal(build(torch.Generator().manual_seed(5)), build(torch.Generator().manual_seed(6)))
    assert torch.equal(build(rank_generator(1, 0, 10)), build(rank_generator(1, 0, 10)))
    by_rank = [build(rank_generator(1, r, 10)) for r in range(4)]
    assert all(not torch.equal(by_rank[i], by_rank[j]) for i in range(4) for j in range(i))
    assert not torch.equal(build(rank_generator(1, 0, 10)), build(rank_generator(1, 0, 11)))
    seeds = {rank_seed(s, r, t) for s in range(3) for r in range(3) for t in range(3)}
    assert len(seeds) == 27 and all(0 <= x < 2**63 for x in seeds)


def test_padding_options_and_stacking():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    plain = build_dual_stream_batch(docs, RowFormat(2, MASK), gen())
    assert plain.seq_len == 10
    assert build_dual_stream_batch(docs, RowFormat(2, MASK), gen(), pad_to_multiple_of=8).seq_len == 16
    padded = build_dual_stream_batch(docs, RowFormat(2, MASK, pad_token_id=99), gen(), pad_to=13)
    assert padded.seq_len == 13 and padded.input_ids[10:].tolist() == [99, 99, 99]
    assert torch.equal(padded.input_ids[:10], plain.input_ids)
    # pad_dual_stream_batch gives the same as padding on build
    again = pad_dual_stream_batch(build_dual_stream_batch(docs, RowFormat(2, MASK, pad_token_id=99), gen()), 13)
    for name in padded.tensor_field_names():
        assert torch.equal(getattr(again, name), getattr(padded, name)), name

    other = build_dual_stream_batch([torch.arange(1, 9)], RowFormat(2, MASK), gen())
    stacked = stack_dual_stream_batches([plain, other])
    assert stacked.input_ids.shape == (2, 16)
    mask = stacked.dense_attention_mask()
    assert mask.shape == (2, 16, 16)
    assert torch.equal(mask[0, :10, :10], plain.dense_attention_mask())
    assert not mask[0, 10:].any() and not mask[0, :, 10:].any()
    assert torch.equal(mask[1], other.dense_attention_mask())
    safe = stacked.dense_attention_mask(padding_attends_self=True)
    assert torch.equal(safe[0, 10:, 10:], torch.eye(6, dtype=torch.bool)) and not safe[0, 10:, :10].any()
    assert torch.equal(safe[:, :10], mask[:, :10])
    assert stack_dual_stream_batches([plain, other], pad_to=20).seq_len == 20
    with pytest.raises(ValueError, match="shorter"):
        stack_dual_stream_batches([plain, other], pad_to=12)
    meta = stacked.attention_metadata()
    assert meta.doc_ids.shape == (2, 16) and set(meta.as_dict()) == {"doc_ids", "is_memory", "block_ids"}


def test_training_labels_in_sft_are_own_token_when_masked_and_next_response_token_on_memory():
    from megatron_wedlm.training.objective import Objective

    doc = torch.tensor([11, 12, 13, 14, 15, 16])
    batch = build_dual_stream_batch([doc], RowFormat(3, MASK), torch.Generator().manual_seed(1), prompt_lengths=[3])
    # memory slots 0..5; labels predict the next token only when it is a response token
    assert batch.ar_labels[:6].tolist() == [-100, -100, 14, 15, 16, -100]
    labels = Objective().labels(batch)  # the one label row both engines train against
    assert torch.equal(labels[batch.is_masked], batch.target_ids[batch.is_masked])
    assert torch.equal(labels[~batch.is_masked], batch.ar_labels[~batch.is_masked])
    assert (labels[6:][~batch.is_masked[6:]] == IGNORE_INDEX).all()  # unmasked prediction slots carry no loss
    assert not batch.is_masked[6:9].any()  # the prompt block is never masked


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(documents=[]), "documents is empty"),
        (dict(documents=[torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]), "document 1 is empty"),
        (dict(documents=[torch.tensor([1, 2]), torch.tensor([3, MASK, 4])]), "occurs inside document 1"),
        (dict(documents=[torch.tensor([1, 2, 3])], prompt_lengths=[3]), "no token left to learn"),
        (dict(documents=[torch.tensor([1, 2, 3])], prompt_lengths=[-1]), "negative"),
        (dict(documents=[torch.tensor([1, 2, 3])], prompt_lengths=[0, 0]), "2 entries for 1 documents"),
        (dict(block_size=0), "block_size"),
        (dict(documents=[torch.tensor([1, 2, 3])], max_length=5), "exceeds max_length"),
        (dict(documents=[torch.tensor([1, 2, 3])], pad_to=4), "pad_to 4 is shorter"),
        (dict(documents=[torch.tensor([1.0, 2.0])]), "dtype"),
        (dict(documents=[torch.ones(2, 2, dtype=torch.long)]), "1-D"),
        (dict(ratio_mode="token"), "ratio_mode"),
        (dict(mask_eps=0.0), "eps"),
        (dict(mask_token_id=None), "mask_token_id must be"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, message):
    """A bad row (documents, prompts, lengths) is refused by the build; a bad format by RowFormat."""
    format_keys = {"block_size", "mask_token_id", "ratio_mode", "mask_eps"}
    args = dict(documents=[torch.tensor([1, 2])], generator=torch.Generator().manual_seed(0))
    args.update({k: v for k, v in kwargs.items() if k not in format_keys})
    with pytest.raises(ValueError, match=message):
        row_format = RowFormat(**{"block_size": 2, "mask_token_id": MASK,
                                  **{k: v for k, v in kwargs.items() if k in format_keys}})
        build_dual_stream_batch(row_format=row_format, **args)


def test_max_length_accepts_rows_that_fit():
    batch = build_dual_stream_batch([torch.tensor([1, 2, 3])], RowFormat(2, MASK), max_length=8, pad_to=8)
    assert batch.seq_len == 8


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    block_size=st.integers(1, 8),
    max_length=st.integers(16, 80),
    prompt_fracs=st.lists(st.floats(0, 1), min_size=6, max_size=6),
    fill=st.booleans(),
)
def test_packing_splits_block_aligned_and_keeps_every_token(lengths, block_size, max_length, prompt_fracs, fill):
    capacity = (max_length // 2) // block_size * block_size
    documents = [torch.arange(1, n + 1) + 1000 * i for i, n in enumerate(lengths)]
    prompts = None if fill else [min(int(f * n), n - 1, capacity - 1) for f, n in zip(prompt_fracs, lengths)]
    rows = pack_documents_into_rows(documents, max_length, block_size, prompt_lengths=prompts, fill=fill)
    pieces: dict[int, list] = {i: [] for i in range(len(documents))}
    for number, row in enumerate(rows):
        assert 0 < row.num_tokens <= capacity
        if fill and number < len(rows) - 1:
            assert row.num_tokens > capacity - block_size  # padded only when less than a block is left
        for piece, prompt, (index, start) in zip(row.documents, row.prompt_lengths, row.sources):
            assert start % block_size == 0
            expected_prompt = 0 if prompts is None else min(max(prompts[index] - start, 0), len(piece))
            assert prompt == expected_prompt and prompt < len(piece)
            if not fill:  # next-fit: only a document longer than a row is cut, into row-sized pieces
                assert start % capacity == 0 and (len(piece) == capacity or start + len(piece) == lengths[index])
            pieces[index].append((start, piece))
        batch = build_dual_stream_batch(row.documents, RowFormat(block_size, MASK),
                                        torch.Generator().manual_seed(0), prompt_lengths=row.prompt_lengths,
                                        max_length=max_length)
        check_against_reference(batch, row.documents, block_size, row.prompt_lengths)
    for i, doc in enumerate(documents):
        rebuilt = torch.cat([p for _, p in sorted(pieces[i], key=lambda x: x[0])])
        assert torch.equal(rebuilt, doc)
    # order is preserved: sources are increasing across rows
    flat = [s for row in rows for s in row.sources]
    assert flat == sorted(flat)
    if not fill:  # a row closes only when the next piece does not fit
        for row, following in zip(rows, rows[1:]):
            assert row.num_tokens + following.documents[0].numel() > capacity


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 90), min_size=1, max_size=8),
    block_size=st.integers(1, 8),
    max_length=st.integers(16, 120),
    prompt_fracs=st.lists(st.floats(0, 1), min_size=8, max_size=8),
    seed=st.integers(0, 2**31),
)
def test_pruned_packing_fits_its_rows_for_any_block_offset_and_packs_at_least_as_tightly(
    lengths, block_size, max_length, prompt_fracs, seed
):
    """Packed for pruned rows, every row fits ``max_length`` slots whatever block offsets are drawn,
    holds every token once and in order, and no row holds fewer pieces than the unpruned packing
    of the same documents gives up to that point."""
    capacity = (max_length // 2) // block_size * block_size
    documents = [torch.arange(1, n + 1) + 1000 * i for i, n in enumerate(lengths)]
    prompts = [min(int(f * n), n - 1, capacity - 1) for f, n in zip(prompt_fracs, lengths)]
    plain = pack_documents_into_rows(documents, max_length, block_size, prompt_lengths=prompts)
    rows = pack_documents_into_rows(documents, max_length, block_size, prompt_lengths=prompts,
                                    prune_unmasked_blocks=True)
    for number, row in enumerate(rows):
        row_format = RowFormat(block_size, MASK, random_block_offset=True, prune_unmasked_blocks=True)
        batch = build_dual_stream_batch(row.documents, row_format, torch.Generator().manual_seed(seed + number),
                                        prompt_lengths=row.prompt_lengths, pad_to=max_length)
        assert batch.seq_len == max_length
    assert [s for row in rows for s in row.sources] == [s for row in plain for s in row.sources]
    assert len(rows) <= len(plain)
    done_plain = done = 0
    for a, b in zip(plain, rows):
        done_plain += len(a.sources)
        done += len(b.sources)
        assert done >= done_plain


def test_packing_errors():
    with pytest.raises(ValueError, match="documents is empty"):
        pack_documents_into_rows([], 64, 8)
    with pytest.raises(ValueError, match="cannot hold one block"):
        pack_documents_into_rows([torch.arange(1, 5)], 15, 8)
    with pytest.raises(ValueError, match="fills a whole row chunk"):
        pack_documents_into_rows([torch.arange(1, 100)], 32, 8, prompt_lengths=[16])
    with pytest.raises(ValueError, match="at least one token"):
        pack_documents_into_rows([torch.arange(1, 5)], 32, 8, prompt_lengths=[4])
    with pytest.raises(ValueError, match="document 1 is empty"):
        pack_documents_into_rows([torch.arange(1, 5), torch.arange(0)], 32, 8)
    with pytest.raises(ValueError, match="fill=False"):
        pack_documents_into_rows([torch.arange(1, 50)], 32, 8, prompt_lengths=[3], fill=True)
