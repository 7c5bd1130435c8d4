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
from megatron_wedlm.data.prepare import prepare_dataset
from megatron_wedlm.eval.builtin_tasks import training_corpus, training_pairs
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer
from megatron_wedlm.training.checkpointing import complete_checkpoints
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
    prepare_dataset([root / "corpus.jsonl"], root / "pretrain", root / "tok", samples_per_shard=50)
    prepare_dataset([root / "pairs.jsonl"], root / "sft", root / "tok", task="sft", raw_sft=True, samples_per_shard=32)
    return {"pretrain": str(root / "pretrain"), "sft": str(root / "sft")}


def _base(data_dir: str, out: Path, progress_bar: bool = False) -> list[str]:
    return [f"data.path={data_dir}", f"trainer.output_dir={out}", f"logging.progress_bar={str(progress_bar).lower()}"]


def torchrun(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MEGATRON_WEDLM_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / script), *args]
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
    """30 steps, DP=2, through torchrun and pretrain_wedlm.py, with wandb offline."""
    out = tmp_path_factory.mktemp("run") / "uninterrupted"
    proc = torchrun("pretrain/pretrain_wedlm.py", [
        "--config", str(TINY), *_base(data["pretrain"], out, progress_bar=True),
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


def test_wandb_run_is_named_as_configured_and_the_metrics_file_holds_every_key(tmp_path):
    """In process: the run's names through wandb's own run object; the logged keys through the
    metrics file (wandb 0.31 writes its offline log from a Go core and ships no reader for it)."""
    from megatron_wedlm.training.metrics import MetricsLogger

    cfg = load_config(str(TINY), [
        f"trainer.output_dir={tmp_path}", "logging.progress_bar=false", "logging.wandb.enabled=true",
        "logging.wandb.mode=offline", "logging.wandb.group=tests", "logging.wandb.tags=[tiny,ci]",
        "logging.wandb.name=tiny-dp2",
    ])
    logger = MetricsLogger(cfg, {}, 0, True, run_id="run-1")
    record = {key: 1.0 for key in REQUIRED_KEYS} | {"step": 1, "skipped": False, "run_id": "run-1"}
    try:
        logger.log_step(record)
        run = logger.wandb_run
        names = (run.project, run.name, run.group, list(run.tags))
        assert names == ("megatron-wedlm", "tiny-dp2", "tests", ["tiny", "ci"])
    finally:
        logger.close()
    assert set(REQUIRED_KEYS) <= set(read_metrics(tmp_path)[0])
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def _train(config: str, overrides: list[str]) -> dict:
    """One training in this process (a rank of a run_distributed launch); its result as a dict."""
    from megatron_wedlm.training.loop import result_dict, run_training

    return result_dict(run_training(load_config(config, overrides)))
