"""``--dry-run``: the parameter count, layout and memory per GPU a config implies, before a GPU is used
(``megatron_wedlm/training/memory_plan.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.training.memory_plan import plan_run, rank_parameters

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ROOT / "configs" / "pretrain" / "qwen3_8b.yaml"
FIRST_GPU_RUN = [ROOT / "configs" / "pretrain" / "qwen3_0.6b.yaml", ROOT / "configs" / "sft" / "qwen3_0.6b.yaml",
                 ROOT / "configs" / "pretrain" / "llama3.2_1b.yaml"]
IDS = [f"{p.parent.name}/{p.name}" for p in FIRST_GPU_RUN]


def _load(path: Path, overrides: list[str] = ()):
    return load_config(path, list(overrides), defaults={"trainer": {"task": path.parent.name}})


def test_qwen3_8b_figures_equal_a_hand_count():
    # Qwen3-8B (config.json): 36 layers, hidden 4096, ffn 12288, 32 heads, 8 KV heads of 128, vocab 151936, untied
    L, h, f, heads, groups, d, V = 36, 4096, 12288, 32, 8, 128, 151936
    q, kv = heads * d, groups * d
    matrices = h * (q + 2 * kv) + q * h + 3 * h * f  # QKV, output projection, SwiGLU (split over TP)
    norms = 2 * h + 2 * d  # input and pre-MLP RMSNorm, q/k RMSNorm (replicated)
    total = L * (matrices + norms) + h + 2 * V * h  # + final norm, embedding and output layer
    assert total == 8_190_735_360  # "8.19B" (Qwen3-8B's model card: 8.2B, 6.95B non-embedding)

    plan = plan_run(_load(QWEN3_8B, ["model.vocab_size=151936"]), world_size=64)  # 8 nodes x 8, as its comment

    assert (plan.parameters.total, plan.parameters.embedding) == (total, 2 * V * h)
    lay = plan.layout
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.microbatches_per_rank) == (4, 1, 1, 16, 256 // 16)
    assert lay.tokens_per_step == 256 * 8192 // 2
    tp, dp = 4, 16
    per_gpu = L * (matrices // tp + norms) + h + 2 * V * h // tp
    mem = plan.memory
    assert mem.parameters == per_gpu
    assert mem.weights == 2 * per_gpu  # bf16
    assert mem.gradients == 4 * per_gpu  # fp32 gradient buffer
    assert mem.optimizer == 12 * per_gpu // dp  # fp32 master + 2 Adam moments, distributed over dp
    assert mem.total == mem.weights + mem.gradients + mem.optimizer + mem.activations


def test_the_layout_and_the_model_are_checked_as_training_checks_them():
    cfg = _load(QWEN3_8B, ["model.vocab_size=151936"])
    with pytest.raises(ConfigError, match="not divisible by parallelism.tp"):
        plan_run(cfg, world_size=6)
    with pytest.raises(ConfigError, match="model.vocab_size=N"):  # no checkpoint, data or vocab_size here
        plan_run(_load(QWEN3_8B), world_size=64)
    # a pipeline's first stage holds pp micro-batches of its layers at once (1F1B): the busiest rank here
    piped = plan_run(_load(QWEN3_8B, ["model.vocab_size=151936", "parallelism.pp=2"]), world_size=64)
    assert (piped.memory.stage, piped.memory.microbatches_in_flight) == ("first", 2)
    assert piped.memory.layer_activations * 2 == plan_run(cfg, world_size=64).memory.layer_activations


# and the switches no new config sets: untied output layer, QKV bias, no q/k norm (Qwen2)
QWEN2_UNTIED = ["model.architecture=qwen2", "model.add_qkv_bias=true", "model.qk_layernorm=false",
                "model.tie_word_embeddings=false"]


@pytest.mark.parametrize("path, overrides", [*((p, []) for p in FIRST_GPU_RUN), (FIRST_GPU_RUN[0], QWEN2_UNTIED)],
                         ids=[*IDS, "qwen2-shaped, untied"])
def test_the_parameter_formula_counts_the_model_training_builds(path, overrides):
    """Real hidden sizes and heads, two layers and a small vocabulary (padded to 1024 rows)."""
    from megatron_wedlm.conversion.megatron_checkpoint import megatron_process_group
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks

    plan = plan_run(_load(path, ["model.num_layers=2", "model.vocab_size=1000", *overrides]), world_size=8)
    assert plan.model.padded_vocab_size == 1024
    with megatron_process_group():
        chunks = build_model_chunks(plan.model, BuildSettings(params_dtype=torch.bfloat16, initialize=False))
        built = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    assert plan.parameters.total == built, (plan.parameters, built)
    assert rank_parameters(plan.model, tp=1, pp=1) == {"only": built}


@pytest.mark.parametrize("path", FIRST_GPU_RUN, ids=IDS)
def test_the_dry_run_command_prints_layout_and_memory_and_writes_nothing(path, tmp_path):
    script = ROOT / ("sft/sft_wedlm.py" if path.parent.name == "sft" else "pretrain/pretrain_wedlm.py")
    proc = subprocess.run([sys.executable, str(script), "--config", str(path), "--dry-run", "--world-size", "8"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "layout: world 8 = tp 1 x pp 1 x cp 1 x dp 8; micro-batch 2, global batch 64 rows, 4 gradient" in proc.stdout
    for name in ("weights", "gradients", "optimizer", "activations", "total"):
        assert any(line.strip().startswith(name) and "GiB" in line for line in lines), (name, proc.stdout)
    assert list(tmp_path.iterdir()) == []  # no output directory, no log, no lock
