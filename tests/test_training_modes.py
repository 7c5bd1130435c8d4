"""Training modes and starting points, each its own small 2-rank launch (real gloo processes,
the tiny CPU config) with its worker next to its test: SFT from a pretraining checkpoint, AR
mode, non-finite steps, and ``model.init_from`` a converted HF checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, config_from_yaml_text, load_config
from megatron_wedlm.data.manifest import read_manifest
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest, manifest_row_format
from megatron_wedlm.eval.builtin_tasks import training_corpus
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer
from megatron_wedlm.training.metrics import read_metrics
from megatron_wedlm.training.model_setup import recorded_model, resolve_model_args
from test_training import (  # noqa: F401  (data: the fixture)
    LAUNCH_TIMEOUT,
    ROOT,
    TINY,
    TINY_SFT,
    _base,
    _train,
    assert_loss_decreases,
    data,
)


def sft_worker(pretrain: str, sft: str, root: str) -> None:
    """30 steps of pretraining, then 12 of SFT with ``model.init_from`` its last checkpoint."""
    pretrained = Path(root) / "pretrain"
    _train(str(TINY), _base(pretrain, pretrained))
    _train(str(TINY_SFT), [*_base(sft, Path(root) / "sft"), "trainer.train_steps=12",
                           f"model.init_from={pretrained / 'checkpoints' / 'iter_0000030'}"])


def test_sft_trains_with_the_same_loop_from_a_pretraining_checkpoint(data, tmp_path):
    run_distributed(sft_worker, 2, data["pretrain"], data["sft"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)
    records = read_metrics(tmp_path / "sft")
    assert len(records) == 12 and all(r["masked_tokens"] > 0 for r in records)
    # started from the pretrained weights: a random init starts near ln(vocab) = ln(512) = 6.2
    assert records[0]["loss"] < 4.5
    assert sum(r["loss"] for r in records[-3:]) < sum(r["loss"] for r in records[:3])
    assert config_from_yaml_text((tmp_path / "sft" / "config.yaml").read_text()).trainer.task == "sft"


def ar_worker(pretrain: str, out: str) -> None:
    _train(str(TINY), [*_base(pretrain, Path(out)), "wedlm.enabled=false", "trainer.train_steps=20"])


def test_ar_mode_is_plain_next_token_training(data, tmp_path):
    run_distributed(ar_worker, 2, data["pretrain"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)
    records = read_metrics(tmp_path)
    assert all(r["masked_tokens"] == 0 and r["mlm_loss"] == 0 and r["loss"] == r["ar_loss"] for r in records)
    assert_loss_decreases({r["step"]: r["loss"] for r in records})


def nonfinite_worker(pretrain: str, out: str) -> str | None:
    """NaN model outputs at step 3 alone, then steps 6, 7, 8 in a row (max_consecutive_nonfinite=3);
    2 micro-batches per rank and step. The poison goes through the objective both engines use."""
    from megatron_wedlm.training.loop import NonFiniteLossError
    from megatron_wedlm.training.objective import Objective

    honest, calls = Objective.contribution, [0]

    def poisoned(self, per_slot_ce, batch, normalizer):
        calls[0] += 1
        step = (calls[0] - 1) // 2 + 1
        return honest(self, per_slot_ce * float("nan") if step in (3, 6, 7, 8) else per_slot_ce, batch, normalizer)

    Objective.contribution = poisoned
    try:
        _train(str(TINY), [*_base(pretrain, Path(out)), "trainer.train_steps=20"])
        return None
    except NonFiniteLossError as err:
        return str(err)
    finally:
        Objective.contribution = honest


def test_nonfinite_steps_are_skipped_logged_and_stop_the_run(data, tmp_path):
    error = run_distributed(nonfinite_worker, 2, data["pretrain"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)[0]
    assert error is not None and "3 consecutive steps" in error
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if r["skipped"]] == [3, 6, 7, 8]
    assert records[-1]["step"] == 8  # stopped right there
    by_step = {r["step"]: r for r in records}
    assert by_step[4]["lr"] == by_step[3]["lr"]  # a skipped step does not advance the schedule
    assert all(isinstance(r["loss"], float) for r in records if not r["skipped"])  # finite elsewhere
    assert all(r["loss"] == "nan" for r in records if r["skipped"])  # written as a string, valid JSON


def test_gradient_check_equals_the_elementwise_check():
    """The sum-first check of the gradient buffers against ``isfinite`` on every element,
    including finite values whose sum overflows (not a bad step) and infinities that cancel."""
    from megatron_wedlm.training.megatron_engine import has_nonfinite

    big = torch.finfo(torch.float32).max
    cases = [torch.randn(1000), torch.full((8,), big), torch.tensor([big, -big, big, big]),
             torch.zeros(0), torch.randn(4, 5).to(torch.bfloat16)]
    generator = torch.Generator().manual_seed(0)
    for special in (float("nan"), float("inf"), float("-inf")):
        for _ in range(20):
            values = torch.randn(257, generator=generator)
            positions = torch.randint(0, 257, (int(torch.randint(1, 4, (1,), generator=generator)),),
                                      generator=generator)
            values[positions] = special
            cases.append(values)
    inf_and_minus_inf = torch.randn(16)
    inf_and_minus_inf[[2, 9]] = torch.tensor([float("inf"), float("-inf")])
    cases.append(inf_and_minus_inf)
    for values in cases:
        assert has_nonfinite(values) == (not bool(torch.isfinite(values).all())), values


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """A random Qwen2 HF model shaped like the tiny config, converted to torch_dist, and data
    tokenized with its tokenizer (``model.init_from``)."""
    root = tmp_path_factory.mktemp("init")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, "qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    model.save_pretrained(str(root / "hf"))
    tok.save_pretrained(str(root / "hf"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "hf-to-megatron",
         "--input", str(root / "hf"), "--output", str(root / "mcore")],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(64, seed=2):
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "data", root / "hf", PrepareOptions(samples_per_shard=8))
    return {"hf": model, "mcore": str(root / "mcore"), "data": str(root / "data")}


def _init_from_overrides(mcore: str, data_dir: str, out: Path) -> list[str]:
    return [*_base(data_dir, out), f"model.init_from={mcore}", "wedlm.enabled=false", "trainer.train_steps=3",
            "optimizer.warmup_steps=0"]


def _hf_loss_on_first_step(conv: dict, cfg) -> float:
    """Mean next-token CE of the HF model over the first global batch, document by document.

    Megatron's output layer has the padded vocabulary; conversion fills the extra rows with
    zeros, so they add logits of 0 to the softmax: the reference appends the same columns.
    The rows of a global batch do not depend on the layout, so one reader here (dp=1) sees what
    the two training ranks (dp=2) saw together.
    """
    padded = json.loads((Path(conv["mcore"]) / "wedlm_model.json").read_text())["padded_vocab_size"]
    spec = loader_spec_from_manifest(
        conv["data"], manifest_row_format(conv["data"], block_size=cfg.wedlm.block_size),
        num_streams=cfg.data.num_streams, seq_length=cfg.data.seq_length, wedlm=False, seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    data = TrainDataIterator(spec, 0, 1, cfg.data.micro_batch_size, num_workers=0)
    total, count = 0.0, 0
    for _ in range(cfg.data.global_batch_size // cfg.data.micro_batch_size):
        batch, _ = data.next_microbatch()
        for row in range(batch.input_ids.shape[0]):
            for doc in torch.unique(batch.doc_ids[row][batch.doc_ids[row] >= 0]):
                slots = batch.doc_ids[row] == doc
                ids, labels = batch.input_ids[row][slots], batch.ar_labels[row][slots]
                with torch.no_grad():
                    logits = conv["hf"](input_ids=ids[None]).logits[0].float()
                logits = torch.cat([logits, logits.new_zeros(logits.shape[0], padded - logits.shape[1])], dim=1)
                keep = labels >= 0
                total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
                count += int(keep.sum())
    return total / count


def init_from_worker(mcore: str, data_dir: str, out: str) -> None:
    _train(str(TINY), _init_from_overrides(mcore, data_dir, Path(out)))


def test_training_starts_from_a_converted_hf_checkpoint(converted, tmp_path):
    """The first logged loss (before any update) equals the HF model's own loss on those rows."""
    run_distributed(init_from_worker, 2, converted["mcore"], converted["data"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    cfg = load_config(str(TINY), _init_from_overrides(converted["mcore"], converted["data"], tmp_path))
    assert records[0]["loss"] == pytest.approx(_hf_loss_on_first_step(converted, cfg), rel=1e-4)
    saved = json.loads((tmp_path / "checkpoints" / "iter_0000003" / "wedlm_model.json").read_text())
    assert saved["architecture"] == "qwen2"
    assert saved["mask_token_id"] == read_manifest(converted["data"])["mask_token_id"]


def test_config_keys_that_contradict_the_checkpoint_are_refused(converted, tmp_path):
    manifest = read_manifest(converted["data"])
    cfg = load_config(str(TINY), [*_init_from_overrides(converted["mcore"], converted["data"], tmp_path),
                                  "model.hidden_size=32"])
    with pytest.raises(ConfigError, match="model.hidden_size=32 disagrees"):
        resolve_model_args(cfg, manifest, "float32")
    cfg = load_config(str(TINY), _init_from_overrides(converted["mcore"], converted["data"], tmp_path))
    args = resolve_model_args(cfg, manifest, "float32")
    model = recorded_model(cfg.model, args)
    assert model.qk_layernorm is False and model.add_qkv_bias is True  # filled from the checkpoint
    assert args.padded_vocab_size % 128 == 0 and args.vocab_size >= manifest["tokenizer_length"]
