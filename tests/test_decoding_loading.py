"""Loading exported and official-format (``model_type: "wedlm"``) checkpoints without remote code."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_wedlm.decoding import generate, load_wedlm_model
from megatron_wedlm.testing.tiny_models import (
    TinyShape,
    build_tiny_causal_lm,
    build_tiny_model,
    build_tiny_tokenizer,
    write_official_checkpoint,
)

SIZE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)


def _source_model(kind):
    """A random model of the family an official WeDLM checkpoint of this flavour was initialised from.

    ``qwen3-bias``: Qwen3 with q/k/v biases and a zero o_proj bias, the function of the reference
    attention with ``qk_norm`` and ``attention_bias`` both on."""
    tokenizer = build_tiny_tokenizer(vocab_size=300)
    if kind == "llama":
        torch.manual_seed(0)
        # the tokenizer's EOS, not LlamaConfig's default 2 (the mask token here)
        config = LlamaConfig(**{**SIZE, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id})
        return LlamaForCausalLM(config).eval()
    if kind == "qwen3-bias":
        model = build_tiny_causal_lm("qwen3", TinyShape(attention_bias=True, head_dim=8, max_position_embeddings=128),
                                     vocab_size=len(tokenizer))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.bias.zero_()
        return model
    return build_tiny_model(tokenizer, arch=kind, max_position_embeddings=128)


@pytest.mark.parametrize(
    "kind,qk_norm,bias,expected",
    [("qwen3", True, False, "Qwen3ForCausalLM"), ("qwen2", False, True, "Qwen2ForCausalLM"),
     ("llama", False, False, "LlamaForCausalLM"), ("qwen3-bias", True, True, "Qwen3ForCausalLM")],
)
def test_official_wedlm_config_maps_onto_transformers_class(tmp_path, kind, qk_norm, bias, expected):
    source = _source_model(kind)
    write_official_checkpoint(tmp_path, source, qk_norm=qk_norm, attention_bias=bias, mask_token_id=2)
    loaded = load_wedlm_model(tmp_path, device="cpu")
    assert type(loaded).__name__ == expected
    assert loaded.config.mask_token_id == 2
    ids = torch.tensor([[5, 9, 3, 17, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=0, atol=0)
    assert len(generate(loaded, [5, 9, 3], method="streaming", max_new_tokens=4).token_ids) == 4


def test_project_export_loads_and_missing_mask_token_is_named(tmp_path):
    model = _source_model("qwen2")
    model.save_pretrained(tmp_path / "export")
    loaded = load_wedlm_model(tmp_path / "export", device="cpu")
    assert loaded.config.mask_token_id == model.config.mask_token_id
    model.config.mask_token_id = None
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="mask_token_id"):
        load_wedlm_model(tmp_path / "plain", device="cpu")
    assert load_wedlm_model(tmp_path / "plain", device="cpu", require_mask_token=False) is not None


def test_place_false_leaves_the_model_where_it_was_loaded(tmp_path):
    """A training engine places the model itself (DeepSpeed; ZeRO-3 partitions it at load)."""
    _source_model("qwen2").save_pretrained(tmp_path)
    moved = load_wedlm_model(tmp_path, device="meta", dtype=torch.float32)
    kept = load_wedlm_model(tmp_path, device="meta", dtype=torch.float32, place=False)
    assert {p.device.type for p in moved.parameters()} == {"meta"}
    assert {p.device.type for p in kept.parameters()} == {"cpu"}
    assert not kept.training
