"""``--dry-run``: the parameter count, layout and memory per GPU a config implies, before a GPU is used
(``megatron_wedlm/training/memory_plan.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.training.memory_plan import RankParameters, layer_activation_bytes, plan_run, rank_parameters
from megatron_wedlm.training.throughput import ModelShape

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ROOT / "configs" / "pretrain" / "qwen3_8b.yaml"
QWEN3_30B_A3B = ROOT / "configs" / "pretrain" / "qwen3_30b_a3b.yaml"
FIRST_GPU_RUN = [ROOT / "configs" / "pretrain" / "qwen3_0.6b.yaml", ROOT / "configs" / "sft" / "qwen3_0.6b.yaml",
                 ROOT / "configs" / "pretrain" / "llama3.2_1b.yaml"]
IDS = [f"{p.parent.name}/{p.name}" for p in FIRST_GPU_RUN]
# configs whose header comment shows their dry run: the command, then the lines it printed
DRY_RUN_IN_HEADER = [QWEN3_30B_A3B, ROOT / "configs" / "sft" / "qwen3_30b_a3b.yaml"]


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


def test_qwen3_30b_a3b_figures_equal_a_hand_count():
    # Qwen3-30B-A3B (config.json): 48 layers, hidden 2048, 32 heads, 4 KV heads of 128, 128 experts of 768,
    # top-8, vocab 151936, untied, q/k norm; no dense MLP
    L, h, heads, groups, d, E, I, K, V = 48, 2048, 32, 4, 128, 128, 768, 8, 151936
    q, kv = heads * d, groups * d
    attention = h * (q + 2 * kv) + q * h  # split over TP
    norms, router = 2 * h + 2 * d, E * h  # replicated
    expert = 3 * h * I  # one SwiGLU expert: fc1 2I x h, fc2 h x I
    total = L * (attention + norms + router + E * expert) + h + 2 * V * h
    active = total - L * (E - K) * expert  # a token goes through K experts per layer
    assert (total, active) == (30_532_122_624, 3_353_032_704)  # model card: 30.5B, 3.3B activated
    cfg = _load(QWEN3_30B_A3B, ["model.vocab_size=151936"])

    plan = plan_run(cfg, world_size=64)  # 8 nodes x 8, as its comment

    n = plan.parameters
    assert (n.total, n.embedding, n.experts, n.active) == (total, 2 * V * h, L * E * expert, active)
    lay = plan.layout
    assert (lay.tp, lay.pp, lay.ep, lay.etp, lay.dp, lay.expert_dp) == (2, 2, 8, 1, 16, 64 // (2 * 8))
    tp, pp, ep, dp, expert_dp = 2, 2, 8, 16, 4
    # the first stage holds pp micro-batches at once: the busiest rank; its experts: E / ep per layer
    dense = L // pp * (attention // tp + norms + router) + V * h // tp
    experts = L // pp * (E // ep) * expert
    mem = plan.memory
    assert (mem.stage, mem.parameters, mem.expert_parameters) == ("first", dense + experts, experts)
    assert (mem.weights, mem.gradients) == (2 * (dense + experts), 4 * (dense + experts))
    assert mem.optimizer == 12 * dense // dp + 12 * experts // expert_dp  # dense over dp x cp, experts over expert-dp
    # a MoE layer keeps its router's 9 bytes per expert and the K routed copies of its share of the tokens
    # (sequence parallel: s / tp), each with the expert's input and 5 values per unit of its width
    s, u = 8192, 2
    attention_part = u * s * (4 * h // tp + (3 * q + 3 * kv) // tp)
    experts_part = s // tp * K * u * (h + 5 * I)
    assert mem.layer_activations == L // pp * (attention_part + s // tp * 9 * E + experts_part)
    assert mem.microbatches_in_flight == 2
    # a capacity factor bounds what a rank's experts take: 1.5 x the even share
    capped = plan_run(_load(QWEN3_30B_A3B, ["model.vocab_size=151936", "model.moe_capacity_factor=1.5"]), 64)
    assert capped.memory.layer_activations - mem.layer_activations == L // pp * experts_part // 2
    # model FLOPs: 6 per active matrix parameter (the input embedding is a lookup, norms are not counted)
    flops = ModelShape.from_model_args(plan.model).flops_per_slot()
    assert flops == 6 * (L * (attention + router + K * expert) + h * V) == 6 * (active - V * h - L * norms - h)


def test_experts_split_over_ep_and_etp_and_their_optimizer_state_over_the_expert_data_parallel_ranks():
    base = ["model.vocab_size=151936", "parallelism.pp=1"]
    whole = plan_run(_load(QWEN3_30B_A3B, base), world_size=64)
    split = plan_run(_load(QWEN3_30B_A3B, [*base, "parallelism.etp=2"]), world_size=64)
    assert (whole.layout.expert_dp, split.layout.expert_dp) == (64 // 8, 64 // (8 * 2))
    assert whole.memory.expert_parameters == 2 * split.memory.expert_parameters
    assert whole.memory.parameters - whole.memory.expert_parameters == (split.memory.parameters
                                                                       - split.memory.expert_parameters)
    # half the experts' weights per rank, over half the ranks: the same optimizer bytes
    assert whole.memory.optimizer == split.memory.optimizer
    # etp 2 gathers both TP ranks' routed copies: twice the experts' inputs (h each), the SwiGLU split
    args, kw = whole.model, dict(tp=2, sequence_parallel=True, recompute="selective")
    tokens = 8192 // 2  # a rank's share under sequence parallelism
    assert (layer_activation_bytes(args, 8192, 1, etp=2, **kw) - layer_activation_bytes(args, 8192, 1, etp=1, **kw)
            == tokens * args.moe_topk * 2 * args.hidden_size)
    with pytest.raises(ConfigError, match="does not divide the 32 ranks of each pipeline stage"):
        plan_run(_load(QWEN3_30B_A3B, ["model.vocab_size=151936", "parallelism.ep=64"]), world_size=64)


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


TINY_MOE = ["model.num_experts=8", "model.moe_topk=2", "parallelism.ep=2"]  # 8 experts of 768, top-2


@pytest.mark.parametrize("path, overrides", [*((p, []) for p in FIRST_GPU_RUN), (FIRST_GPU_RUN[0], QWEN2_UNTIED),
                                             (QWEN3_30B_A3B, TINY_MOE)],
                         ids=[*IDS, "qwen2-shaped, untied", "qwen3_30b_a3b-shaped, 8 experts"])
def test_the_parameter_formula_counts_the_model_training_builds(path, overrides):
    """Real hidden sizes and heads, two layers and a small vocabulary (padded to 1024 rows)."""
    from megatron_wedlm.conversion.megatron_checkpoint import megatron_process_group
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks

    plan = plan_run(_load(path, ["model.num_layers=2", "model.vocab_size=1000", *overrides]), world_size=8)
    assert plan.model.padded_vocab_size == 1024
    with megatron_process_group():
        chunks = build_model_chunks(plan.model, BuildSettings(params_dtype=torch.bfloat16, initialize=False))
        named = [(name, p.numel()) for chunk in chunks for name, p in chunk.named_parameters()]
    built = sum(count for _, count in named)
    experts = sum(count for name, count in named if ".mlp.experts." in name)  # reduced over expert-dp
    assert (plan.parameters.total, plan.parameters.experts) == (built, experts), (plan.parameters, built, experts)
    assert rank_parameters(plan.model, tp=1, pp=1) == {"only": RankParameters(built - experts, experts)}


def _header_dry_run(path: Path) -> tuple[list[str], list[str]]:
    """The dry run's arguments a config's header comment shows, and the lines it printed there."""
    header = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(header) if line.startswith("python ") and "--dry-run" in line)
    command = header[start].split()
    return command[command.index("--dry-run"):], header[start + 1:]


@pytest.mark.parametrize("path", FIRST_GPU_RUN + DRY_RUN_IN_HEADER, ids=IDS + ["pretrain/qwen3_30b_a3b.yaml",
                                                                              "sft/qwen3_30b_a3b.yaml"])
def test_the_dry_run_command_prints_layout_and_memory_and_writes_nothing(path, tmp_path):
    script = ROOT / ("sft/sft_wedlm.py" if path.parent.name == "sft" else "pretrain/pretrain_wedlm.py")
    if path in DRY_RUN_IN_HEADER:  # what the header says is what the dry run prints now
        arguments, printed = _header_dry_run(path)
    else:
        arguments = ["--dry-run", "--world-size", "8"]
        printed = ["layout: world 8 = tp 1 x pp 1 x cp 1 x dp 8; micro-batch 2, global batch 64 rows, 4 gradient"]
    proc = subprocess.run([sys.executable, str(script), "--config", str(path), *arguments],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for line in printed:
        assert line in proc.stdout, (line, proc.stdout)
    for name in ("weights", "gradients", "optimizer", "activations", "total"):
        assert any(line.strip().startswith(name) and "GiB" in line for line in lines), (name, proc.stdout)
    if path in DRY_RUN_IN_HEADER:  # written for 80 GB GPUs (74.5 GiB): a fifth left for what is not counted
        total = next(float(line.split()[1]) for line in lines if line.strip().startswith("total"))
        assert total < 0.8 * 80e9 / 2**30, proc.stdout
    assert list(tmp_path.iterdir()) == []  # no output directory, no log, no lock
