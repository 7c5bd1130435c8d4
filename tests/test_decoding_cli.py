"""inference/generate.py (and the decoding defaults a model stores, as generate.py, evaluate.py and
the lm_eval adapter read them) on a tiny saved model and a tokenizer built locally."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.decoding import generate, load_tokenizer, load_wedlm_model
from megatron_wedlm.decoding.generation_defaults import write_decoding_defaults
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "inference" / "generate.py"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_wedlm")
    tokenizer = build_tiny_tokenizer(extra_texts=["<user><assistant>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(tokenizer, arch="qwen3")
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _load_cli():
    spec = importlib.util.spec_from_file_location("generate_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_json_output_matches_the_library(checkpoint):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["--model", str(checkpoint), "--prompt", "Count from 3 to 12:", "--json", "--device", "cpu",
            "--window-size", "8", "--max-new-tokens", "24"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"text", "token_ids", "forwards", "tokens_per_forward", "p_cache", "tokens_per_sec"} <= set(report)

    model, tokenizer = load_wedlm_model(checkpoint, device="cpu"), load_tokenizer(checkpoint)
    expected = generate(model, tokenizer.encode("Count from 3 to 12:"), window_size=8, max_new_tokens=24,
                        stop_token_ids=[tokenizer.eos_token_id])
    assert report["token_ids"] == expected.token_ids
    assert report["forwards"] == expected.num_forwards
    assert report["text"] == tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert report["tokens_per_forward"] == pytest.approx(len(expected.token_ids) / expected.num_forwards)
    assert report["p_cache"] == pytest.approx(expected.p_cache)


@pytest.mark.parametrize("method", ["blockwise", "ar"])
def test_cli_chat_prompt_uses_the_template(checkpoint, method, capsys):
    cli = _load_cli()
    report = cli.main(["--model", str(checkpoint), "--prompt", "hi", "--chat", "--method", method,
                       "--device", "cpu", "--max-new-tokens", "6", "--json"])
    tokenizer = load_tokenizer(checkpoint)
    model = load_wedlm_model(checkpoint, device="cpu")
    prompt = tokenizer.encode("<user>hi\n<assistant>", add_special_tokens=False)
    expected = generate(model, prompt, method=method, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id])
    assert report["token_ids"] == expected.token_ids
    assert json.loads(capsys.readouterr().out)["method"] == method


def test_cli_refill_schedule_and_eos_choice_are_reported(checkpoint):
    """``--refill`` picks the schedule (fused = the reference engine's, the default) and the report
    names it; ``--no-stop-at-eos`` decodes past EOS."""
    cli = _load_cli()
    model, tokenizer = load_wedlm_model(checkpoint, device="cpu"), load_tokenizer(checkpoint)
    prompt = tokenizer.encode("Count from 3 to 12:")
    common = ["--model", str(checkpoint), "--prompt", "Count from 3 to 12:", "--device", "cpu",
              "--window-size", "4", "--max-new-tokens", "24", "--json"]
    eos = [tokenizer.eos_token_id]
    for refill, fused in (("fused", True), ("paper", False)):
        report = cli.main(common + ["--refill", refill])
        expected = generate(model, prompt, window_size=4, max_new_tokens=24, stop_token_ids=eos, fused_refill=fused)
        assert report["refill"] == refill
        assert (report["token_ids"], report["forwards"], report["slots"]) == (
            expected.token_ids, expected.num_forwards, expected.num_slots)
    assert cli.main(common)["refill"] == "fused"
    paper = generate(model, prompt, window_size=4, max_new_tokens=24, stop_token_ids=eos, fused_refill=False)
    fused = generate(model, prompt, window_size=4, max_new_tokens=24, stop_token_ids=eos)
    assert paper.num_forwards > fused.num_forwards  # the two schedules really differ on this model
    no_eos = cli.main(common + ["--no-stop-at-eos"])
    assert no_eos["token_ids"] == generate(model, prompt, window_size=4, max_new_tokens=24).token_ids


@pytest.fixture(scope="module")
def checkpoint_with_defaults(checkpoint, tmp_path_factory):
    """The tiny checkpoint, storing its own decoding operating point in generation_config.json."""
    directory = tmp_path_factory.mktemp("tiny_wedlm_defaults")
    shutil.copytree(checkpoint, directory, dirs_exist_ok=True)
    write_decoding_defaults(directory, {"window_size": 4, "entropy_threshold": 0.9, "fused_refill": False,
                                        "contiguous_stop": True, "stop_penalty": True, "leftmost_fallback": True})
    return directory


def test_generate_uses_the_models_stored_defaults_unless_overridden(checkpoint_with_defaults):
    cli = _load_cli()
    model, tokenizer = load_wedlm_model(checkpoint_with_defaults, device="cpu"), load_tokenizer(checkpoint_with_defaults)
    prompt = tokenizer.encode("Count from 3 to 12:")
    common = ["--model", str(checkpoint_with_defaults), "--prompt", "Count from 3 to 12:", "--device", "cpu",
              "--max-new-tokens", "20", "--json"]
    eos = [tokenizer.eos_token_id]

    stored = cli.main(common)
    assert {k: v["source"] for k, v in stored["decoding_settings"].items()} == {
        "window_size": "model", "entropy_threshold": "model", "distance_penalty": "built-in", "fused_refill": "model",
        "contiguous_stop": "model", "stop_penalty": "model", "leftmost_fallback": "model"}
    assert stored["refill"] == "paper" and stored["decoding_settings"]["contiguous_stop"]["value"] is True
    assert stored["decoding_settings"]["stop_penalty"]["value"] is True
    expected = generate(model, prompt, window_size=4, entropy_threshold=0.9, fused_refill=False, max_new_tokens=20,
                        stop_token_ids=eos, contiguous_stop=True, stop_penalty=True, leftmost_fallback=True)
    assert (stored["token_ids"], stored["forwards"]) == (expected.token_ids, expected.num_forwards)

    overridden = cli.main(common + ["--window-size", "8", "--refill", "fused", "--stop-fill", "anywhere",
                                    "--no-stop-penalty", "--fallback", "argmin"])
    settings = overridden["decoding_settings"]
    assert settings["window_size"] == {"value": 8, "source": "cli"}
    assert settings["fused_refill"] == {"value": True, "source": "cli"}
    assert settings["contiguous_stop"] == {"value": False, "source": "cli"}
    assert settings["stop_penalty"] == {"value": False, "source": "cli"}
    assert settings["leftmost_fallback"] == {"value": False, "source": "cli"}
    assert settings["entropy_threshold"] == {"value": 0.9, "source": "model"}
    expected = generate(model, prompt, window_size=8, entropy_threshold=0.9, max_new_tokens=20, stop_token_ids=eos)
    assert (overridden["token_ids"], overridden["forwards"]) == (expected.token_ids, expected.num_forwards)


def test_evaluate_and_lm_eval_record_where_each_setting_came_from(checkpoint_with_defaults, tmp_path):
    spec = importlib.util.spec_from_file_location("wedlm_evaluate_cli", ROOT / "inference" / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--model", str(checkpoint_with_defaults), "--tasks", "counting", "--methods", "streaming",
                     "--limit", "1", "--max-new-tokens", "4", "--distance-penalty", "0.1", "--out",
                     str(tmp_path), "--device", "cpu", "--quiet"]) == 0
    settings = json.loads((tmp_path / "report.json").read_text())["settings"]
    assert settings["decoding_sources"] == {
        "window_size": "model", "entropy_threshold": "model", "distance_penalty": "cli", "fused_refill": "model",
        "contiguous_stop": "model", "stop_penalty": "model", "leftmost_fallback": "model"}
    assert (settings["window_size"], settings["taus"], settings["distance_penalty"], settings["refill"],
            settings["stop_fill"], settings["stop_penalty"], settings["fallback"]) == (
        4, [0.9], 0.1, "paper", "contiguous", True, "leftmost")

    lm_eval_adapter = pytest.importorskip("megatron_wedlm.eval.lm_eval_adapter")
    lm = lm_eval_adapter.WeDLMLM(pretrained=str(checkpoint_with_defaults), device="cpu", entropy_threshold="0.5",
                                 stop_fill="anywhere", stop_penalty="false", fallback="argmin")
    assert lm.setting_sources == {
        "window_size": "model", "entropy_threshold": "cli", "distance_penalty": "built-in", "fused_refill": "model",
        "contiguous_stop": "cli", "stop_penalty": "cli", "leftmost_fallback": "cli"}
    assert (lm.settings.window_size, lm.settings.entropy_threshold, lm.settings.fused_refill,
            lm.settings.contiguous_stop, lm.settings.stop_penalty, lm.settings.leftmost_fallback) == (
        4, 0.5, False, False, False, False)
