"""Tiny tokenizers and random HF causal LMs for tests, built locally (nothing downloaded).

This is the project's one way to build small test models. The tokenizer is a byte-level BPE so
that *any* text (code, maths, few-shot prompts) encodes and decodes back exactly, which the
decoding and evaluation tests rely on; its vocabulary is learnt from a few fixed strings so the
build is deterministic and takes milliseconds. Models are real transformers classes (Qwen2,
Qwen3, Qwen3-MoE) with random weights from a fixed seed and ``config.mask_token_id`` set, i.e.
shaped like an exported WeDLM checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# One tokenizer recipe for the tests and the quickstart.
from megatron_wedlm.data.tokenizer import EOS_TOKEN, PAD_TOKEN, as_hf_tokenizer, train_byte_level_bpe

# Text the BPE merges are learnt from: digits/counting, letters, arithmetic, a little Python and
# English, so common test strings become multi-byte tokens rather than all single bytes.
_BASE_TEXTS = (
    " ".join(str(i) for i in range(0, 220)),
    "Count from 3 to 12: 3 4 5 6 7 8 9 10 11 12",
    "Repeat: a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "12 + 35 = 47. 7 x 8 = 56. Question: Answer: The answer is 42. #### 42",
    "def add(a, b):\n    return a + b\n\nassert add(1, 2) == 3\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "The quick brown fox jumps over the lazy dog. A. B. C. D.",
    "\\boxed{\\frac{1}{2}} Problem: Solution:",
)


def build_tiny_tokenizer(
    extra_texts: Iterable[str] = (), vocab_size: int = 400
) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with EOS, PAD and MASK special tokens.

    Its normalizer, pre-tokenizer and decoder are Qwen2's (transformers 5 reloads the tokenizer of
    any qwen2/qwen3 checkpoint as ``Qwen2Tokenizer``), so it survives a save and reload next to a
    qwen2/qwen3 model unchanged.
    """
    return as_hf_tokenizer(train_byte_level_bpe(list(_BASE_TEXTS) + list(extra_texts), vocab_size))


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> PreTrainedModel:
    """A random causal LM of the given family sized for CPU tests, in eval mode, float32.

    ``qwen3_moe``: every layer is 8 experts of width ``hidden_size // 2``, top 2 with normalised
    weights; the router and experts are drawn larger than HF's init (std 0.02), so that routing is
    decisive (no near ties that rounding could flip) and the experts' output outweighs the residual:
    a token routed or combined wrongly then changes the logits.
    """
    families = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
    if arch not in families:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {sorted(families)}")
    config_cls, model_cls = families[arch]
    moe = dict(moe_intermediate_size=hidden_size // 2, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True) if arch == "qwen3_moe" else {}
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **moe,
    )
    config.mask_token_id = tokenizer.mask_token_id
    torch.manual_seed(seed)
    model = model_cls(config)
    if moe:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".mlp.gate." in name or ".mlp.experts." in name:
                    param.normal_(0.0, 0.1)
    return model.eval()


def build_tiny_ar_tokenizer(extra_texts: Iterable[str] = (), vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Like :func:`build_tiny_tokenizer` but without a mask token anywhere in the vocabulary,
    as the tokenizer of a plain AR checkpoint (conversion must add one)."""
    tok = train_byte_level_bpe(list(_BASE_TEXTS) + list(extra_texts), vocab_size, (EOS_TOKEN, PAD_TOKEN))
    return as_hf_tokenizer(tok, mask_token=None)


@dataclass(frozen=True)
class TinyShape:
    """The architecture knobs of :func:`build_tiny_causal_lm` (None: derived from the others)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int | None = None  # None: 2 x hidden_size
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1024
    attention_bias: bool | None = None  # None: the family's default


def build_tiny_causal_lm(
    arch: str = "qwen2",
    shape: TinyShape = TinyShape(),
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A random Qwen2 / Qwen3 / Llama causal LM of ``shape`` (fp32, eval mode).

    For tests that need shapes :func:`build_tiny_model` fixes: Llama, tied embeddings, a
    head_dim other than hidden/heads, a vocabulary sized independently of a tokenizer. Weights
    are scaled up from the config's tiny init (std 0.02) so layers visibly change the logits:
    a mapping bug then shows as a large difference rather than one lost in rounding.
    """
    families = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    if arch not in families:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {sorted(families)}")
    config_cls, model_cls = families[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size or 2 * shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim or shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.rms_norm_eps,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **({} if shape.attention_bias is None else {"attention_bias": shape.attention_bias}),
    )
    if mask_token_id is not None:
        config.mask_token_id = mask_token_id
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))  # not all ones: a swapped norm shows
            else:
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
    return model.eval()


#: Files an official checkpoint's ``auto_map`` points at; the test copies record and refuse any import.
REMOTE_CODE_FILES = ("configuration_wedlm", "modeling_wedlm", "tokenization_wedlm")
#: Written into the checkpoint directory by any of those files if it is ever imported.
REMOTE_CODE_MARKER = "REMOTE_CODE_RAN"

_REMOTE_CODE = """# A stand-in for the checkpoint's own code: importing it is the bug the tests look for.
# (transformers imports a copy from its module cache, so the marker path is absolute.)
with open({marker_path!r}, "a") as _f:
    _f.write({name!r} + "\\n")
raise RuntimeError("remote code ran: {name}")
"""


def write_official_checkpoint(
    directory,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    qk_norm: bool,
    attention_bias: bool,
    mask_token_id: int | None = None,
) -> None:
    """Save ``model`` (a Qwen2 / Qwen3 / Llama model) as a published ``tencent/WeDLM-*`` directory looks.

    ``config.json`` has ``model_type: "wedlm"``, the transformers-4 field names and an ``auto_map``
    (config, model and tokenizer) pointing at Python files placed beside it; those files append
    their name to :data:`REMOTE_CODE_MARKER` in ``directory`` and raise if ever imported. The
    tokenizer (if given) is saved with an ``auto_map`` of its own, as remote-code checkpoints have.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = model.config
    config = {
        "architectures": ["WeDLMForCausalLM"],
        "model_type": "wedlm",
        "auto_map": {
            "AutoConfig": "configuration_wedlm.WeDLMConfig",
            "AutoModel": "modeling_wedlm.WeDLMModel",
            "AutoModelForCausalLM": "modeling_wedlm.WeDLMForCausalLM",
        },
        "qk_norm": qk_norm,
        "attention_bias": attention_bias,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "hidden_act": "silu",
        "tie_word_embeddings": c.tie_word_embeddings,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": "float32",
        "transformers_version": "4.56.0",
    }
    if mask_token_id is not None:
        config["mask_token_id"] = mask_token_id
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in tensors if k.endswith("self_attn.o_proj.bias")]:
        # The reference attention has no output-projection bias: a (zero) one of the source class is left out.
        if tensors.pop(name).any():
            raise ValueError(f"{name} is not zero: the reference WeDLM attention has no o_proj bias")
    save_file(tensors, str(directory / "model.safetensors"))
    for name in REMOTE_CODE_FILES:
        marker = str(directory.resolve() / REMOTE_CODE_MARKER)
        (directory / f"{name}.py").write_text(_REMOTE_CODE.format(name=name, marker_path=marker))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_wedlm.WeDLMTokenizer", None]}
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def remote_code_ran(directory) -> list[str]:
    """Names of the remote-code files of :func:`write_official_checkpoint` that were imported (should be none)."""
    marker = Path(directory) / REMOTE_CODE_MARKER
    return marker.read_text().split() if marker.is_file() else []
