"""HF <-> Megatron checkpoint conversion on one process: round trips, logits, mask token, export, errors.

Models are tiny random Qwen2 / Qwen3 / Llama built from configs (weights scaled up so a wrong
mapping moves logits by O(1)); every family runs with tied and untied embeddings, GQA, a
non-default rope theta and RMS eps, and Qwen3 with head_dim != hidden / heads. The vocabulary
(400) is not a multiple of 128, so Megatron pads it (512) and export must trim it back.
Qwen3-MoE (8 experts, top 2) runs with both routings: top-k renormalised and softmax over all.

Tolerance: fp32. Megatron and transformers compute the same functions with different kernels
(baddbmm softmax vs SDPA, fused vs split QKV matmuls), observed max |diff| ~3e-6 on logits of
magnitude ~5; 1e-5 still catches any layout error, which shows at 1e-1.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_wedlm.conversion import (
    ConversionError,
    build_conversion_model,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    load_megatron_weights,
    megatron_process_group,
)
from megatron_wedlm.conversion.mapping import (
    EXPERT,
    experts_of,
    global_rules,
    layer_rules,
    megatron_shape,
    stacked_dims,
)
from megatron_wedlm.model.hf_config import (
    ModelArgs,
    UnsupportedModelError,
    hf_config_from_model_args,
    load_model_args,
    model_args_from_hf_config,
)
from megatron_wedlm.runtime.atomic_output import OutputDirError
from megatron_wedlm.testing.checkpoint_files import safetensors_of
from megatron_wedlm.testing.tiny_models import (
    TinyShape,
    build_tiny_ar_tokenizer,
    build_tiny_causal_lm,
    build_tiny_tokenizer,
    write_official_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5
ARCHS = {
    "qwen2": TinyShape(num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3": TinyShape(num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6),
    "llama": TinyShape(num_kv_heads=2, rope_theta=5e5, rms_norm_eps=1e-5),
}
CASES = [(arch, tied) for arch in ARCHS for tied in (False, True)]
CASE_IDS = [f"{arch}-{'tied' if tied else 'untied'}" for arch, tied in CASES]


def make_hf_dir(directory: Path, arch: str, tied: bool, tokenizer=None, vocab_size: int | None = None, seed: int = 0):
    tokenizer = tokenizer or build_tiny_tokenizer()
    model = build_tiny_causal_lm(
        arch, replace(ARCHS[arch], num_layers=4, tie_word_embeddings=tied), vocab_size=vocab_size or len(tokenizer),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=seed,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def causal_input(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def build_megatron_model(kind: str, args: ModelArgs):
    """Megatron's own GPT with the local spec ("gpt"), or the WeDLM model built as training builds it."""
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks
    from megatron_wedlm.testing.gpt_equivalence import build_gpt

    if kind == "gpt":
        return build_gpt(args)
    (model,) = build_model_chunks(args, BuildSettings())
    return model


def megatron_logits(args: ModelArgs, ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    with megatron_process_group():
        model = build_megatron_model("gpt", args).eval()
        load_megatron_weights(model, ckpt)
        with torch.no_grad():
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return model(ids, positions, None)[..., : args.vocab_size]


def wedlm_rows(mask_token_id: int, vocab: int):
    """Two packed dual-stream rows (three documents, an SFT prompt, padding), stacked ``[2, S]``."""
    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches

    g = torch.Generator().manual_seed(7)
    rows = []
    for lengths, prompt in (([11, 7], [3, 0]), ([13], [0])):
        tokens = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        rows.append(build_dual_stream_batch(tokens, RowFormat(4, mask_token_id), g, prompt_lengths=prompt))
    return stack_dual_stream_batches(rows, pad_to=40)


def hf_wedlm_logits(model, rows) -> torch.Tensor:
    """The HF model on a dual-stream batch: logical positions and the WeDLM rule as an additive
    4-D float mask (a bool mask is misread by eager attention in transformers 5)."""
    allowed = rows.dense_attention_mask(padding_attends_self=True)
    mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(rows.input_ids, position_ids=rows.position_ids, attention_mask=mask[:, None]).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case converted HF -> Megatron -> HF once; tests look at different sides of it."""
    out = {}
    for (arch, tied), case_id in zip(CASES, CASE_IDS):
        root = tmp_path_factory.mktemp(case_id)
        model, tokenizer = make_hf_dir(root / "hf", arch, tied)
        args = convert_hf_to_megatron(root / "hf", root / "megatron")
        convert_megatron_to_hf(root / "megatron", root / "export")
        out[case_id] = dict(root=root, model=model, tokenizer=tokenizer, args=args)
    return out


# --------------------------------------------------------------------------------------------
# The mapping agrees with Megatron
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", CASES, ids=CASE_IDS)
def test_rules_name_every_megatron_parameter_and_checkpoint_key(converted, arch, tied):
    assert_rules_match_megatron(converted[f"{arch}-{'tied' if tied else 'untied'}"]["args"])


def assert_rules_match_megatron(args: ModelArgs) -> None:
    """The mapping's parameter names, keys and shapes are exactly those of the model conversion
    builds (one process: local expert i is global expert i)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    expected_params, expected_keys = {}, {}
    for rule in global_rules(args):
        expected_params[rule.param] = megatron_shape(rule, args)
        expected_keys[rule.key] = megatron_shape(rule, args)
    for layer in range(args.num_layers):
        for rule in layer_rules(args):
            for expert in experts_of(rule, args):
                param = rule.param.replace(EXPERT, str(expert))
                expected_params[f"decoder.layers.{layer}.{param}"] = megatron_shape(rule, args)
            expected_keys[rule.key] = (*stacked_dims(rule, args), *megatron_shape(rule, args))
    with megatron_process_group():
        model = build_conversion_model(args)
        params = {name: tuple(p.shape) for name, p in model.named_parameters()}
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
        keys = {t.key: tuple(t.global_shape) for t in nested_values(sharded) if isinstance(t, ShardedTensor)}
    assert params == expected_params
    assert keys == expected_keys


# --------------------------------------------------------------------------------------------
# HF -> Megatron -> HF
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", CASES, ids=CASE_IDS)
def test_round_trip_reproduces_every_tensor_exactly(converted, arch, tied):
    case = converted[f"{arch}-{'tied' if tied else 'untied'}"]
    original = safetensors_of(case["root"] / "hf")
    exported = safetensors_of(case["root"] / "export")
    assert sorted(exported) == sorted(original)
    assert ("lm_head.weight" in exported) is not tied
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("arch,tied", CASES, ids=CASE_IDS)
def test_round_trip_keeps_the_config_and_records_the_mask_token(converted, arch, tied):
    case = converted[f"{arch}-{'tied' if tied else 'untied'}"]
    before = json.loads((case["root"] / "hf" / "config.json").read_text())
    after = json.loads((case["root"] / "export" / "config.json").read_text())
    assert after["mask_token_id"] == case["tokenizer"].mask_token_id
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "max_position_embeddings", "eos_token_id", "pad_token_id", "dtype"):
        assert after.get(key) == before.get(key), key
    assert (case["root"] / "export" / "generation_config.json").is_file()
    exported_tokenizer = (case["root"] / "export" / "tokenizer.json").read_bytes()
    assert exported_tokenizer == (case["root"] / "hf" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch,tied", CASES, ids=CASE_IDS)
def test_megatron_logits_equal_hf_logits(converted, arch, tied):
    case = converted[f"{arch}-{'tied' if tied else 'untied'}"]
    args = case["args"]
    assert args.padded_vocab_size == 512 and args.vocab_size == 400  # padding is exercised
    ids = causal_input(args.vocab_size)
    with torch.no_grad():
        reference = case["model"](ids).logits
    got = megatron_logits(args, case["root"] / "megatron", ids)
    assert reference.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert (got - reference).abs().max().item() < ATOL


@pytest.mark.parametrize("case_id", ["qwen2-untied", "qwen3-tied", "llama-untied"])
def test_wedlm_model_on_a_dual_stream_batch_equals_hf_with_the_mask(converted, case_id):
    """Cross-implementation check of the training path: the converted weights in the WeDLM
    model (logical-position RoPE, WeDLM mask) vs HF given the same positions and mask."""
    case = converted[case_id]
    args = case["args"]
    rows = wedlm_rows(args.mask_token_id, args.vocab_size)
    assert rows.is_masked.any() and rows.is_padding.any()
    reference = hf_wedlm_logits(case["model"], rows)
    with megatron_process_group():
        model = build_megatron_model("wedlm", args).eval()
        load_megatron_weights(model, case["root"] / "megatron")
        with torch.no_grad():
            got = model(rows.input_ids, rows.position_ids, attention_metadata=rows.attention_metadata())
    real = ~rows.is_padding  # padding slots compute nothing meaningful
    assert reference[real].abs().max() > 1.0
    assert (got[..., : args.vocab_size][real] - reference[real]).abs().max().item() < ATOL


def test_checkpoint_with_module_named_norms_loads_and_exports(converted, tmp_path):
    """Megatron's local spec stores layer norms under TE's names; a layer spec without that keys
    map stores ``input_layernorm.weight``. Both directions accept either."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    case = converted["qwen3-tied"]
    args = case["args"]
    with megatron_process_group():
        model = build_megatron_model("gpt", args)
        load_megatron_weights(model, case["root"] / "megatron")
        sharded = model.sharded_state_dict()
        for item in nested_values(sharded):
            if isinstance(item, ShardedTensor):
                item.key = item.key.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
                item.key = item.key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
        (tmp_path / "renamed").mkdir()
        dist_checkpointing.save(sharded, str(tmp_path / "renamed"))
        keys = dist_checkpointing.load_tensors_metadata(str(tmp_path / "renamed"))
    assert "decoder.layers.input_layernorm.weight" in keys
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" not in keys
    ids = causal_input(args.vocab_size)
    with torch.no_grad():
        assert (megatron_logits(args, tmp_path / "renamed", ids) - case["model"](ids).logits).abs().max() < ATOL
    convert_megatron_to_hf(tmp_path / "renamed", tmp_path / "export", model_args=case["root"] / "megatron")
    original, exported = safetensors_of(case["root"] / "hf"), safetensors_of(tmp_path / "export")
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_exported_directory_loads_and_generates_like_the_original(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_wedlm.decoding.loading import load_wedlm_model

    case = converted["qwen3-tied"]
    export = case["root"] / "export"
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    prompt = tokenizer("Count from 3 to 12:", return_tensors="pt").input_ids
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    generated = model.generate(prompt, **settings)
    assert generated.shape[1] == prompt.shape[1] + 8
    assert torch.equal(generated, case["model"].generate(prompt, **settings))
    assert load_wedlm_model(export, device="cpu").config.mask_token_id == tokenizer.mask_token_id


def test_large_exports_are_sharded_with_an_index(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    case = converted["llama-untied"]
    files = convert_megatron_to_hf(case["root"] / "megatron", tmp_path / "sharded", max_shard_size="40KB")
    assert len(files) > 2 and all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert safetensors_of(tmp_path / "sharded").keys() == safetensors_of(case["root"] / "hf").keys()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    ids = causal_input(400)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, case["model"](ids).logits)


def test_training_checkpoint_layout_is_found_from_an_iteration_directory(converted, tmp_path):
    """Training runs keep wedlm_model.json and the tokenizer in the run directory, above
    ``checkpoints/iter_N``; megatron-to-hf finds them there."""
    case = converted["qwen2-untied"]
    run = tmp_path / "run"
    shutil.copytree(case["root"] / "megatron", run / "checkpoints" / "iter_0000010")
    for name in ("wedlm_model.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.move(run / "checkpoints" / "iter_0000010" / name, run / name)
    convert_megatron_to_hf(run / "checkpoints" / "iter_0000010", tmp_path / "export")
    assert torch.equal(
        safetensors_of(tmp_path / "export")["model.layers.3.self_attn.q_proj.bias"],
        safetensors_of(case["root"] / "hf")["model.layers.3.self_attn.q_proj.bias"],
    )


# --------------------------------------------------------------------------------------------
# Mask token
# --------------------------------------------------------------------------------------------


def test_mask_token_is_added_with_a_mean_row_and_the_vocabulary_grows(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = build_tiny_ar_tokenizer()
    assert tokenizer.mask_token is None and len(tokenizer) == 400
    model, _ = make_hf_dir(tmp_path / "hf", "llama", tied=False, tokenizer=tokenizer)
    args = convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    assert args.mask_token_id == 400 and args.vocab_size == 512  # grown to a multiple of 128
    assert load_model_args(tmp_path / "megatron").mask_token_id == 400
    convert_megatron_to_hf(tmp_path / "megatron", tmp_path / "export")

    saved = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert saved.mask_token == "<|mask|>" and saved.mask_token_id == 400
    assert json.loads((tmp_path / "export" / "config.json").read_text())["mask_token_id"] == 400
    before, after = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "export")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert after[name].shape == (512, 32)
        assert torch.equal(after[name][:400], before[name])
        torch.testing.assert_close(after[name][400], before[name].mean(dim=0), rtol=0, atol=1e-7)
        assert not after[name][401:].any()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = causal_input(400)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits[..., :400], model(ids).logits)


def test_mask_token_added_into_a_spare_row_keeps_the_vocabulary(tmp_path):
    """Qwen-style checkpoints have more embedding rows than tokens; the new token takes a spare one."""
    model, _ = make_hf_dir(tmp_path / "hf", "qwen2", tied=True, tokenizer=build_tiny_ar_tokenizer(), vocab_size=512)
    args = convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    assert (args.mask_token_id, args.vocab_size) == (400, 512)
    convert_megatron_to_hf(tmp_path / "megatron", tmp_path / "export")
    before, after = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "export")
    embed = "model.embed_tokens.weight"
    torch.testing.assert_close(after[embed][400], before[embed][:400].mean(dim=0), rtol=0, atol=1e-7)
    keep = torch.ones(512, dtype=torch.bool)
    keep[400] = False
    assert torch.equal(after[embed][keep], before[embed][keep])


def test_tokenizer_without_mask_token_is_an_error_when_adding_is_disabled(tmp_path):
    make_hf_dir(tmp_path / "hf", "llama", tied=True, tokenizer=build_tiny_ar_tokenizer())
    with pytest.raises(ConversionError, match="no mask token"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron", add_mask_token=False)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_converts_both_ways(converted, tmp_path):
    case = converted["qwen2-tied"]
    cli = _cli()
    assert cli.main(["hf-to-megatron", "--input", str(case["root"] / "hf"), "--output", str(tmp_path / "m")]) == 0
    assert cli.main(["megatron-to-hf", "--input", str(tmp_path / "m"), "--output", str(tmp_path / "h"),
                     "--max-shard-size", "100KB"]) == 0
    assert (tmp_path / "h" / "model.safetensors.index.json").is_file()
    original, exported = safetensors_of(case["root"] / "hf"), safetensors_of(tmp_path / "h")
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())


def test_cli_reports_an_unsupported_architecture(tmp_path):
    (tmp_path / "hf").mkdir()
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "hf-to-megatron",
         "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "gpt2" in result.stderr and "GPT2LMHeadModel" in result.stderr
    assert all(name in result.stderr for name in ("qwen2", "qwen3", "llama"))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.fixture
def broken_copy(converted, tmp_path):
    """A writable copy of the qwen2 HF directory with its tensors at hand for editing."""
    source = converted["qwen2-untied"]["root"] / "hf"
    target = tmp_path / "hf"
    shutil.copytree(source, target)
    return target, load_file(target / "model.safetensors")


def test_shape_mismatch_names_the_tensor(broken_copy, tmp_path):
    directory, tensors = broken_copy
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        convert_hf_to_megatron(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_missing_tensor_is_named(broken_copy, tmp_path):
    directory, tensors = broken_copy
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        convert_hf_to_megatron(directory, tmp_path / "out")


def test_tensors_nothing_would_convert_are_an_error(broken_copy, tmp_path):
    directory, tensors = broken_copy
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ConversionError, match=r"o_proj\.bias"):
        convert_hf_to_megatron(directory, tmp_path / "out")


def test_missing_files_are_named(broken_copy, tmp_path):
    directory, _ = broken_copy
    with pytest.raises(ConversionError, match="config.json does not exist"):
        convert_hf_to_megatron(tmp_path / "nowhere", tmp_path / "out")
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        convert_hf_to_megatron(directory, tmp_path / "out")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ConversionError, match="model-00001-of-00002.safetensors"):
        convert_hf_to_megatron(directory, tmp_path / "out")
    with pytest.raises(ConversionError, match="not a Megatron torch_dist checkpoint"):
        convert_megatron_to_hf(directory, tmp_path / "out")


def test_megatron_to_hf_errors(converted, tmp_path):
    case = converted["llama-tied"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(case["root"] / "megatron", ckpt)
    (ckpt / "wedlm_model.json").rename(tmp_path / "elsewhere.json")
    with pytest.raises(ConversionError, match="no wedlm_model.json"):
        convert_megatron_to_hf(ckpt, tmp_path / "a")
    args = json.loads((tmp_path / "elsewhere.json").read_text())
    args["mask_token_id"] = None
    (tmp_path / "no_mask.json").write_text(json.dumps(args))
    with pytest.raises(ConversionError, match="no mask_token_id"):
        convert_megatron_to_hf(ckpt, tmp_path / "b", model_args=tmp_path / "no_mask.json", tokenizer_dir=ckpt)
    args["mask_token_id"], args["vocab_size"], args["padded_vocab_size"] = 450, 512, 512
    (tmp_path / "far_mask.json").write_text(json.dumps(args))
    with pytest.raises(ConversionError, match="mask_token_id=450 is not a token"):
        convert_megatron_to_hf(ckpt, tmp_path / "c", model_args=tmp_path / "far_mask.json", tokenizer_dir=ckpt)
    args["mask_token_id"], args["hidden_size"] = 2, 64
    (tmp_path / "wrong_shape.json").write_text(json.dumps(args))
    with pytest.raises(ConversionError, match=r"embedding\.word_embeddings\.weight.*\(512, 32\).*\(512, 64\)"):
        convert_megatron_to_hf(ckpt, tmp_path / "d", model_args=tmp_path / "wrong_shape.json", tokenizer_dir=ckpt)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "keep.txt").write_text("x")
    with pytest.raises(OutputDirError, match="not empty"):
        convert_megatron_to_hf(case["root"] / "megatron", tmp_path / "e")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(model_type="mistral"), "unsupported architecture 'mistral'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
         "rope type 'llama3'"),
        (dict(attention_bias=True), "attention_bias=true"),
    ],
    ids=["architecture", "activation", "rope-scaling", "o-proj-bias"],
)
def test_unsupported_configs_are_named(converted, change, message):
    raw = json.loads((converted["llama-untied"]["root"] / "hf" / "config.json").read_text())
    raw.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        model_args_from_hf_config(raw)


def test_legacy_config_fields_are_understood():
    """Hub configs written by transformers 4 keep rope_theta at the top level."""
    raw = dict(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
               max_position_embeddings=4096, torch_dtype="bfloat16", tie_word_embeddings=True)
    args = model_args_from_hf_config(raw, tensor_model_parallel_size=2)
    assert (args.rope_theta, args.dtype, args.head_dim, args.padded_vocab_size) == (1e6, "bfloat16", 16, 1024)
    config = hf_config_from_model_args(args)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.tie_word_embeddings


def _qwen3_with_qkv_bias(o_proj_bias_zero: bool):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_causal_lm("qwen3", replace(ARCHS["qwen3"], num_layers=2, attention_bias=True),
                                 vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    if o_proj_bias_zero:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.bias.zero_()
    return model, tokenizer


def test_official_qk_norm_with_attention_bias_converts_exactly(tmp_path):
    """The reference attention with q/k norm *and* q/k/v biases (no o_proj bias) is Megatron's
    add_qkv_bias + qk_layernorm; the export is Qwen3 with attention_bias and zero o_proj biases."""
    from transformers import AutoModelForCausalLM

    from megatron_wedlm.runtime.hf_local import load_pretrained

    source, tokenizer = _qwen3_with_qkv_bias(o_proj_bias_zero=True)
    write_official_checkpoint(tmp_path / "hf", source, tokenizer, qk_norm=True, attention_bias=True,
                              mask_token_id=tokenizer.mask_token_id)
    args = convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    assert (args.architecture, args.add_qkv_bias, args.qk_layernorm) == ("qwen3", True, True)
    ids = causal_input(args.vocab_size)
    with torch.no_grad():
        reference = source(ids).logits
    assert (megatron_logits(args, tmp_path / "megatron", ids) - reference).abs().max().item() < ATOL

    convert_megatron_to_hf(tmp_path / "megatron", tmp_path / "export")
    exported = load_pretrained(AutoModelForCausalLM, tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference)
    assert all(torch.equal(t, source.state_dict()[n]) for n, t in safetensors_of(tmp_path / "export").items())


def test_qwen3_with_a_nonzero_output_projection_bias_is_refused(tmp_path):
    model, tokenizer = _qwen3_with_qkv_bias(o_proj_bias_zero=False)
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"o_proj\.bias.* is not zero.*add_bias_linear"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    assert not (tmp_path / "megatron").exists()


def test_layout_the_checkpoint_is_written_with_must_divide_the_model(converted, tmp_path):
    source = converted["qwen2-untied"]["root"] / "hf"  # 4 heads, 2 kv heads, 4 layers
    with pytest.raises(ConversionError, match=r"--tp 4 does not divide num_key_value_heads"):
        convert_hf_to_megatron(source, tmp_path / "a", tensor_model_parallel_size=4)
    with pytest.raises(ConversionError, match=r"--pp 3 does not divide the model's 4 layers"):
        convert_hf_to_megatron(source, tmp_path / "b", pipeline_model_parallel_size=3)


# --------------------------------------------------------------------------------------------
# Layout primitives against their definitions
# --------------------------------------------------------------------------------------------


def test_qkv_rows_are_grouped_per_key_value_head():
    from megatron_wedlm.conversion.layout import fuse_qkv, split_qkv

    heads, groups, d = 6, 2, 3
    q = torch.arange(heads * d).repeat_interleave(2).reshape(heads * d, 2).float()
    k = 100 + torch.arange(groups * d).repeat_interleave(2).reshape(groups * d, 2).float()
    v = 200 + torch.arange(groups * d).repeat_interleave(2).reshape(groups * d, 2).float()
    fused = fuse_qkv(q, k, v, groups)
    per_group = heads // groups
    expected = []
    for g in range(groups):  # Megatron: the group's query heads, then its key head, then its value head
        expected += [q[(g * per_group + h) * d:(g * per_group + h + 1) * d] for h in range(per_group)]
        expected += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    assert torch.equal(fused, torch.cat(expected))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups, d), (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], groups)
    assert torch.equal(bias, torch.cat(expected)[:, 0])


def test_tensor_parallel_shards_of_the_fused_mlp_hold_gate_and_up_slices():
    from megatron_wedlm.conversion.layout import fuse_gate_up, tp_local_shard

    gate, up = torch.arange(8.0)[:, None], 10 + torch.arange(8.0)[:, None]
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(tp_local_shard(fc1, 0, 1, 2, gated=True), torch.cat([gate[4:], up[4:]]))
    assert torch.equal(tp_local_shard(fc1, 0, 1, 2), fc1[8:])  # a plain column split would mix them


# --------------------------------------------------------------------------------------------
# Mixture of experts (Qwen3-MoE)
# --------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B's layout in miniature: every layer 8 SwiGLU experts of width 16, top 2, no shared
#: expert; the dense intermediate_size is unused by the model but kept by the config.
MOE_CONFIG = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  router_aux_loss_coef=0.01)
MOE_ROUTINGS = {"topk-renormalised": True, "softmax-all": False}  # id -> norm_topk_prob


def make_moe_hf_dir(directory: Path, norm_topk_prob: bool = True, seed: int = 0, **changes):
    """A random ``Qwen3MoeForCausalLM`` saved as HF does (per-expert tensors on disk), with the tiny
    tokenizer. Weights are scaled up as in ``build_tiny_causal_lm``, so routing is decisive and a
    swapped expert or router row moves the logits by O(1)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen3MoeConfig(**{**MOE_CONFIG, **changes}, vocab_size=len(tokenizer), norm_topk_prob=norm_topk_prob,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module")
def moe_converted(tmp_path_factory):
    """Each routing's model converted HF -> Megatron -> HF once."""
    out = {}
    for routing, norm_topk_prob in MOE_ROUTINGS.items():
        root = tmp_path_factory.mktemp(f"moe-{routing}")
        model, tokenizer = make_moe_hf_dir(root / "hf", norm_topk_prob)
        args = convert_hf_to_megatron(root / "hf", root / "megatron")
        convert_megatron_to_hf(root / "megatron", root / "export")
        out[routing] = dict(root=root, model=model, tokenizer=tokenizer, args=args)
    return out


def test_moe_rules_name_every_megatron_parameter_and_checkpoint_key(moe_converted):
    args = moe_converted["topk-renormalised"]["args"]
    assert (args.architecture, args.num_experts, args.moe_ffn_hidden_size, args.moe_topk) == ("qwen3_moe", 8, 16, 2)
    assert_rules_match_megatron(args)


@pytest.mark.parametrize("routing", MOE_ROUTINGS)
def test_moe_round_trip_reproduces_every_tensor_and_the_config(moe_converted, routing):
    """The HF files hold one gate/up/down per expert (transformers fuses them only in memory)."""
    root = moe_converted[routing]["root"]
    original, exported = safetensors_of(root / "hf"), safetensors_of(root / "export")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in original and "model.layers.0.mlp.gate.weight" in original
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    before = json.loads((root / "hf" / "config.json").read_text())
    after = json.loads((root / "export" / "config.json").read_text())
    assert after.pop("mask_token_id") == moe_converted[routing]["tokenizer"].mask_token_id
    before.pop("transformers_version"), after.pop("transformers_version")
    assert after == before  # num_experts, widths, top-k, norm_topk_prob, router_aux_loss_coef=0.01 included


@pytest.mark.parametrize("routing", MOE_ROUTINGS)
def test_moe_megatron_logits_equal_hf_logits(moe_converted, routing):
    """A plain causal row (the memory stream) through Megatron's own GPT and the WeDLM model, both
    with Megatron's MoE layer, against HF; then the export, loaded by transformers, bit for bit."""
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    case = moe_converted[routing]
    args = case["args"]
    ids = causal_input(args.vocab_size)
    with torch.no_grad():
        reference = case["model"](ids).logits
    assert reference.abs().max() > 1.0
    with megatron_process_group():
        for kind in ("gpt", "wedlm"):
            model = build_megatron_model(kind, args).eval()
            load_megatron_weights(model, case["root"] / "megatron")
            with torch.no_grad():
                got = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : args.vocab_size]
            assert (got - reference).abs().max().item() < ATOL, kind
    exported = AutoModelForCausalLM.from_pretrained(case["root"] / "export").eval()
    assert isinstance(exported, Qwen3MoeForCausalLM)
    assert exported.config.norm_topk_prob is MOE_ROUTINGS[routing]
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference)


def test_expert_parallel_size_must_divide_the_experts(moe_converted, converted, tmp_path, capsys):
    cli = _cli()
    moe_hf = str(moe_converted["topk-renormalised"]["root"] / "hf")
    assert cli.main(["hf-to-megatron", "--input", moe_hf, "--output", str(tmp_path / "a"), "--ep", "3"]) == 2
    assert "--ep 3 does not divide num_experts=8" in capsys.readouterr().err
    with pytest.raises(ConversionError, match=r"--ep 2 splits experts, and this qwen2 model has none"):
        convert_hf_to_megatron(converted["qwen2-untied"]["root"] / "hf", tmp_path / "b", expert_model_parallel_size=2)
    make_moe_hf_dir(tmp_path / "odd", moe_intermediate_size=9)
    with pytest.raises(ConversionError, match=r"--tp 2 does not divide moe_intermediate_size=9"):
        convert_hf_to_megatron(tmp_path / "odd", tmp_path / "c", tensor_model_parallel_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd"]  # refused before anything is written


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
        (dict(num_experts_per_tok=9), "moe_topk=9 must be in 1..num_experts=8"),
    ],
    ids=["dense-layers", "sparse-step", "top-k-over-experts"],
)
def test_unsupported_moe_configs_are_refused_naming_the_config_file(moe_converted, tmp_path, capsys, change, message):
    """Qwen3-MoE variants that mix dense MLP layers in have no Megatron layout here; the converter
    says which file holds the field (not a traceback from deep in the model build)."""
    hf = tmp_path / "hf"
    shutil.copytree(moe_converted["topk-renormalised"]["root"] / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(change)
    (hf / "config.json").write_text(json.dumps(config))
    assert _cli().main(["hf-to-megatron", "--input", str(hf), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {hf / 'config.json'}: ") and message in err
    assert not (tmp_path / "out").exists()


def test_moe_with_a_nonzero_output_projection_bias_is_refused(tmp_path):
    """Qwen3-MoE's attention is Qwen3's: with attention_bias its o_proj bias must be zero."""
    make_moe_hf_dir(tmp_path / "hf", attention_bias=True)
    with pytest.raises(ConversionError, match=r"o_proj\.bias.* is not zero.*add_bias_linear"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")


def test_a_transformers_4_moe_config_exports_as_a_loadable_qwen3_moe_config(tmp_path):
    """Qwen3-30B-A3B's config.json as published (transformers 4: num_experts, top-level rope_theta)."""
    from transformers import AutoConfig

    raw = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
               intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
               num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
               router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
               rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
               torch_dtype="bfloat16")
    args = model_args_from_hf_config(raw)
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_topk, args.moe_norm_topk_prob) == (128, 768, 8, True)
    hf_config_from_model_args(args).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "Qwen3MoeConfig"
    assert (config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok, config.norm_topk_prob,
            config.router_aux_loss_coef, config.rope_parameters["rope_theta"]) == (128, 768, 8, True, 0.001, 1e6)
    again = model_args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert replace(again, hf_config={}) == replace(args, hf_config={})  # hf_config: the fields as written
