"""``model.init_from``: training starts from a converted HF checkpoint (tools/convert_checkpoint.py).

The check that the weights really arrived: the first logged loss of an AR-mode run (computed
before any update) equals the loss the HF model itself gives on the same packed rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.data.prepare import prepare_dataset, read_manifest
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest
from megatron_wedlm.eval.builtin_tasks import training_corpus
from megatron_wedlm.testing.multiprocess import run_distributed
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer
from megatron_wedlm.training.metrics import read_metrics
from megatron_wedlm.training.model_setup import resolve_model_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """A random Qwen2 HF model shaped like the tiny config, converted to torch_dist, and data."""
    root = tmp_path_factory.mktemp("init")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, "qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    model.save_pretrained(str(root / "hf"))
    tok.save_pretrained(str(root / "hf"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "hf-to-megatron",
         "--input", str(root / "hf"), "--output", str(root / "mcore")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(64, seed=2):
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "data", root / "hf", samples_per_shard=8)
    return {"root": root, "hf": model, "mcore": str(root / "mcore"), "data": str(root / "data")}


def _overrides(conv: dict, out: Path) -> list[str]:
    return [f"model.init_from={conv['mcore']}", f"data.path={conv['data']}", f"trainer.output_dir={out}",
            "logging.progress_bar=false", "wedlm.enabled=false", "trainer.train_steps=3", "optimizer.warmup_steps=0"]


def init_from_worker(overrides: list[str]) -> None:
    from megatron_wedlm.training.loop import run_training

    run_training(load_config(str(TINY), overrides))


def _hf_loss_on_first_step(conv: dict, cfg) -> float:
    """Mean next-token CE of the HF model over the first global batch, document by document.

    Megatron's output layer has the padded vocabulary; conversion fills the extra rows with
    zeros, so they add logits of 0 to the softmax: the reference appends the same columns.
    """
    manifest = read_manifest(conv["data"])
    padded = json.loads((Path(conv["mcore"]) / "wedlm_model.json").read_text())["padded_vocab_size"]
    spec = loader_spec_from_manifest(
        conv["data"], num_streams=cfg.data.num_streams, seq_length=cfg.data.seq_length, wedlm=False,
        block_size=cfg.wedlm.block_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
    )
    assert spec.mask_token_id == manifest["mask_token_id"]
    data = TrainDataIterator(spec, 0, 1, cfg.data.micro_batch_size, num_workers=0)
    total, count = 0.0, 0
    model = conv["hf"]
    for _ in range(cfg.data.global_batch_size // cfg.data.micro_batch_size):
        batch, _ = data.next_microbatch()
        for row in range(batch.input_ids.shape[0]):
            for doc in torch.unique(batch.doc_ids[row][batch.doc_ids[row] >= 0]):
                slots = batch.doc_ids[row] == doc
                ids, labels = batch.input_ids[row][slots], batch.ar_labels[row][slots]
                with torch.no_grad():
                    logits = model(input_ids=ids[None]).logits[0].float()
                logits = torch.cat([logits, logits.new_zeros(logits.shape[0], padded - logits.shape[1])], dim=1)
                keep = labels >= 0
                total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
                count += int(keep.sum())
    return total / count


def test_training_starts_from_the_converted_weights(converted, tmp_path):
    out = tmp_path / "run"
    run_distributed(init_from_worker, 1, _overrides(converted, out), timeout_s=300)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    cfg = load_config(str(TINY), _overrides(converted, out))
    assert records[0]["loss"] == pytest.approx(_hf_loss_on_first_step(converted, cfg), rel=1e-4)
    saved = json.loads((out / "checkpoints" / "iter_0000003" / "wedlm_model.json").read_text())
    assert saved["architecture"] == "qwen2" and saved["mask_token_id"] == read_manifest(converted["data"])["mask_token_id"]


def test_config_keys_that_contradict_the_checkpoint_are_refused(converted, tmp_path):
    cfg = load_config(str(TINY), [*_overrides(converted, tmp_path), "model.hidden_size=32"])
    with pytest.raises(ConfigError, match="model.hidden_size=32 disagrees"):
        resolve_model_args(cfg, read_manifest(converted["data"]), "float32")
    cfg = load_config(str(TINY), _overrides(converted, tmp_path))
    args = resolve_model_args(cfg, read_manifest(converted["data"]), "float32")
    assert cfg.model.qk_layernorm is False and cfg.model.add_qkv_bias is True  # filled from the checkpoint
    assert args.padded_vocab_size % 128 == 0 and args.vocab_size >= read_manifest(converted["data"])["tokenizer_length"]
