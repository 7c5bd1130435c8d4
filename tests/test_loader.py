"""Streaming webdataset loader: coverage per epoch, layout independence, exact resume, SFT rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megatron_wedlm.data.dual_stream import IGNORE_INDEX
from megatron_wedlm.data.prepare import prepare_dataset
from megatron_wedlm.data.webdataset_loader import (
    StreamPosition,
    StreamingRowDataset,
    TrainDataIterator,
    build_memory_only_row,
    loader_spec_from_manifest,
    merge_data_states,
    row_capacity,
    stream_rows,
)
from megatron_wedlm.data.webdataset_loader import _chunks, _read_shard, _sample_order, _shard_order
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

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
    prepare_dataset([src], root / "data", tokenizer_dir, samples_per_shard=15)
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
    prepare_dataset([src], root / "data", tokenizer_dir, task="sft", raw_sft=True, samples_per_shard=6)
    return root / "data"


def _spec(data_dir: Path, wedlm: bool = True, **kw):
    args = dict(num_streams=8, seq_length=SEQ, wedlm=wedlm, block_size=BLOCK, seed=5)
    args.update(kw)
    return loader_spec_from_manifest(data_dir, **args)


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
    return rows, merge_data_states([it.state_dict() for it in iterators])


def _epoch_chunks(spec, stream: int) -> list:
    """The stream's chunks (and skip markers) of epoch 0, in order."""
    out = []
    for item in _chunks(spec, stream, StreamPosition()):
        position = item if isinstance(item, StreamPosition) else item.position
        if position.epoch > 0:
            return out
        out.append(item)
    raise AssertionError("unreachable")


def test_one_epoch_covers_every_sample_once(pretrain_dir):
    """Each sample is read exactly once per epoch (by exactly one stream), cut into chunks that
    reassemble it, and rows carry those chunks in order without loss or duplication."""
    spec = _spec(pretrain_dir, wedlm=False)
    samples = _shard_tokens(spec)
    seen: dict[str, list[int]] = {}
    for stream in range(spec.num_streams):
        chunks = [c for c in _epoch_chunks(spec, stream) if not isinstance(c, StreamPosition)]
        for chunk in chunks:
            pos = chunk.position
            shard = _shard_order(spec, stream, 0)[pos.shard_cursor]
            count = sum(1 for key in samples if key.startswith(f"{shard}:"))
            key = f"{shard}:{_sample_order(spec, shard, 0, count)[pos.sample_cursor]}"
            assert len(seen.get(key, [])) == pos.token_offset  # chunks arrive in order, none twice
            seen.setdefault(key, []).extend(chunk.tokens.tolist())
        # rows hold exactly this chunk sequence (the last, unfinished row is still pending)
        row_tokens: list[int] = []
        for item in stream_rows(spec, stream, StreamPosition()):
            if item.position.epoch > 0:
                break
            row_tokens.extend(item.batch.input_ids[~item.batch.is_padding].tolist())
        flat = [t for c in chunks for t in c.tokens.tolist()]
        assert row_tokens == flat[: len(row_tokens)]
        assert len(flat) - len(row_tokens) <= row_capacity(spec)
    assert seen == samples


def test_rows_do_not_depend_on_dp_or_workers(pretrain_dir):
    spec = _spec(pretrain_dir)
    single, _ = _global_rows(1, 0, 8, spec)
    split, _ = _global_rows(2, 2, 4, spec)
    assert len(single) == len(split) == 16
    assert all(torch.equal(a, b) for a, b in zip(single, split))


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


def test_sft_rows_never_mask_or_learn_prompts(sft_dir):
    spec = _spec(sft_dir, num_streams=4, seq_length=96)
    masked_total = skipped = 0
    for stream in range(spec.num_streams):
        items = _epoch_chunks(spec, stream)
        skipped += sum(isinstance(c, StreamPosition) for c in items)
        chunks = iter([c for c in items if not isinstance(c, StreamPosition)])
        rows = stream_rows(spec, stream, StreamPosition())
        for _ in range(3):
            batch = next(rows).batch
            for doc in range(int(batch.doc_ids.max()) + 1):
                chunk = next(chunks)
                assert 0 <= chunk.prompt_length < chunk.tokens.numel()  # something left to learn
                slots = batch.doc_ids == doc
                assert torch.equal(batch.target_ids[slots & batch.is_memory], chunk.tokens)
                prompt = batch.position_ids < chunk.prompt_length
                assert not (slots & prompt & batch.is_masked).any()  # prompts stay observed
                labelled = slots & batch.is_memory & (batch.ar_labels != IGNORE_INDEX)
                assert (batch.position_ids[labelled] + 1 >= chunk.prompt_length).all()  # no prompt target
                masked_total += int((slots & batch.is_masked).sum())
    assert masked_total > 0
    assert skipped > 0  # samples whose prompt fills a whole row are skipped (and counted)


def test_memory_only_row_is_plain_next_token():
    docs = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
    row = build_memory_only_row(docs, [0, 2], block_size=4, mask_token_id=2, pad_token_id=1)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row.ar_labels.tolist() == [6, 7, 8, -100, -100, 11, -100]  # doc 2: prompt of 2 tokens
    assert row.is_memory.all() and not row.is_masked.any() and float(row.mlm_weights.sum()) == 0
    mask = row.dense_attention_mask()
    assert not mask[4:, :4].any() and not mask[:4, 4:].any()  # documents isolated
    assert torch.equal(mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
