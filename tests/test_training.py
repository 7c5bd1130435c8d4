"""Training through the real command line: ``pretrain_wedlm.py`` under torchrun, 2 processes.

The tiny config (2 layers, hidden 64) on built-in low-entropy data. The other training
behaviours have files of their own, one small launch per behaviour, with the worker next to
its test: ``test_training_resume.py`` (stop/resume, killed save, layouts) and
``test_training_modes.py`` (SFT, AR mode, non-finite steps, ``model.init_from``). They share
the data and launch helpers defined here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_wedlm.config import config_from_yaml_text, load_config
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.eval.builtin_tasks import training_corpus, training_pairs
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer
from megatron_wedlm.training.checkpoint_index import complete_checkpoints
from megatron_wedlm.training.metrics import REQUIRED_KEYS, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"
TINY_SFT = ROOT / "configs" / "sft" / "tiny_cpu.yaml"
LAUNCH_TIMEOUT = 420
PEAK_TFLOPS = 0.5  # what the uninterrupted run measures MFU against


# --------------------------------------------------------------------------------------------
# Data and launch helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("data")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(400, seed=0):
            f.write(json.dumps({"text": doc}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for prompt, completion in training_pairs(256, seed=1):
            f.write(json.dumps({"prompt": prompt, "response": completion}) + "\n")
    with open(root / "held-out.jsonl", "w") as f:  # the same kind of text, other documents
        for doc in training_corpus(40, seed=5):
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "pretrain", root / "tok", PrepareOptions(samples_per_shard=50))
    prepare_dataset([root / "held-out.jsonl"], root / "valid", root / "tok", PrepareOptions(samples_per_shard=50))
    prepare_dataset([root / "pairs.jsonl"], root / "sft", root / "tok",
                    PrepareOptions(task="sft", raw_sft=True, samples_per_shard=32))
    return {"pretrain": str(root / "pretrain"), "sft": str(root / "sft"), "valid": str(root / "valid")}


EVAL_ITERS = 2  # global batches per validation in the tests' runs (16 rows of the tiny config)


def _validation(data: dict[str, str], interval: int = 10) -> list[str]:
    """Overrides that validate on the fixture's held-out rows every ``interval`` steps."""
    return [f"data.valid_path={data['valid']}", f"trainer.eval_interval={interval}", f"trainer.eval_iters={EVAL_ITERS}"]


def valid_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["valid/loss"] for r in read_metrics(out) if "valid/loss" in r}


def _base(data_dir: str, out: Path, progress_bar: bool = False) -> list[str]:
    return [f"data.path={data_dir}", f"trainer.output_dir={out}", f"logging.progress_bar={str(progress_bar).lower()}"]


def torchrun_command(script: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The two-rank torchrun command line for an entry point, and its environment (the CPU runtime
    is chosen by the entry point itself, so an inherited MEGATRON_WEDLM_CPU is dropped)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MEGATRON_WEDLM_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / script), *args]
    return cmd, env


def torchrun(script: str, args: list[str]) -> subprocess.CompletedProcess:
    cmd, env = torchrun_command(script, args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}


def assert_loss_decreases(history: dict[int, float]) -> None:
    steps = sorted(history)
    first = sum(history[s] for s in steps[:5]) / 5
    last = sum(history[s] for s in steps[-5:]) / 5
    assert last < first - 1.0, f"loss did not decrease: first 5 mean {first:.3f}, last 5 mean {last:.3f}"


# --------------------------------------------------------------------------------------------
# torchrun: the real command line
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    """30 steps, DP=2, through torchrun and pretrain_wedlm.py, with wandb offline, validating every 10 steps."""
    out = tmp_path_factory.mktemp("run") / "uninterrupted"
    proc = torchrun("pretrain/pretrain_wedlm.py", [
        "--config", str(TINY), *_base(data["pretrain"], out, progress_bar=True), *_validation(data),
        "checkpointing.save_interval=10", "checkpointing.keep_last=2",
        "logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.group=tests",
        "logging.wandb.tags=[tiny,ci]", "logging.wandb.name=tiny-dp2", f"logging.peak_tflops={PEAK_TFLOPS}",
    ])
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def test_dp2_loss_decreases_and_everything_is_recorded(uninterrupted):
    records = read_metrics(uninterrupted)
    assert [r["step"] for r in records] == list(range(1, 31))
    for record in records:
        assert set(REQUIRED_KEYS) <= set(record)
        assert record["masked_tokens"] > 0 and record["tokens_per_sec"] > 0 and not record["skipped"]
        # throughput per device: the step's model FLOPs over its time on 2 devices, MFU against the set peak
        device_seconds = record["step_time_s"] * 2
        assert record["tflops_per_device"] == pytest.approx(record["step_flops"] / device_seconds / 1e12)
        assert record["mfu"] == pytest.approx(record["tflops_per_device"] / PEAK_TFLOPS)
        assert record["tokens_per_sec_per_device"] == pytest.approx(record["tokens"] / device_seconds)
        assert record["step_flops"] > 0 and record["peak_memory_gib"] > 0
    assert_loss_decreases(losses(uninterrupted))
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(3e-3)  # warmup 2, then peak
    assert records[-1]["lr"] == pytest.approx(3e-4, rel=0.05)  # cosine down to min_lr

    # resolved config saved with the run and with every checkpoint; keep_last=2
    run_config = (uninterrupted / "config.yaml").read_text()
    cfg = config_from_yaml_text(run_config)
    assert cfg.parallelism.dp == 2 and cfg.model.vocab_size is not None
    kept = complete_checkpoints(uninterrupted / "checkpoints")
    assert [step for step, _ in kept] == [20, 30]
    for _, path in kept:
        assert (path / "config.yaml").read_text() == run_config
        assert json.loads((path / "wedlm_model.json").read_text())["num_layers"] == 2
        assert (path / "metadata.json").is_file()
    assert (uninterrupted / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"

    # the console progress bar: steps done / total, loss, tokens per second, ETA
    console = (uninterrupted / "stderr.txt").read_text()
    assert "30/30" in console and "loss=" in console and "tok_s=" in console and "<00:00" in console
    assert "tflops=" in console and "mfu=" in console and "mem=" in console


def test_wandb_offline_run_is_written(uninterrupted):
    runs = list((uninterrupted / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and len(list(runs[0].glob("run-*.wandb"))) == 1


def test_validation_curve_is_logged_to_the_metrics_file_console_and_wandb(uninterrupted):
    from megatron_wedlm.testing.wandb_offline import read_history, read_summary

    records = {r["step"]: r for r in read_metrics(uninterrupted)}
    curve = valid_losses(uninterrupted)
    assert sorted(curve) == [10, 20, 30] and curve[30] < curve[10]  # the held-out loss falls too
    for step in curve:
        record = records[step]
        assert record["valid/loss"] == pytest.approx((record["valid/mlm_loss"] + record["valid/ar_loss"]) / 2, rel=1e-9)
        assert record["valid/masked_tokens"] > 0 and record["valid/tokens"] == records[10]["valid/tokens"]
        assert record["valid/masked_tokens"] == records[10]["valid/masked_tokens"]  # the same rows and masks
    console = (uninterrupted / "stderr.txt").read_text()
    assert console.count("validation loss") == 3 and f"step 30: validation loss {curve[30]:.4f}" in console

    history = {row["_step"]: row for row in read_history(uninterrupted / "wandb")}
    assert {step: row["valid/loss"] for step, row in history.items() if "valid/loss" in row} == curve
    summary = read_summary(uninterrupted / "wandb")
    assert summary["loss"] == records[30]["loss"]  # the last train loss
    for key in ("valid/loss", "valid/mlm_loss", "valid/ar_loss"):
        assert summary[key] == records[30][key]


def test_validation_loss_equals_a_hand_computation_on_the_evaluated_weights(uninterrupted, data):
    """The step-30 checkpoint (the weights validated after step 30), the first EVAL_ITERS x
    global_batch_size rows of the held-out stream rebuilt, the per-slot cross entropy and the
    WeDLM weighting by hand: hidden states from the HF export's decoder (an independent forward),
    logits against the checkpoint's whole output layer (Megatron's vocabulary is padded to
    make_vocab_size_divisible_by and its cross entropy runs over every padded row too)."""
    import torch
    import torch.nn.functional as F

    from megatron_wedlm.conversion.mapping import OUTPUT_LAYER
    from megatron_wedlm.conversion.megatron_checkpoint import MegatronCheckpointReader, megatron_process_group
    from megatron_wedlm.data.dual_stream import stack_dual_stream_batches
    from megatron_wedlm.data.validation_rows import VALIDATION_SEED
    from megatron_wedlm.data.webdataset_loader import (
        StreamPosition,
        loader_spec_from_manifest,
        manifest_row_format,
        stream_rows,
    )
    from megatron_wedlm.deepspeed_backend.forward import model_inputs
    from megatron_wedlm.model.hf_config import load_model_args
    from megatron_wedlm.training.hf_export import load_checkpoint

    cfg = config_from_yaml_text((uninterrupted / "config.yaml").read_text())
    row_format = manifest_row_format(data["valid"], block_size=cfg.wedlm.block_size)
    spec = loader_spec_from_manifest(data["valid"], row_format, num_streams=1, seq_length=cfg.data.seq_length,
                                     wedlm=True, seed=VALIDATION_SEED, shuffle=True)
    rows = stream_rows(spec, 0, StreamPosition())
    batch = stack_dual_stream_batches([next(rows).batch for _ in range(EVAL_ITERS * cfg.data.global_batch_size)])
    checkpoint = uninterrupted / "checkpoints" / "iter_0000030"
    model, _ = load_checkpoint(checkpoint, device="cpu", dtype="float32")
    with megatron_process_group(1, 1):
        output_layer = MegatronCheckpointReader(checkpoint, load_model_args(checkpoint / "wedlm_model.json")).read(
            OUTPUT_LAYER, None).double()
    assert output_layer.shape[0] > len(_tokenizer(checkpoint))  # padded: the HF export drops those rows
    input_ids, position_ids, mask, labels = model_inputs(batch, "dense", torch.float32)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                     use_cache=False).last_hidden_state.double()
    logits = hidden @ output_layer.T
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none").view(labels.shape)
    weights = torch.where(batch.is_masked, 1.0 / batch.mask_ratio.double(), 0.0)  # 1/gamma on masked slots
    mlm = float((weights * ce).sum() / weights.sum())
    labelled = batch.ar_labels >= 0
    ar = float(ce[labelled].sum() / labelled.sum())
    logged = {r["step"]: r for r in read_metrics(uninterrupted)}[30]
    assert logged["valid/masked_tokens"] == int(batch.is_masked.sum())
    assert logged["valid/ar_tokens"] == int(labelled.sum())
    assert logged["valid/mlm_loss"] == pytest.approx(mlm, rel=1e-5)
    assert logged["valid/ar_loss"] == pytest.approx(ar, rel=1e-5)
    assert logged["valid/loss"] == pytest.approx((mlm + ar) / 2, rel=1e-5)  # wedlm.ar_weight=1


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _train(config: str, overrides: list[str]) -> dict:
    """One training in this process (a rank of a run_distributed launch); its result as a dict."""
    from megatron_wedlm.training.loop import result_dict, run_training

    return result_dict(run_training(load_config(config, overrides)))
