"""The throughput's FLOP count against a count by hand, and the MFU / per-device arithmetic."""

from __future__ import annotations

import pytest
import torch

from megatron_wedlm.data.dual_stream import build_dual_stream_batch, build_memory_only_row, pad_dual_stream_batch
from megatron_wedlm.data.row_format import RowFormat
from megatron_wedlm.model.hf_config import ModelArgs
from megatron_wedlm.training.throughput import ModelShape, batch_flops, default_peak_tflops, peak_tflops_of

MASK, PAD = 1, 0

# configs/pretrain/tiny_cpu.yaml's model: 2 layers, hidden 64, FFN 128, 4 heads of 16, 2 KV groups;
# a 100-token tokenizer padded to 128 rows (make_vocab_size_divisible_by 64)
TINY = ModelArgs(architecture="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, head_dim=16, vocab_size=100, padded_vocab_size=128,
                 max_position_embeddings=64, rope_theta=1e4, rms_norm_eps=1e-6, qk_layernorm=False,
                 add_qkv_bias=True, tie_word_embeddings=False)

# By hand, per layer: QKV 64 x (64 + 2 x 32) = 8192, output projection 64 x 64 = 4096,
# SwiGLU 3 x 64 x 128 = 24576: 36864; two layers 73728; output layer 64 x 128 = 8192.
# Forward + backward multiply-adds: x 6.
FLOPS_PER_SLOT = 6 * (2 * 36864 + 8192)  # 491520
# QK^T and AV over 4 heads of 16 (64 multiply-adds each per pair), two layers, x 6
FLOPS_PER_PAIR = 6 * 2 * (64 + 64)  # 1536


def _documents() -> list[torch.Tensor]:
    return [torch.arange(10, 18), torch.arange(20, 24)]  # 8 and 4 tokens


def test_per_slot_and_per_pair_flops_equal_the_hand_count():
    shape = ModelShape.from_model_args(TINY)
    assert shape.flops_per_slot() == FLOPS_PER_SLOT == 491520
    assert shape.flops_per_pair() == FLOPS_PER_PAIR == 1536


def test_a_wedlm_row_counts_both_streams_and_the_pairs_its_mask_allows():
    row = build_dual_stream_batch(_documents(), RowFormat(4, MASK, pad_token_id=PAD),
                                  generator=torch.Generator().manual_seed(0), pad_to=32)
    # Slots: 8 + 4 tokens in each stream = 24 real, 8 padding (not counted).
    # Pairs, document of 8 (blocks of 4): memory causal 8 x 9 / 2 = 36; prediction block 0: no
    # earlier memory + causal 4 x 5 / 2 = 10; block 1: 4 slots x 4 memory slots of block 0 + 10 = 26.
    # Document of 4: memory 10, prediction 10. Nothing across documents or into padding.
    pairs = 36 + 10 + 26 + 10 + 10
    expected = 24 * FLOPS_PER_SLOT + pairs * FLOPS_PER_PAIR
    assert batch_flops(ModelShape.from_model_args(TINY), [row]) == expected == 11_937_792


def test_an_ar_row_of_the_same_documents_counts_one_stream_and_causal_pairs():
    row = pad_dual_stream_batch(build_memory_only_row(_documents(), [0, 0], RowFormat(4, MASK, pad_token_id=PAD)), 16)
    pairs = 8 * 9 // 2 + 4 * 5 // 2  # causal inside each document
    assert batch_flops(ModelShape.from_model_args(TINY), [row]) == 12 * FLOPS_PER_SLOT + pairs * FLOPS_PER_PAIR


def test_micro_batches_add_up():
    shape = ModelShape.from_model_args(TINY)
    rows = [build_dual_stream_batch(_documents()[:n], RowFormat(4, MASK, pad_token_id=PAD),
                                    generator=torch.Generator().manual_seed(n), pad_to=32)
            for n in (1, 2)]
    assert batch_flops(shape, rows) == batch_flops(shape, rows[:1]) + batch_flops(shape, rows[1:])


def test_the_output_layer_counts_the_rows_the_model_computes():
    """Megatron computes logits over the padded vocabulary, a HF model over its embedding rows."""
    megatron, hf = ModelShape.from_model_args(TINY), ModelShape.from_model_args(TINY, output_rows=100)
    assert megatron.flops_per_slot() - hf.flops_per_slot() == 6 * 64 * 28


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 3090", None),
])
def test_default_peaks_match_device_names(name, peak):
    assert peak_tflops_of(name) == peak


@pytest.mark.parametrize("bf16", [True, False])
def test_no_default_peak_on_cpu(bf16):
    assert default_peak_tflops(torch.device("cpu"), bf16) is None
