"""Data blends (``data.blend``): shares by weight, exact resume per source, refused mixes and states."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.data.blend import BlendedDataIterator, BlendSource, blend_names, next_source
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest, manifest_row_format
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer
from megatron_wedlm.training.run_data import build_train_data, read_run_manifest, run_row_format

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"
SEQ, BLOCK, STREAMS = 64, 4, 4
FIRST, SECOND = "abcdefghijklm", "nopqrstuvwxyz"  # each " x" is one token of the tiny tokenizer


def _letters_doc(rng: random.Random, letters: str) -> str:
    return " ".join(rng.choice(letters) for _ in range(rng.randint(3, 12)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two pretraining sources whose documents have the same token lengths but letters from
    disjoint halves of the alphabet (so a row tells its source), an SFT source, and one
    tokenized with another tokenizer; all 8 shards of 25."""
    root = tmp_path_factory.mktemp("blend")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    build_tiny_tokenizer(["zebra quartz " * 20]).save_pretrained(str(root / "tok2"))
    out = {}
    for name, letters, tok in (("first", FIRST, "tok"), ("second", SECOND, "tok"), ("other_tok", FIRST, "tok2")):
        rng = random.Random(0)  # the same lengths in both sources
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": _letters_doc(rng, letters)}) + "\n" for _ in range(200)))
        prepare_dataset([src], root / name, root / tok, PrepareOptions(samples_per_shard=25))
        out[name] = root / name
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "a b", "response": " c d"}) + "\n" for _ in range(40)))
    prepare_dataset([pairs], root / "sft", root / "tok", PrepareOptions(task="sft", raw_sft=True, samples_per_shard=5))
    out["sft"] = root / "sft"
    return out


def _blend(sources, weights, **kw) -> list[BlendSource]:
    def spec(path):
        return loader_spec_from_manifest(path, manifest_row_format(path, block_size=BLOCK), num_streams=STREAMS,
                                         seq_length=SEQ, wedlm=kw.get("wedlm", False), seed=3)

    return [BlendSource(name, spec(sources[name]), w) for name, w in weights]


def _row_source(tokenizer, ids: torch.Tensor) -> str:
    letters = {c for c in tokenizer.decode(ids.tolist(), skip_special_tokens=True) if c.isalpha()}
    assert letters and (letters <= set(FIRST) or letters <= set(SECOND)), letters  # rows never mix sources
    return "first" if letters <= set(FIRST) else "second"


def test_weights_0_25_0_75_draw_within_two_points_over_2000_documents(sources):
    """Documents counted by their source (from the rows' letters, one EOS per document end)."""
    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.eos_token_id
    it = BlendedDataIterator(_blend(sources, [("first", 1.0), ("second", 3.0)]), 0, 1, 4, num_workers=0)
    documents = {"first": 0, "second": 0}
    tokens = {"first": 0, "second": 0}
    while sum(documents.values()) < 2000:
        batch, _ = it.next_microbatch()
        for row in batch.input_ids:
            real = row[row != tokenizer.pad_token_id]
            source = _row_source(tokenizer, real)
            documents[source] += int((real == eos).sum())
        for name, n in it.take_source_tokens().items():
            tokens[name] += n
    share = documents["first"] / sum(documents.values())
    assert abs(share - 0.25) < 0.02, documents
    assert abs(tokens["first"] / sum(tokens.values()) - 0.25) < 0.02, tokens


def test_schedule_is_megatron_cores_blending_rule():
    """The round sequence equals Megatron-Core's ``build_blending_indices`` (its compiled helper)
    for the same weights, and every prefix keeps each source near its share: within one round
    for two sources, within 1.5 for up to five."""
    import numpy as np
    from megatron.core.datasets import helpers_cpp

    rng = random.Random(0)
    for _ in range(20):
        raw = [rng.uniform(0.05, 1.0) for _ in range(rng.randint(2, 5))]
        weights = [w / sum(raw) for w in raw]
        megatron = np.zeros(400, dtype=np.int16)
        helpers_cpp.build_blending_indices(megatron, np.zeros(400, dtype=np.int64), np.array(weights), len(weights),
                                           400, False)
        counts, ours = [0] * len(weights), []
        for n in range(1, 401):
            ours.append(next_source(weights, counts))
            counts[ours[-1]] += 1
            bound = 1.0 if len(weights) == 2 else 1.5
            assert all(abs(c - w * n) <= bound for c, w in zip(counts, weights)), (n, counts, weights)
        assert ours == megatron.tolist()


def _global_rows(blend, dp: int, microbatches: int, state=None, workers: int = 1, mb: int = 2):
    """Rows in global order as (source index, tokens) and the merged state afterwards."""
    iterators = [BlendedDataIterator(blend, d, dp, mb, num_workers=workers, state=state) for d in range(dp)]
    per_rank: list[list] = [[] for _ in range(dp)]
    for _ in range(microbatches):
        for d, it in enumerate(iterators):
            per_rank[d].extend(it.next_row() for _ in range(mb))
    rows = [per_rank[d][j] for j in range(len(per_rank[0])) for d in range(dp)]
    state = BlendedDataIterator.merge_states([it.state_dict() for it in iterators])
    return [(s, item.batch) for s, item in rows], state


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(getattr(a[1], f), getattr(b[1], f))
                                for f in ("input_ids", "target_ids", "is_masked", "position_ids", "doc_ids"))


def test_resume_from_a_state_yields_the_same_rows_per_source(sources):
    """Stopped after 10 rows under dp=2 (mid-round), resumed under dp=2 and under dp=1: the
    uninterrupted global rows, source by source (WeDLM rows: masks included)."""
    blend = _blend(sources, [("first", 0.3), ("second", 0.7)], wedlm=True)
    uninterrupted, _ = _global_rows(blend, 1, 24, workers=0, mb=1)
    first, state = _global_rows(blend, 2, 5, mb=1)
    state = json.loads(json.dumps(state))  # what trainer_state.json holds
    assert state["rows_consumed"] == 10 and sum(s["rows_consumed"] for s in state["sources"]) == 10
    again, _ = _global_rows(blend, 2, 7, state=state, mb=1)
    other_layout, _ = _global_rows(blend, 1, 14, state=state, workers=0, mb=1)
    assert {s for s, _ in uninterrupted} == {0, 1}
    for resumed in (again, other_layout):
        rows = first + resumed
        assert len(rows) == 24 and all(_same(a, b) for a, b in zip(rows, uninterrupted))
        for source in (0, 1):
            mine = [r for r in rows if r[0] == source]
            assert all(_same(a, b) for a, b in zip(mine, [r for r in uninterrupted if r[0] == source]))


def test_changed_blend_or_single_source_state_is_refused(sources):
    blend = _blend(sources, [("first", 1.0), ("second", 3.0)])
    _, state = _global_rows(blend, 1, 2, workers=0)
    with pytest.raises(ValueError, match=r"saved with the blend \[first=0.25, second=0.75\].*first=0.5.*load_data_state"):
        BlendedDataIterator(_blend(sources, [("first", 1.0), ("second", 1.0)]), 0, 1, 2, num_workers=0, state=state)
    with pytest.raises(ValueError, match="saved with the blend"):
        BlendedDataIterator(_blend(sources, [("second", 3.0), ("first", 1.0)]), 0, 1, 2, num_workers=0, state=state)
    with pytest.raises(ValueError, match="by a blend of several sources.*load_data_state=false"):
        TrainDataIterator(blend[0].spec, 0, 1, 2, num_workers=0, state=state)
    single = TrainDataIterator(blend[0].spec, 0, 1, 2, num_workers=0)
    single.next_microbatch()
    with pytest.raises(ValueError, match="of one source .data.path. but this run blends 2"):
        BlendedDataIterator(blend, 0, 1, 2, num_workers=0, state=TrainDataIterator.merge_states([single.state_dict()]))


def _cfg(tmp_path, blend: str, *extra: str):
    return load_config(str(TINY), [f"trainer.output_dir={tmp_path}", "data.path=null", f"data.blend={blend}", *extra])


def test_sources_with_another_tokenizer_mask_id_or_task_are_refused(sources, tmp_path):
    masked = tmp_path / "other_mask"
    shutil.copytree(sources["second"], masked)
    manifest = json.loads((masked / "manifest.json").read_text())
    manifest["mask_token_id"] += 1
    (masked / "manifest.json").write_text(json.dumps(manifest))
    for other, what in ((sources["other_tok"], "tokenizer files"), (masked, "mask token id"), (sources["sft"], "task")):
        cfg = _cfg(tmp_path, f"[{{path: {sources['first']}}},{{path: {other}, name: odd}}]")
        with pytest.raises(ConfigError, match=rf"'first' \({sources['first']}\) and 'odd' \({other}\) differ in their {what}"):
            read_run_manifest(cfg)
    cfg = _cfg(tmp_path, f"[{{path: {sources['first']}, weight: 1}},{{path: {sources['second']}, weight: 3}}]")
    assert read_run_manifest(cfg)["task"] == "pretrain"
    data = build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1)
    assert isinstance(data, BlendedDataIterator) and data.names == ["first", "second"] and data.weights == [0.25, 0.75]


def test_blend_config_is_checked(tmp_path, sources):
    a, b = sources["first"], sources["second"]
    with pytest.raises(ConfigError, match="data.path and data.blend are both set"):
        load_config(str(TINY), [f"data.blend=[{{path: {a}}}]"])
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(str(TINY), ["data.path=null"])
    for weight in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"data.blend\[1\].weight=.* must be > 0"):
            _cfg(tmp_path, f"[{{path: {a}}},{{path: {b}, weight: {weight}}}]")
    with pytest.raises(ConfigError, match=r"data.blend\[1\].path=.* repeats data.blend\[0\]"):
        _cfg(tmp_path, f"[{{path: {a}}},{{path: {a}/}}]")
    with pytest.raises(ConfigError, match=r"data.blend\[0\].path is required"):
        _cfg(tmp_path, "[{weight: 1}]")
    assert blend_names(["/x/web", "/y/web", "/z/code"], [None, None, "web-2x"]) == ["web", "web-2", "web-2x"]
    with pytest.raises(ValueError, match="unique name"):
        blend_names(["/x/a", "/y/b"], ["same", "same"])
