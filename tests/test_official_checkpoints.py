"""Official WeDLM checkpoints (``model_type: "wedlm"`` with ``auto_map``) load everywhere without their code.

The checkpoint is tiny and random but laid out like ``tencent/WeDLM-*``: an ``auto_map`` in
``config.json`` and ``tokenizer_config.json`` pointing at Python files beside it that record
their import in a marker file and raise. Every entry point runs as the user runs it, in a
subprocess whose stdin answers "y" to any "run the custom code?" prompt -- so a load that
consulted ``auto_map`` would run the files and leave the marker -- with a timeout well short of
a hang. The mask-token fallback (the reference engine's id 151665) is checked on both sides:
used when the tokenizer has that id as an added token, refused otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.decoding import load_wedlm_model
from megatron_wedlm.runtime.hf_local import REFERENCE_MASK_TOKEN_ID, load_tokenizer
from megatron_wedlm.testing.tiny_models import (
    TinyShape,
    build_tiny_ar_tokenizer,
    build_tiny_causal_lm,
    build_tiny_model,
    build_tiny_tokenizer,
    remote_code_ran,
    write_official_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TEXT = "Do you wish to run the custom code"


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    """A WeDLM-8B-shaped (Qwen3: q/k norm, no biases) checkpoint whose config names mask token 2."""
    directory = tmp_path_factory.mktemp("wedlm_official")
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch="qwen3", max_position_embeddings=256)
    write_official_checkpoint(directory, model, tokenizer, qk_norm=True, attention_bias=False,
                              mask_token_id=tokenizer.mask_token_id)
    return directory


def _run(args: list, tmp_path: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run an entry point as a user would, answering "y" to any remote-code prompt."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, *map(str, args)], input="y\n" * 8, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert PROMPT_TEXT not in proc.stdout + proc.stderr
    return proc


def test_the_checkpoint_traps_remote_code(official, tmp_path):
    """The trap works: plain ``AutoTokenizer`` asks, and on "y" runs the checkpoint's code."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in official.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    for name in ("configuration_wedlm", "modeling_wedlm", "tokenization_wedlm"):
        source = (copy / f"{name}.py").read_text().replace(str(official.resolve()), str(copy.resolve()))
        (copy / f"{name}.py").write_text(source)
    code = f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(copy)!r})"
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], input="y\n", capture_output=True, text=True, env=env,
                          timeout=120)
    assert PROMPT_TEXT in proc.stdout and proc.returncode != 0
    assert remote_code_ran(copy) == ["configuration_wedlm"]


def test_generate_cli_loads_it_without_prompt_or_remote_code(official, tmp_path):
    proc = _run([ROOT / "inference" / "generate.py", "--model", official, "--prompt", "Count from 3 to 12:",
                 "--device", "cpu", "--max-new-tokens", "6", "--window-size", "4", "--json"], tmp_path)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 1 <= len(report["token_ids"]) <= 6
    assert remote_code_ran(official) == []


def test_evaluate_cli_loads_it_without_prompt_or_remote_code(official, tmp_path):
    _run([ROOT / "inference" / "evaluate.py", "--model", official, "--tasks", "counting", "--methods", "streaming",
          "--limit", "1", "--max-new-tokens", "6", "--device", "cpu", "--out", tmp_path / "eval", "--quiet"],
         tmp_path)
    assert (tmp_path / "eval" / "report.json").is_file()
    assert remote_code_ran(official) == []


def test_conversion_both_ways_loads_it_without_prompt_or_remote_code(official, tmp_path):
    """hf-to-megatron reads the checkpoint and its tokenizer; megatron-to-hf --tokenizer reads the tokenizer."""
    script = ROOT / "tools" / "convert_checkpoint.py"
    _run([script, "hf-to-megatron", "--input", official, "--output", tmp_path / "megatron"], tmp_path)
    assert json.loads((tmp_path / "megatron" / "wedlm_model.json").read_text())["mask_token_id"] == 2
    _run([script, "megatron-to-hf", "--input", tmp_path / "megatron", "--output", tmp_path / "hf",
          "--tokenizer", official], tmp_path)
    assert remote_code_ran(official) == []

    exported, original = load_wedlm_model(tmp_path / "hf", device="cpu"), load_wedlm_model(official, device="cpu")
    ids = torch.tensor([[5, 9, 3, 17, 4]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_prepare_data_and_deepspeed_sft_load_it_without_prompt_or_remote_code(official, tmp_path):
    """tools/prepare_data.py with the checkpoint as tokenizer, then one DeepSpeed SFT step from it."""
    from megatron_wedlm.eval.builtin_tasks import training_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in training_pairs(8, seed=1)))
    _run([ROOT / "tools" / "prepare_data.py", "--task", "sft", "--raw-sft", "--input", pairs,
          "--tokenizer", official, "--output", tmp_path / "sft", "--samples-per-shard", "2"], tmp_path)
    assert json.loads((tmp_path / "sft" / "manifest.json").read_text())["mask_token_id"] == 2

    out = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    _run([*torchrun, ROOT / "sft" / "sft_wedlm.py", "--config", ROOT / "configs" / "sft" / "tiny_cpu_deepspeed.yaml",
          f"model.init_from={official}", f"data.path={tmp_path / 'sft'}", f"trainer.output_dir={out}",
          "trainer.train_steps=1", "optimizer.warmup_steps=0", "checkpointing.save_interval=0",
          "logging.progress_bar=false"], tmp_path, 420)
    assert json.loads((out / "hf" / "config.json").read_text())["mask_token_id"] == 2
    assert remote_code_ran(official) == []


# --------------------------------------------------------------------------------------------
# No mask_token_id anywhere: the reference engine's id, when the tokenizer has it
# --------------------------------------------------------------------------------------------


def _tokenizer_with_token_at(directory: Path, token_id: int, content: str = "<|wedlm_mask|>"):
    """The tiny AR tokenizer (no mask token) plus one added special token at ``token_id``.

    The id is placed directly in ``tokenizer.json`` (the BPE vocabulary may be sparse), so the
    tokenizer stays a few hundred entries although its largest id is ~151k.
    """
    build_tiny_ar_tokenizer().save_pretrained(directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["model"]["vocab"][content] = token_id
    data["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def unnamed_mask(tmp_path_factory) -> Path:
    """An official checkpoint whose config has no mask_token_id and whose tokenizer no mask token,
    but has an added token at the reference engine's id (the model's vocabulary covers it)."""
    directory = tmp_path_factory.mktemp("wedlm_no_mask_id")
    tokenizer = _tokenizer_with_token_at(directory, REFERENCE_MASK_TOKEN_ID)
    model = build_tiny_causal_lm("qwen2",
                                 TinyShape(hidden_size=16, num_heads=2, num_kv_heads=1, max_position_embeddings=64),
                                 vocab_size=REFERENCE_MASK_TOKEN_ID + 15, eos_token_id=tokenizer.eos_token_id)
    write_official_checkpoint(directory, model, qk_norm=False, attention_bias=True)
    return directory


def test_missing_mask_token_id_falls_back_to_the_reference_id_the_tokenizer_has(unnamed_mask, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_wedlm.runtime.hf_local"):
        model = load_wedlm_model(unnamed_mask, device="cpu")
    assert model.config.mask_token_id == REFERENCE_MASK_TOKEN_ID
    assert "151665" in caplog.text and "<|wedlm_mask|>" in caplog.text and "no mask_token_id" in caplog.text


def test_conversion_and_data_use_the_same_reference_id(unnamed_mask, tmp_path):
    from megatron_wedlm.conversion.tokenizer_files import prepare_tokenizer
    from megatron_wedlm.data.prepare import load_tokenizer_with_mask

    config = json.loads((unnamed_mask / "config.json").read_text())
    setup = prepare_tokenizer(unnamed_mask, tmp_path / "tok", config=config)
    assert (setup.mask_token_id, setup.added) == (REFERENCE_MASK_TOKEN_ID, False)
    _, mask_id, added = load_tokenizer_with_mask(unnamed_mask)
    assert (mask_id, added) == (REFERENCE_MASK_TOKEN_ID, False)


def test_missing_mask_token_id_is_refused_when_the_tokenizer_lacks_the_reference_id(tmp_path):
    _tokenizer_with_token_at(tmp_path, REFERENCE_MASK_TOKEN_ID - 7)  # some other id
    model = build_tiny_causal_lm("qwen2",
                                 TinyShape(hidden_size=16, num_heads=2, num_kv_heads=1, max_position_embeddings=64),
                                 vocab_size=REFERENCE_MASK_TOKEN_ID + 15)
    write_official_checkpoint(tmp_path, model, qk_norm=False, attention_bias=True)
    with pytest.raises(ValueError, match="mask_token_id.*reference engine's default id"):
        load_wedlm_model(tmp_path, device="cpu")
    assert getattr(load_wedlm_model(tmp_path, device="cpu", require_mask_token=False).config, "mask_token_id", None) is None
