"""Streaming webdataset loader: filled rows covering each epoch, layout independence, exact resume, SFT rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megatron_wedlm.data.dual_stream import IGNORE_INDEX, build_memory_only_row
from megatron_wedlm.data.packing import pack_documents_into_rows
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.data.row_format import RowFormat
from megatron_wedlm.data.webdataset_loader import (
    StreamPosition,
    StreamingRowDataset,
    TrainDataIterator,
    loader_spec_from_manifest,
    manifest_row_format,
    row_capacity,
    stream_rows,
)
from megatron_wedlm.data.webdataset_loader import _read_shard, _sample_order, _shard_order
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer().save_pretrained(str(directory))
    return directory


def _numbers_doc(rng: random.Random) -> str:
    return " ".join(str(rng.randint(0, 300)) for _ in range(rng.randint(1, 30)))


@pytest.fixture(scope="module")
def pretrain_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """120 documents of 2..~90 tokens (some longer than a row) in 8 shards of 15."""
    root = tmp_path_factory.mktemp("pre")
    rng = random.Random(0)
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": _numbers_doc(rng)}) + "\n" for _ in range(120)))
    prepare_dataset([src], root / "data", tokenizer_dir, PrepareOptions(samples_per_shard=15))
    return root / "data"


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("sft")
    rng = random.Random(1)
    src = root / "pairs.jsonl"
    lines = []
    for i in range(48):
        prompt = "Count: " + _numbers_doc(rng) if i % 7 else "Count: " + " ".join(["1"] * 40)  # some prompts fill a row
        lines.append(json.dumps({"prompt": prompt, "response": " " + _numbers_doc(rng)}))
    src.write_text("\n".join(lines) + "\n")
    prepare_dataset([src], root / "data", tokenizer_dir, PrepareOptions(task="sft", raw_sft=True, samples_per_shard=6))
    return root / "data"


_FORMAT_KEYS = {"block_size", "num_learnable_end_tokens", "mask_after_masked_end", "prune_unmasked_blocks",
                "random_block_offset"}


def _spec(data_dir: Path, wedlm: bool = True, **kw):
    args = dict(num_streams=8, seq_length=SEQ, wedlm=wedlm, seed=5)
    row_format = dict(block_size=BLOCK)
    for key, value in kw.items():
        (row_format if key in _FORMAT_KEYS else args)[key] = value
    return loader_spec_from_manifest(data_dir, manifest_row_format(data_dir, **row_format), **args)


def _shard_tokens(spec) -> dict[str, list[int]]:
    """Every sample's tokens keyed by (shard, index), read straight from the shards."""
    out = {}
    for shard, path in enumerate(spec.shard_paths):
        for i, (tokens, _) in enumerate(_read_shard(Path(spec.data_dir) / path)):
            out[f"{shard}:{i}"] = tokens.tolist()
    return out


def _global_rows(dp: int, workers: int, microbatches: int, spec, state=None, mb: int = 2):
    """Rows in global order (rank-interleaved) and the merged state afterwards."""
    iterators = [TrainDataIterator(spec, d, dp, mb, num_workers=workers, state=state) for d in range(dp)]
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for _ in range(microbatches):
        for d, it in enumerate(iterators):
            batch, _ = it.next_microbatch()
            per_rank[d].extend(batch.input_ids)
    rows = [per_rank[d][j] for j in range(len(per_rank[0])) for d in range(dp)]
    return rows, TrainDataIterator.merge_states([it.state_dict() for it in iterators])


def _epoch_samples(spec, stream: int, epoch: int) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) of every sample the stream reads in ``epoch``, in reading order,
    taken straight from the shards and the shuffles."""
    out = []
    for shard in _shard_order(spec, stream, epoch):
        samples = _read_shard(Path(spec.data_dir) / spec.shard_paths[shard])
        for i in _sample_order(spec, shard, epoch, len(samples)):
            out.append((samples[i][0].tolist(), samples[i][1]))
    return out


def _row_documents(batch) -> list[list[int]]:
    """The documents (pieces) of a row, in order: memory-stream tokens per document id."""
    real = batch.is_memory & ~batch.is_padding
    return [batch.target_ids[real & (batch.doc_ids == d)].tolist() for d in range(int(batch.doc_ids[real].max()) + 1)]


@pytest.mark.parametrize("wedlm", [False, True], ids=["ar", "wedlm"])
def test_pretrain_rows_are_filled_and_cover_the_epoch_in_order(pretrain_dir, wedlm):
    """Rows hold the stream's samples concatenated in reading order (nothing dropped or
    duplicated, the next epoch follows), every row is full but for less than a block, pieces
    never cross a sample and are cut at block multiples, and the rows are the ones
    ``pack_documents_into_rows(fill=True)`` makes of the same samples."""
    spec = _spec(pretrain_dir, wedlm=wedlm)
    capacity = row_capacity(spec)
    assert capacity == (SEQ // 2 if wedlm else SEQ)
    seen: dict[str, int] = {}
    continued = 0  # pieces that go on with a sample cut at the end of the previous row
    for stream in range(spec.num_streams):
        epoch0 = [tokens for tokens, _ in _epoch_samples(spec, stream, 0)]
        epoch1 = [tokens for tokens, _ in _epoch_samples(spec, stream, 1)]
        target = sum(map(len, epoch0))
        flat: list[int] = []
        pieces: list[list[int]] = []
        for item in stream_rows(spec, stream, StreamPosition()):
            documents = _row_documents(item.batch)
            assert item.num_tokens == sum(map(len, documents)) >= capacity - spec.row_format.block_size + 1
            pieces.extend(documents)
            flat.extend(t for d in documents for t in d)
            if len(flat) >= target:
                break
        expected = [t for d in epoch0 + epoch1 for t in d]
        assert flat == expected[: len(flat)]
        # each piece lies inside one sample and starts a multiple of block_size into it
        bounds, start = [], 0
        for d in epoch0 + epoch1:
            bounds.append((start, start + len(d)))
            start += len(d)
        cursor = 0
        for piece in pieces:
            sample_start, sample_end = next(b for b in bounds if b[0] <= cursor < b[1])
            assert cursor + len(piece) <= sample_end and (cursor - sample_start) % spec.row_format.block_size == 0
            continued += cursor > sample_start
            cursor += len(piece)
        # the loader and pack_documents_into_rows share one rule
        reference = pack_documents_into_rows(
            [torch.tensor(d) for d in epoch0], 2 * capacity, spec.row_format.block_size, fill=True
        )
        full_rows = [[d.tolist() for d in row.documents] for row in reference[:-1]]
        loader_rows = []
        for item in stream_rows(spec, stream, StreamPosition()):
            if len(loader_rows) == len(full_rows):
                break
            loader_rows.append(_row_documents(item.batch))
        assert loader_rows == full_rows
        for shard in _shard_order(spec, stream, 0):
            seen[spec.shard_paths[shard]] = seen.get(spec.shard_paths[shard], 0) + 1
    assert sorted(seen) == sorted(spec.shard_paths) and set(seen.values()) == {1}  # each shard: one stream
    assert continued > spec.num_streams


@pytest.mark.parametrize("wedlm", [False, True], ids=["ar", "wedlm"])
def test_resume_inside_a_sample_continues_exactly(pretrain_dir, wedlm):
    """A stream re-opened at a row boundary that cut a sample yields the same following rows
    (tokens, masks, positions, documents) as the uninterrupted stream."""
    spec = _spec(pretrain_dir, wedlm=wedlm)
    uninterrupted = []
    for item in stream_rows(spec, 3, StreamPosition()):
        uninterrupted.append(item)
        if len(uninterrupted) == 24:
            break
    cuts = [i for i, item in enumerate(uninterrupted[:-4]) if item.position.token_offset > 0]
    assert len(cuts) >= 2  # documents longer than the space left are continued in the next row
    for i in cuts[:3]:
        resumed = stream_rows(spec, 3, uninterrupted[i].position)
        for expected in uninterrupted[i + 1 : i + 4]:
            got = next(resumed)
            assert got.row_index == expected.row_index and got.position == expected.position
            for field in ("input_ids", "target_ids", "is_masked", "position_ids", "doc_ids", "is_padding"):
                assert torch.equal(getattr(got.batch, field), getattr(expected.batch, field)), field


def test_rows_do_not_depend_on_dp_or_workers(pretrain_dir):
    spec = _spec(pretrain_dir)
    single, _ = _global_rows(1, 0, 8, spec)
    split, _ = _global_rows(2, 2, 4, spec)
    assert len(single) == len(split) == 16
    assert all(torch.equal(a, b) for a, b in zip(single, split))


def test_cached_shards_give_the_rows_of_a_fresh_read_and_follow_a_rewritten_shard(pretrain_dir, tmp_path,
                                                                                   monkeypatch):
    """Several epochs of rows with the decoded-shard cache equal the rows read with no cache; a
    shard rewritten in place is decoded again, not served from the cache."""
    import shutil

    from megatron_wedlm.data import webdataset_loader

    spec = _spec(pretrain_dir, num_streams=2)  # 4 shards a stream: 60 rows span several epochs
    webdataset_loader._shard_cache.clear()
    cached, _ = _global_rows(1, 0, 30, spec)
    assert webdataset_loader._shard_cache  # the shards were kept
    monkeypatch.setattr(webdataset_loader, "SHARD_CACHE_BYTES", 0)
    webdataset_loader._shard_cache.clear()
    fresh, _ = _global_rows(1, 0, 30, spec)
    assert not webdataset_loader._shard_cache
    assert len(cached) == len(fresh) == 60 and all(torch.equal(a, b) for a, b in zip(cached, fresh))

    monkeypatch.undo()
    copy = tmp_path / "data"
    shutil.copytree(pretrain_dir, copy)
    first, second = (copy / spec.shard_paths[i] for i in (0, 1))
    before = [tokens.tolist() for tokens, _ in _read_shard(first)]
    shutil.copyfile(second, first)
    after = [tokens.tolist() for tokens, _ in _read_shard(first)]
    assert after == [tokens.tolist() for tokens, _ in _read_shard(second)] != before


def test_resume_under_another_layout_continues_exactly(pretrain_dir):
    spec = _spec(pretrain_dir)
    uninterrupted, _ = _global_rows(1, 0, 20, spec)
    first, state = _global_rows(2, 1, 4, spec)  # 16 rows under dp=2
    json.loads(json.dumps(state))  # the state is plain JSON (it goes into trainer_state.json)
    rest, _ = _global_rows(4, 2, 3, spec, state=state, mb=1)  # resumed under dp=4, 2 workers
    assert len(first) + len(rest) == 28
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[:28], first + rest))


def test_state_with_other_stream_layout_is_refused(pretrain_dir):
    _, state = _global_rows(1, 0, 1, _spec(pretrain_dir))
    with pytest.raises(ValueError, match="num_streams"):
        TrainDataIterator(_spec(pretrain_dir, num_streams=4), 0, 1, 2, num_workers=0, state=state)
    with pytest.raises(ValueError, match="cannot feed"):
        _spec(pretrain_dir, num_streams=16)
    with pytest.raises(ValueError, match="dp x workers"):
        StreamingRowDataset(_spec(pretrain_dir), 0, 3, 1)


def test_masks_differ_across_streams_and_repeat_for_the_same_row(pretrain_dir):
    spec = _spec(pretrain_dir)
    a = next(stream_rows(spec, 0, StreamPosition())).batch
    b = next(stream_rows(spec, 0, StreamPosition())).batch
    c = next(stream_rows(spec, 1, StreamPosition())).batch
    assert torch.equal(a.is_masked, b.is_masked) and torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.seq_len == SEQ and int((~a.is_padding).sum()) % 2 == 0


def _next_fit_rows(samples: list[tuple[list[int], int]], capacity: int) -> list[list[tuple[list[int], int]]]:
    """Next-fit, written out: a sample that does not fit closes the row; only a sample longer than
    a row is cut (into row-sized pieces), so a prompt stays with its response. Rows of
    (piece, prompt length inside it)."""
    rows: list[list[tuple[list[int], int]]] = [[]]
    for tokens, prompt in samples:
        for start in range(0, len(tokens), capacity):
            piece = tokens[start : start + capacity]
            if sum(len(d) for d, _ in rows[-1]) + len(piece) > capacity:
                rows.append([])
            rows[-1].append((piece, min(max(prompt - start, 0), len(piece))))
    return rows


def test_sft_rows_are_next_fit_and_never_mask_or_learn_prompts(sft_dir):
    spec = _spec(sft_dir, num_streams=4, seq_length=96)
    capacity = row_capacity(spec)
    masked_total = skipped = 0
    for stream in range(spec.num_streams):
        samples = _epoch_samples(spec, stream, 0)
        kept = [(t, p) for t, p in samples if p < min(capacity, len(t))]
        skipped += len(samples) - len(kept)
        expected_rows = _next_fit_rows(kept, capacity)
        rows = stream_rows(spec, stream, StreamPosition())
        for expected in expected_rows[:3]:
            batch = next(rows).batch
            assert _row_documents(batch) == [d for d, _ in expected]
            for doc, (_, prompt_length) in enumerate(expected):
                assert 0 <= prompt_length < capacity  # something left to learn
                slots = batch.doc_ids == doc
                prompt = batch.position_ids < prompt_length
                assert not (slots & prompt & batch.is_masked).any()  # prompts stay observed
                labelled = slots & batch.is_memory & (batch.ar_labels != IGNORE_INDEX)
                assert (batch.position_ids[labelled] + 1 >= prompt_length).all()  # no prompt target
                masked_total += int((slots & batch.is_masked).sum())
    assert masked_total > 0
    assert skipped > 0  # samples whose prompt fills a whole row are skipped (and counted)


def test_pruned_sft_rows_take_a_prompt_at_about_one_slot_a_token(sft_dir):
    """``prune_unmasked_blocks``: next-fit where a sample of n tokens and prompt p takes
    n - max(0, p - B + 1) // 2 token places (written out here), every row within its slots for the
    block offsets drawn, the same pieces in the same order as unpruned rows, in no more rows."""
    plain_spec = _spec(sft_dir, num_streams=4, seq_length=96, random_block_offset=True)
    spec = _spec(sft_dir, num_streams=4, seq_length=96, random_block_offset=True, prune_unmasked_blocks=True)
    capacity = row_capacity(spec)
    pruned_any = False
    for stream in range(spec.num_streams):
        kept = [(t, p) for t, p in _epoch_samples(spec, stream, 0) if p < min(capacity, len(t))]
        expected: list[list[list[int]]] = [[]]
        used = 0
        for tokens, prompt in kept:
            pieces = [tokens[start:start + capacity] for start in range(0, len(tokens), capacity)]
            for number, piece in enumerate(pieces):
                whole = len(pieces) == 1
                places = len(piece) - (max(0, prompt - BLOCK + 1) // 2 if whole else 0)
                if expected[-1] and used + places > capacity:
                    expected.append([])
                    used = 0
                expected[-1].append(piece)
                used += places if number == len(pieces) - 1 else capacity  # a cut piece fills its row
        rows, plain = stream_rows(spec, stream, StreamPosition()), stream_rows(plain_spec, stream, StreamPosition())
        got, unpruned = [], []
        for want in expected[:-1]:
            item = next(rows)
            assert _row_documents(item.batch) == want and item.batch.seq_len == 96
            assert item.num_tokens == sum(map(len, want))
            got += want
            pruned_any |= bool(((~item.batch.is_memory) & ~item.batch.is_padding).sum() < item.num_tokens)
        while sum(map(len, unpruned)) < sum(map(len, got)):
            unpruned += _row_documents(next(plain).batch)
        assert unpruned[: len(got)] == got  # the same pieces, in order, in fewer rows
    assert pruned_any


def test_memory_only_row_is_plain_next_token():
    docs = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
    row = build_memory_only_row(docs, [0, 2], RowFormat(block_size=4, mask_token_id=2, pad_token_id=1))
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row.ar_labels.tolist() == [6, 7, 8, -100, -100, 11, -100]  # doc 2: prompt of 2 tokens
    assert row.is_memory.all() and not row.is_masked.any() and float(row.mlm_weights.sum()) == 0
    mask = row.dense_attention_mask()
    assert not mask[4:, :4].any() and not mask[:4, 4:].any()  # documents isolated
    assert torch.equal(mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())


def test_sft_rows_end_with_learnable_end_tokens(sft_dir):
    """num_learnable_end_tokens=8: every sample is read as prompt + reply + 7 more end tokens
    (the manifest's end_token_id, EOS for raw pairs) and packed next-fit as a whole; the appended
    tokens are learnt as the reply is (AR targets, masked with weight 1/gamma) and no prompt is.
    n=0 and n=1 rows equal the rows of a spec without the option."""
    spec = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=8)
    end = spec.row_format.end_token_id
    eos = json.loads((sft_dir / "manifest.json").read_text())["eos_token_id"]
    assert (spec.row_format.appended_end_tokens, end) == (7, eos)
    capacity = row_capacity(spec)
    appended_masked = 0.0
    for stream in range(spec.num_streams):
        samples = [(t + [end] * 7, p) for t, p in _epoch_samples(spec, stream, 0)]
        expected_rows = _next_fit_rows([(t, p) for t, p in samples if p < min(capacity, len(t))], capacity)
        rows = stream_rows(spec, stream, StreamPosition())
        for expected in expected_rows[:3]:
            batch = next(rows).batch
            assert _row_documents(batch) == [d for d, _ in expected]
            for doc, (tokens, prompt_length) in enumerate(expected):
                slots = batch.doc_ids == doc
                memory = slots & batch.is_memory
                labels = batch.ar_labels[memory]
                assert (labels[: max(prompt_length - 1, 0)] == IGNORE_INDEX).all()  # prompt not learnt
                assert labels[prompt_length:-1].tolist() == tokens[prompt_length + 1 :]  # reply and ends are
                if tokens[-8:] == [end] * 8:  # the whole sample (not a piece cut before its end)
                    tail = slots & (batch.position_ids >= len(tokens) - 7)
                    appended_masked += float(batch.mlm_weights[tail & batch.is_masked].sum())
                assert not (slots & (batch.position_ids < prompt_length) & batch.is_masked).any()
    assert appended_masked > 0  # the appended ends are masked and weighted like reply tokens
    plain = [next(stream_rows(_spec(sft_dir, num_streams=4, seq_length=96), s, StreamPosition())) for s in range(4)]
    for n in (0, 1):
        spec_n = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=n)
        for s, row in enumerate(plain):
            other = next(stream_rows(spec_n, s, StreamPosition()))
            assert all(torch.equal(getattr(row.batch, f), getattr(other.batch, f)) for f in row.batch.tensor_field_names())


def _by_position(batch, doc: int, field: str) -> torch.Tensor:
    """``field`` on document ``doc``'s prediction-stream slots, in logical order."""
    slots = ~batch.is_memory & ~batch.is_padding & (batch.doc_ids == doc)
    return getattr(batch, field)[slots][torch.argsort(batch.position_ids[slots])]


@pytest.mark.parametrize("learnable", [1, 8])
def test_a_masked_reply_end_masks_the_rest_of_its_block_in_loader_rows(sft_dir, pretrain_dir, learnable):
    """wedlm.mask_after_masked_end: the loader's rows hold the plain rows' documents and masks, plus
    every token after a masked end token of its block (raw pairs end a reply with EOS, so with no
    end tokens appended nothing follows it); at 0.5 each block holds either the plain masks or
    those of 1, both kinds occurring; pretraining data, AR rows and shares outside [0, 1] are refused."""
    plain = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=learnable)
    spec = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=learnable, mask_after_masked_end=1.0)
    half = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=learnable, mask_after_masked_end=0.5)
    end = spec.row_format.end_token_id
    assert end == json.loads((sft_dir / "manifest.json").read_text())["eos_token_id"]
    extra, blocks_kept, blocks_extended = 0, 0, 0
    for stream in range(spec.num_streams):
        rows = stream_rows(spec, stream, StreamPosition())
        plain_rows, half_rows = stream_rows(plain, stream, StreamPosition()), stream_rows(half, stream, StreamPosition())
        for _ in range(3):
            batch, before, halfway = next(rows).batch, next(plain_rows).batch, next(half_rows).batch
            assert _row_documents(batch) == _row_documents(before) == _row_documents(halfway)
            for doc in range(len(_row_documents(batch))):
                tokens, blocks = _by_position(batch, doc, "target_ids"), _by_position(batch, doc, "block_ids")
                drawn, got = _by_position(before, doc, "is_masked"), _by_position(batch, doc, "is_masked")
                for i in range(len(tokens)):
                    after_end = any(drawn[j] and tokens[j] == end and blocks[j] == blocks[i] for j in range(i))
                    assert bool(got[i]) == bool(drawn[i] or after_end)
                extra += int(got.sum() - drawn.sum())
                got_half = _by_position(halfway, doc, "is_masked")
                for block in blocks.unique():
                    inside = blocks == block
                    if torch.equal(got[inside], drawn[inside]):
                        continue
                    kept, extended = torch.equal(got_half[inside], drawn[inside]), torch.equal(got_half[inside], got[inside])
                    assert kept or extended
                    blocks_kept, blocks_extended = blocks_kept + kept, blocks_extended + extended
    assert (extra > 0) == (learnable > 1)
    assert (blocks_kept > 0 and blocks_extended > 0) == (learnable > 1)
    with pytest.raises(ValueError, match="mask_after_masked_end is for SFT"):
        _spec(pretrain_dir, mask_after_masked_end=1.0)
    with pytest.raises(ValueError, match="mask_after_masked_end needs WeDLM rows"):
        _spec(sft_dir, wedlm=False, mask_after_masked_end=1.0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]; got 1.5"):
        _spec(sft_dir, mask_after_masked_end=1.5)


def test_resume_with_other_end_tokens_is_refused(sft_dir):
    """Rows (and stream positions inside them) depend on the appended end tokens: a data state
    saved under one setting is refused under another; a state saved before the setting existed
    counts as none appended."""
    spec8 = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=8)
    spec1 = _spec(sft_dir, num_streams=4, seq_length=96, num_learnable_end_tokens=1)
    _, state = _global_rows(1, 0, 1, spec8)
    with pytest.raises(ValueError, match="num_learnable_end_tokens=8"):
        TrainDataIterator(spec1, 0, 1, 2, num_workers=0, state=state)
    old = {k: v for k, v in state.items() if k != "appended_end_tokens"}
    TrainDataIterator(spec1, 0, 1, 2, num_workers=0, state=old)
    with pytest.raises(ValueError, match="num_learnable_end_tokens=1"):
        TrainDataIterator(spec8, 0, 1, 2, num_workers=0, state=old)


def test_old_manifest_without_end_token_falls_back_to_eos(sft_dir, tmp_path):
    """Data prepared before end_token_id was recorded: EOS, said once (a warning)."""
    for file in sft_dir.iterdir():
        if file.is_file():
            (tmp_path / file.name).symlink_to(file)
    manifest = json.loads((sft_dir / "manifest.json").read_text())
    del manifest["end_token_id"]
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="no end_token_id"):
        spec = _spec(tmp_path, num_streams=4, seq_length=96, num_learnable_end_tokens=8)
    assert spec.row_format.end_token_id == manifest["eos_token_id"]


@pytest.mark.parametrize(("overrides", "appended"), [([], 7), (["wedlm.num_learnable_end_tokens=3"], 2),
                                                     (["wedlm.enabled=false"], 0)], ids=["default", "n3", "ar"])
def test_both_engines_read_sft_with_the_configured_end_tokens(sft_dir, overrides, appended):
    """build_train_data is where both engines (Megatron, DeepSpeed) get their rows: WeDLM SFT
    appends n-1 end tokens (default n=8, the reference's), AR SFT none."""
    from megatron_wedlm.config import load_config
    from megatron_wedlm.training.run_data import build_train_data, read_run_manifest, run_row_format

    cfg = load_config(ROOT / "configs" / "sft" / "tiny_cpu.yaml", [f"data.path={sft_dir}", *overrides])
    data = build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1)
    assert data.spec.row_format.appended_end_tokens == appended
    assert data.state_dict()["appended_end_tokens"] == appended


def test_wedlm_prune_unmasked_blocks_reaches_the_rows(sft_dir):
    """The config key reaches the loader, and its rows hold no prediction block without a mask."""
    from megatron_wedlm.config import load_config
    from megatron_wedlm.training.run_data import build_train_data, read_run_manifest, run_row_format

    cfg = load_config(ROOT / "configs" / "sft" / "tiny_cpu.yaml",
                      [f"data.path={sft_dir}", "wedlm.prune_unmasked_blocks=true"])
    data = build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1)
    batch, _ = data.next_microbatch()

    def blocks(where: torch.Tensor) -> set[tuple[int, int, int]]:
        """(row, document, block) of the slots ``where`` holds."""
        rows = torch.nonzero(where, as_tuple=True)[0]
        return set(zip(rows.tolist(), batch.doc_ids[where].tolist(), batch.block_ids[where].tolist()))

    prediction = ~batch.is_memory & ~batch.is_padding
    assert data.spec.row_format.prune_unmasked_blocks and blocks(prediction) == blocks(batch.is_masked)


# --------------------------------------------------------------------------------------------
# Validation rows: fixed by their own seed, dealt to DP ranks as training rows, wrapping when short
# --------------------------------------------------------------------------------------------


ROOT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "tiny_cpu.yaml")


def _valid_rows(pretrain_dir: Path, dp_rank: int, dp_size: int, *overrides: str):
    """This rank's validation rows as a run of the tiny config builds them (held out: the same directory)."""
    from megatron_wedlm.config import load_config
    from megatron_wedlm.training.run_data import build_valid_data, read_run_manifest, run_row_format

    cfg = load_config(ROOT_CONFIG, [f"data.path={pretrain_dir}", f"data.valid_path={pretrain_dir}",
                                    f"data.seq_length={SEQ}", f"wedlm.block_size={BLOCK}", "data.micro_batch_size=2",
                                    "data.global_batch_size=4", "trainer.eval_iters=3", *overrides])
    return build_valid_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), dp_rank, dp_size)


def _rows(batches) -> list[dict[str, torch.Tensor]]:
    """Every row of stacked micro-batches, field by field, in order."""
    return [{k: getattr(b, k)[i] for k in ("input_ids", "is_masked", "mlm_weights", "ar_labels")}
            for b in batches for i in range(b.input_ids.shape[0])]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_validation_rows_are_fixed_whatever_the_training_seed_and_streams(pretrain_dir):
    one = _valid_rows(pretrain_dir, 0, 1)
    assert one.rows == 12 and len(one.batches) == 6 and one.passes == 1
    other = _valid_rows(pretrain_dir, 0, 1, "data.seed=99", "data.num_streams=2", "data.shuffle=false")
    assert _same(_rows(one.batches), _rows(other.batches))
    assert all(bool(r["is_masked"].any()) for r in _rows(one.batches))  # masks drawn (WeDLM rows)


def test_validation_rows_are_dealt_to_data_parallel_ranks_as_training_rows(pretrain_dir):
    whole = _rows(_valid_rows(pretrain_dir, 0, 1).batches)
    ranks = [_rows(_valid_rows(pretrain_dir, d, 2).batches) for d in range(2)]
    assert _same(ranks[0], whole[0::2]) and _same(ranks[1], whole[1::2])  # global row g = j * dp + d


def test_validation_rows_wrap_around_a_short_directory_and_say_so(pretrain_dir):
    from megatron_wedlm.config import load_config
    from megatron_wedlm.training.engine import RankRole
    from megatron_wedlm.training.objective import Objective
    from megatron_wedlm.training.validation import Validator

    short = _valid_rows(pretrain_dir, 0, 1, "trainer.eval_iters=100")  # 400 rows: more than 120 documents fill
    assert short.passes > 1 and short.rows == 400
    assert _valid_rows(pretrain_dir, 0, 1).passes == 1
    role = RankRole(dp_rank=0, dp_size=1, is_logger=True, reports_losses=True, counts_tokens=True, loss_group=None)
    cfg = load_config(ROOT_CONFIG, ["trainer.eval_interval=50"])
    said = Validator(cfg, short, Objective(), role, torch.device("cpu"), end_step=120).describe()
    assert f"documents are read {short.passes} times" in said and "every 50 steps and after step 120" in said
