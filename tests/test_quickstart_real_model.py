"""The pretrained-model quickstart end to end, on a tiny Llama with SmolLM2's real tokenizer.

The real preset (``--preset smollm``, SmolLM2-135M-Instruct) takes most of an hour on 2 cores, so
this runs the same pipeline (``RealModelQuickstart``) from an HF directory given as
``pretrained.source``: a 2-layer Llama, randomly initialised, with the real 49k-token tokenizer and
chat template, a few SFT steps and a few prompts. It checks the machinery, not learning:

* every stage ran the real entry point (hf-to-megatron, prepare_data --task sft, torchrun
  sft_wedlm, megatron-to-hf, evaluate --chat), in order;
* the base model's replies written in process replay exactly through ``inference/evaluate.py``
  (the "before SFT" figure is 50/50: references and evaluation encode chat prompts and decode
  alike), and the WeDLM model's figure on them is counted from the report's samples; both models
  are teacher-forced on every held-out reply and the report quotes those counts;
* the SFT data are the chat-template renderings, the general prompts' test split never trains, and
  of the training split only the replies that ended within their budget;
* the report holds the general-prompt target and holds streaming to the same model's AR rows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.quickstart.chat_data import GENERAL_TEST_PROMPTS, general_prompts, replies_that_end
from megatron_wedlm.quickstart.launch import run_quickstart
from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir
from megatron_wedlm.runtime.precision import native_bf16

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["checkpoint", "convert", "prepare_data", "sft", "export", "evaluate", "calibrate", "report"]


def _tiny_llama(directory: Path) -> Path:
    real = smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(real)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_model")
    sft = yaml.safe_load((ROOT / "configs/quickstart/smollm_sft.yaml").read_text())
    sft["data"].update(seq_length=128, micro_batch_size=1, global_batch_size=2, num_streams=2)
    sft["wedlm"]["block_size"] = 8
    sft["trainer"]["train_steps"] = 3
    sft["optimizer"]["warmup_steps"] = 1
    (tmp / "sft.yaml").write_text(yaml.safe_dump(sft))
    settings = yaml.safe_load((ROOT / "configs/quickstart/smollm.yaml").read_text())
    settings["pretrained"]["source"] = str(_tiny_llama(tmp / "tiny"))
    settings["sft"].update(config=str(tmp / "sft.yaml"), nproc=1,
                           task_examples={"counting": 8, "copying": 8, "arithmetic": 2}, general_repeats=1, samples_per_shard=16)
    settings["eval"].update(num_examples=3, calibration_examples=2, taus=[0.4])
    (tmp / "settings.yaml").write_text(yaml.safe_dump(settings))
    out = tmp / "out"
    paths = run_quickstart(out, settings_path=tmp / "settings.yaml", seed=0)
    return out, paths, settings


def test_every_stage_ran_its_entry_point_in_order(run):
    out, paths, _ = run
    stages = json.loads((out / "stages.json").read_text())
    assert [s["name"] for s in stages] == STAGES and all(s["status"] == "done" for s in stages)
    commands = {s["name"]: " ".join(s["commands"]) for s in stages}
    assert "convert_checkpoint.py hf-to-megatron" in commands["convert"]
    assert "prepare_data.py" in commands["prepare_data"] and "--task sft" in commands["prepare_data"]
    assert "torch.distributed.run" in commands["sft"] and "sft/sft_wedlm.py" in commands["sft"]
    assert "convert_checkpoint.py megatron-to-hf" in commands["export"]
    evaluations = [c for c in stages[STAGES.index("evaluate")]["commands"]]
    assert len(evaluations) == 5 and all("inference/evaluate.py" in c and "--chat" in c for c in evaluations)
    # task prompts in the preset's eval.precision (native: bf16 where the CPU has bf16 matrix
    # instructions), the general prompts in fp32 like the references they are compared with
    bf16 = native_bf16(torch.device("cpu"))
    for command in evaluations:
        assert f"--dtype {'fp32' if 'replies:' in command or not bf16 else 'bf16'}" in command, command
    for split in ("wedlm", "calibration/wedlm", "general/wedlm", "general/base"):
        recorded = EvalReport.load(str(out / "eval" / split / "report.json")).settings["dtype"]
        assert recorded == ("float32" if split.startswith("general") or not bf16 else "bfloat16"), split
    assert Path(paths["markdown"]).is_file() and Path(paths["plot"]).is_file()


def test_base_replies_replay_through_the_evaluation_and_the_test_prompts_never_train(run):
    out, _, settings = run
    report = json.loads((out / "report.json").read_text())["quickstart"]
    assert report["general_prompts"]["base"] == [GENERAL_TEST_PROMPTS, GENERAL_TEST_PROMPTS]
    wedlm = EvalReport.load(str(out / "eval/general/wedlm/report.json"))
    samples = [s for s in wedlm.samples if s.task == "replies"]
    assert len(samples) == GENERAL_TEST_PROMPTS
    assert report["general_prompts"]["wedlm"] == [sum(s.correct for s in samples), GENERAL_TEST_PROMPTS]
    # both models teacher-forced on every held-out reference; the report quotes those counts
    forced = json.loads((out / "eval/general/teacher_forced.json").read_text())
    for model in ("wedlm", "base"):
        scored = forced[model]
        assert len(scored["first_difference"]) + scored["empty_replies"] == GENERAL_TEST_PROMPTS
        assert scored["tokens"] == sum(scored["reply_lengths"]) and 0 <= scored["same_tokens"] <= scored["tokens"]
        assert report["general_prompts_teacher_forced_tokens"][model] == [scored["same_tokens"], scored["tokens"]]
    # the references' generated token ids are what is scored, not their text tokenized again
    recorded = [json.loads(line) for line in (out / "data/general_test.jsonl").read_text().splitlines()]
    assert forced["base"]["reply_lengths"] == [len(r["reference_ids"]) for r in recorded if r["reference_ids"]]
    trained = {json.loads(line)["prompt"] for line in (out / "data/sft.jsonl").read_text().splitlines()}
    assert not trained & set(general_prompts("test"))
    # every training reply is recorded; only those that ended train (a reply cut at its budget
    # would teach the model to end mid-sentence)
    replies = [json.loads(line) for line in (out / "data/general_train.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in replies] == general_prompts("train")
    assert trained & set(general_prompts("train")) == {prompt for prompt, _ in replies_that_end(replies)}
    stages = {s["name"]: s for s in json.loads((out / "stages.json").read_text())}
    assert stages["convert"]["detail"]["replies"]["train_ended"] == sum(r["ended"] for r in replies)
    n_tasks = sum(settings["sft"]["task_examples"].values())
    assert len(trained) <= n_tasks + len(general_prompts("train"))


def test_sft_samples_are_chat_renderings_and_the_report_holds_streaming_to_the_same_model(run):
    out, _, _ = run
    manifest = json.loads((out / "data/sft_shards/manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out / "runs/base")
    assert manifest["end_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    data = json.loads((out / "report.json").read_text())
    q = data["quickstart"]
    assert q["accuracy_reference"] == "ar"
    names = [t["name"] for t in q["targets"]]
    assert "general prompts: the base model's answers kept" in names
    report = EvalReport.from_dict(data)
    assert {r.method for r in report.results} == {"streaming", "blockwise", "ar"}
    calibration = EvalReport.load(str(out / "eval/calibration/wedlm/report.json"))
    for task, accuracy in q["calibration"]["base_accuracy"].items():  # the reference: the same model's AR
        assert accuracy == calibration.result(task, "ar").accuracy
    defaults = json.loads((out / "hf/wedlm/generation_config.json").read_text())["wedlm"]
    assert defaults["entropy_threshold"] == q["calibration"]["operating_tau"]
    shutil.rmtree(out / "runs", ignore_errors=True)  # the largest part; the module's tmp dir goes anyway
