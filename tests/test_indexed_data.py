"""Megatron indexed datasets (PREFIX.bin / PREFIX.idx) as training data: the documents of a
prepared directory written with Megatron-Core's ``IndexedDatasetBuilder`` give the same rows, the
same losses and the same resume; blends in Megatron-LM's ``--data-path`` form; the checks that
refuse a broken or mismatched prefix before training starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_wedlm.config import ConfigError, check_data_files, load_config
from megatron_wedlm.data.blend import BlendedDataIterator
from megatron_wedlm.data.indexed import read_source_manifest
from megatron_wedlm.data.manifest import read_manifest
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.data.webdataset_loader import (
    TrainDataIterator,
    _read_shard,
    loader_spec_from_manifest,
    manifest_row_format,
)
from megatron_wedlm.eval.builtin_tasks import training_corpus
from megatron_wedlm.runtime.hf_local import tokenizer_files_in
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.testing.tiny_models import build_tiny_ar_tokenizer, build_tiny_tokenizer
from megatron_wedlm.training.run_data import build_train_data, build_valid_data, read_run_manifest, run_row_format
from test_training import LAUNCH_TIMEOUT, TINY, _base, _train, losses, valid_losses

PER_SHARD = 50  # documents per shard, prepared and virtual: 400 documents, 8 shards
FIELDS = ("input_ids", "target_ids", "is_masked", "position_ids", "doc_ids", "is_memory", "is_padding")


def write_prefix(prefix: Path, documents: list[np.ndarray], dtype=np.uint16) -> Path:
    """``prefix``.bin/.idx holding ``documents``, one sequence each, written by Megatron-Core."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for tokens in documents:
        builder.add_item(torch.from_numpy(np.asarray(tokens, dtype=np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def prepared_documents(data_dir: Path) -> list[np.ndarray]:
    """Every document's token ids, in the prepared directory's order (shards, then samples)."""
    return [tokens for shard in read_manifest(data_dir)["shards"] for tokens, _ in _read_shard(data_dir / shard["path"])]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A corpus prepared by tools/prepare_data.py's code, the same documents as a prefix, and a
    second prepared corpus with the same tokenizer (for blends)."""
    root = tmp_path_factory.mktemp("indexed")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    for name, seed in (("corpus", 0), ("other", 7)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in training_corpus(400, seed=seed))
        prepare_dataset([root / f"{name}.jsonl"], root / name, root / "tok",
                        PrepareOptions(samples_per_shard=PER_SHARD))
    write_prefix(root / "corpus_text_document", prepared_documents(root / "corpus"))
    return {"prepared": root / "corpus", "prefix": root / "corpus_text_document", "other": root / "other",
            "tokenizer": root / "corpus" / "tokenizer", "root": root}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Each test checks prefixes with a cache of its own."""
    monkeypatch.setenv("MEGATRON_WEDLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "indexed"


def _cfg(tmp_path: Path, source: str | Path, *extra: str, tokenizer: Path | None = None):
    options = [f"data.tokenizer={tokenizer}"] if tokenizer is not None else []
    cfg = load_config(str(TINY), [f"data.path={source}", f"trainer.output_dir={tmp_path / 'run'}",
                                  f"data.indexed_documents_per_shard={PER_SHARD}", *options, *extra])
    check_data_files(cfg)  # what the entry point checks before training
    return cfg


def _rows(it, microbatches: int) -> list:
    return [it.next_microbatch()[0] for _ in range(microbatches)]


def _same_rows(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


# --------------------------------------------------------------------------------------------
# 1.-3. The same documents, the same rows and losses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wedlm", [True, False], ids=["wedlm", "ar"])
def test_a_prefix_of_the_prepared_documents_gives_the_same_rows(data, tmp_path, wedlm):
    """Through the run's data path (config, manifest, loader workers), 4 streams, 24 rows."""
    mode = f"wedlm.enabled={str(wedlm).lower()}"
    prepared = _cfg(tmp_path, data["prepared"], mode)
    prefix = _cfg(tmp_path, data["prefix"], mode, tokenizer=data["tokenizer"])
    manifest = read_run_manifest(prefix)
    assert [(s["samples"], s["tokens"]) for s in manifest["shards"]] == \
        [(s["samples"], s["tokens"]) for s in read_manifest(data["prepared"])["shards"]]
    assert manifest["shards"][1]["path"] == f"documents:{PER_SHARD}:{2 * PER_SHARD}"
    rows = [_rows(build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1), 12)
            for cfg in (prepared, prefix)]
    assert _same_rows(*rows)
    assert bool(rows[0][0].is_masked.any()) == wedlm


def test_the_same_loss_trajectory_from_a_prefix_as_from_the_prepared_directory(data, tmp_path):
    result = run_distributed(same_losses_worker, 2, {k: str(v) for k, v in data.items()}, str(tmp_path),
                             timeout_s=LAUNCH_TIMEOUT)[0]
    prepared, prefix = losses(tmp_path / "prepared"), losses(tmp_path / "prefix")
    assert sorted(prefix) == [1, 2, 3, 4] and prefix == prepared
    assert valid_losses(tmp_path / "prefix") == valid_losses(tmp_path / "prepared") and valid_losses(tmp_path / "prefix")
    # checkpoints carry data.tokenizer's files, mask token included
    assert result["checkpoint_tokenizer"] == sorted(p.name for p in tokenizer_files_in(data["tokenizer"]))


def same_losses_worker(data: dict[str, str], root: str) -> dict:
    """4 steps on the prepared directory, 4 on the prefix (validating on each at the end), DP=2."""
    steps = ["trainer.train_steps=4", "checkpointing.save_interval=0", "trainer.eval_iters=1"]
    _train(str(TINY), [*_base(data["prepared"], Path(root) / "prepared"), *steps, f"data.valid_path={data['prepared']}",
                       f"data.indexed_documents_per_shard={PER_SHARD}"])
    _train(str(TINY), [*_base(data["prefix"], Path(root) / "prefix"), *steps, f"data.valid_path={data['prefix']}",
                       f"data.tokenizer={data['tokenizer']}", f"data.indexed_documents_per_shard={PER_SHARD}"])
    checkpoint = Path(root) / "prefix" / "checkpoints" / "iter_0000004"
    return {"checkpoint_tokenizer": sorted(p.name for p in tokenizer_files_in(checkpoint))}


def test_a_blend_in_megatron_data_path_form_equals_the_list(data, tmp_path):
    """``"0.3 PREFIX 0.7 DIR"`` (a prefix and a prepared directory mixed) gives the rows of the
    same blend written as a list; paths alone get equal weights."""
    a, b = data["prefix"], data["other"]
    common = ["data.path=null", f"trainer.output_dir={tmp_path}", f"data.tokenizer={data['tokenizer']}",
              f"data.indexed_documents_per_shard={PER_SHARD}"]
    as_string = load_config(str(TINY), [*common, f"data.blend='0.3 {a} 0.7 {b}'"])
    as_list = load_config(str(TINY), [*common, f"data.blend=[{{path: {a}, weight: 0.3}}, {{path: {b}, weight: 0.7}}]"])
    assert as_string.data.blend == as_list.data.blend
    rows = []
    for cfg in (as_string, as_list):
        it = build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1)
        assert isinstance(it, BlendedDataIterator) and it.weights == pytest.approx([0.3, 0.7])
        rows.append(_rows(it, 12))
    assert _same_rows(*rows)
    equal = load_config(str(TINY), [*common, f"data.blend=[{a},{b}]"])
    assert [(s.path, s.weight) for s in equal.data.blend] == [(str(a), 1.0), (str(b), 1.0)]
    with pytest.raises(ConfigError, match="neither weights and paths alternating"):
        load_config(str(TINY), [*common, f"data.blend='0.3 {a} {b}'"])


# --------------------------------------------------------------------------------------------
# 4. Refused before training starts
# --------------------------------------------------------------------------------------------


def _copy_prefix(data, directory: Path, *suffixes: str) -> Path:
    directory.mkdir(exist_ok=True)
    for suffix in suffixes:
        shutil.copy(f"{data['prefix']}{suffix}", directory / f"web{suffix}")
    return directory / "web"


def test_a_cut_bin_or_a_missing_idx_is_named(data, tmp_path):
    cut = _copy_prefix(data, tmp_path / "cut", ".bin", ".idx")
    size = Path(f"{cut}.bin").stat().st_size
    with open(f"{cut}.bin", "r+b") as f:
        f.truncate(size - 6)
    with pytest.raises(ConfigError, match=rf"{cut}.bin holds {size - 6} bytes but {cut}.idx describes {size}: .*"
                                          "re-create .* or the copy was cut short"):
        read_run_manifest(_cfg(tmp_path, cut, tokenizer=data["tokenizer"]))
    lone = _copy_prefix(data, tmp_path / "lone", ".bin")
    with pytest.raises(ConfigError, match=rf"data.path: {lone}: {lone}.idx is missing"):
        read_run_manifest(_cfg(tmp_path, lone, tokenizer=data["tokenizer"]))
    with pytest.raises(ConfigError, match=rf"is one file of a Megatron indexed dataset: name its prefix, {lone}"):
        read_run_manifest(_cfg(tmp_path, f"{lone}.bin"))


def test_token_ids_beyond_the_tokenizer_and_the_mask_token_are_refused(data, tmp_path):
    length = len(build_tiny_tokenizer())
    bad = write_prefix(tmp_path / "bad", [np.array([5, 6, 0]), np.array([7, length + 3, 0])])
    with pytest.raises(ConfigError, match=rf"{bad}.bin holds token id {length + 3} but data.tokenizer=.* has {length} "
                                          "tokens .*tokenized with another tokenizer"):
        read_run_manifest(_cfg(tmp_path, bad, tokenizer=data["tokenizer"]))
    mask = read_manifest(data["prepared"])["mask_token_id"]
    masked = write_prefix(tmp_path / "masked", [np.array([5, mask, 0]), np.array([mask, 6, 0])])
    with pytest.raises(ConfigError, match=rf"{masked}.bin holds the mask token '<\|mask\|>' \(id {mask}\) 2 times"):
        read_run_manifest(_cfg(tmp_path, masked, tokenizer=data["tokenizer"]))


def test_documents_without_eos_are_refused_or_get_it_with_append_eod(data, tmp_path):
    """Every third document from document 1 on lacks its EOS: refused, naming how many and the
    first; with data.append_eod=true the rows are those of the EOS-terminated prefix."""
    documents = prepared_documents(data["prepared"])
    eos = read_manifest(data["prepared"])["eos_token_id"]
    assert all(d[-1] == eos for d in documents)
    cut = write_prefix(tmp_path / "no_eod", [d[:-1] if i % 3 == 1 else d for i, d in enumerate(documents)])
    lacking = len(range(1, len(documents), 3))
    with pytest.raises(ConfigError, match=rf"{cut}: {lacking} of {len(documents)} documents do not end with the EOS "
                                          rf"token \(id {eos}\).* the first is document 1\..*--append-eod.*"
                                          "data.append_eod=true"):
        read_run_manifest(_cfg(tmp_path, cut, tokenizer=data["tokenizer"]))
    appended = _cfg(tmp_path, cut, "data.append_eod=true", tokenizer=data["tokenizer"])
    terminated = _cfg(tmp_path, data["prefix"], tokenizer=data["tokenizer"])
    assert read_run_manifest(appended)["num_tokens"] == read_run_manifest(terminated)["num_tokens"]
    assert _same_rows(*[_rows(build_train_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), {}, 0, 1), 12)
                        for cfg in (appended, terminated)])


def test_a_prefix_needs_a_pretraining_run_and_a_tokenizer_with_a_mask_token(data, tmp_path):
    with pytest.raises(ConfigError, match=r"data.path=.* is a Megatron indexed dataset.* records no tokenizer: set "
                                          "data.tokenizer"):
        _cfg(tmp_path, data["prefix"])
    with pytest.raises(ConfigError, match=r"is a Megatron indexed dataset, whose documents carry no prompt and reply"):
        _cfg(tmp_path, data["prefix"], "trainer.task=sft", tokenizer=data["tokenizer"])
    build_tiny_ar_tokenizer().save_pretrained(str(tmp_path / "ar_tok"))
    with pytest.raises(ConfigError, match=r"has no mask token.*tools/convert_checkpoint.py hf-to-megatron"):
        read_run_manifest(_cfg(tmp_path, data["prefix"], tokenizer=tmp_path / "ar_tok"))
    build_tiny_tokenizer(["zebra quartz " * 20]).save_pretrained(str(tmp_path / "other_tok"))
    with pytest.raises(ConfigError, match=r"data.valid_path=.* was prepared with another tokenizer .*tokenizer files"):
        _cfg(tmp_path, data["prepared"], f"data.valid_path={data['prefix']}", tokenizer=tmp_path / "other_tok")


def test_the_check_reads_the_bin_in_chunks_once_and_a_rewritten_prefix_again(data, tmp_path, cache_dir, monkeypatch,
                                                                             capfd):
    """Progress per chunk on stderr; the result cached under $MEGATRON_WEDLM_CACHE keyed by both
    files; a prefix rewritten in place is checked again, not served from the cache."""
    from megatron_wedlm.data import indexed

    monkeypatch.setattr(indexed, "SCAN_CHUNK_TOKENS", 1000)
    prefix = write_prefix(tmp_path / "web", prepared_documents(data["prepared"]))
    manifest = read_source_manifest(prefix, tokenizer=data["tokenizer"], documents_per_shard=PER_SHARD)
    total = manifest["num_tokens"]
    assert f"checking {prefix}.bin: {total:,} of {total:,} tokens (100%)" in capfd.readouterr().err
    [cache] = list(cache_dir.glob("*.json"))
    saved = json.loads(cache.read_text())
    real = prefix.resolve()
    assert saved["key"]["bin"][:2] == [f"{real}.bin", total * 2] and saved["key"]["idx"][0] == f"{real}.idx"
    assert saved["result"]["max_token_id"] == manifest["indexed"]["max_token_id"] and saved["result"]["documents_without_eod"] == 0
    write_prefix(prefix, [np.array([5, 400, 0])])
    with pytest.raises(ValueError, match="holds token id 400"):
        read_source_manifest(prefix, tokenizer=data["tokenizer"], documents_per_shard=PER_SHARD)
    assert len(list(cache_dir.glob("*.json"))) == 2


# --------------------------------------------------------------------------------------------
# 5. Exact resume
# --------------------------------------------------------------------------------------------


def test_resume_on_a_prefix_continues_at_the_same_row(data, tmp_path):
    """16 rows under dp=2, the state through JSON, the rest under dp=4 with 2 workers: the
    uninterrupted rows; the state is refused on a prefix whose first document grew by a token."""
    manifest = read_source_manifest(data["prefix"], tokenizer=data["tokenizer"], documents_per_shard=PER_SHARD)
    row_format = manifest_row_format(data["prefix"], manifest, block_size=4)
    spec = loader_spec_from_manifest(data["prefix"], row_format, manifest=manifest, num_streams=8, seq_length=64,
                                     wedlm=True, seed=5)

    def global_rows(dp: int, workers: int, microbatches: int, state=None, mb: int = 2):
        iterators = [TrainDataIterator(spec, d, dp, mb, num_workers=workers, state=state) for d in range(dp)]
        per_rank = [[] for _ in range(dp)]
        for _ in range(microbatches):
            for d, it in enumerate(iterators):
                per_rank[d].extend(it.next_microbatch()[0].input_ids)
        rows = [per_rank[d][j] for j in range(len(per_rank[0])) for d in range(dp)]
        return rows, TrainDataIterator.merge_states([it.state_dict() for it in iterators])

    uninterrupted, _ = global_rows(1, 0, 14)
    first, state = global_rows(2, 1, 4)
    state = json.loads(json.dumps(state))
    rest, _ = global_rows(4, 2, 3, state=state, mb=1)
    assert len(first) + len(rest) == 28 and all(torch.equal(a, b) for a, b in zip(uninterrupted, first + rest))

    documents = prepared_documents(data["prepared"])
    longer = write_prefix(tmp_path / "longer", [np.concatenate([[5], documents[0]]), *documents[1:]])
    manifest = read_source_manifest(longer, tokenizer=data["tokenizer"], documents_per_shard=PER_SHARD)
    other = loader_spec_from_manifest(longer, row_format, manifest=manifest, num_streams=8, seq_length=64, wedlm=True,
                                      seed=5)
    with pytest.raises(ValueError, match="another shard set"):
        TrainDataIterator(other, 0, 1, 2, num_workers=0, state=state)


def test_validation_rows_of_a_prefix_are_those_of_the_prepared_directory(data, tmp_path):
    prepared = _cfg(tmp_path, data["prepared"], f"data.valid_path={data['prepared']}", "trainer.eval_iters=1")
    prefix = _cfg(tmp_path, data["prepared"], f"data.valid_path={data['prefix']}", "trainer.eval_iters=1",
                  tokenizer=data["tokenizer"])
    rows = [build_valid_data(cfg, run_row_format(cfg, read_run_manifest(cfg)), 0, 1) for cfg in (prepared, prefix)]
    assert len(rows[0].batches) == 4 and _same_rows(rows[0].batches, rows[1].batches)
