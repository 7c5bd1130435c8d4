"""inference/score.py: scoring saved completions, as the evaluation runner scores them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_wedlm.decoding import GenerationResult
from megatron_wedlm.eval import evaluate, runner
from megatron_wedlm.eval.paper_suite import load_paper_task
from megatron_wedlm.eval.registry import load_task
from megatron_wedlm.eval.results import EvalReport, SampleRecord
from megatron_wedlm.eval.runner import EvalPlan
from megatron_wedlm.eval.scoring import score_file, score_report
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GSM8K = [
    {"question": "Ann has 2 cats and 3 dogs. How many pets?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "Bob buys 1,000 nails and 200 screws. How many items?", "answer": "#### 1,200"},
    {"question": "Cy reads 4 pages a day for 3 days. How many pages?", "answer": "4 * 3 = 12\n#### 12"},
]


def score(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "inference" / "score.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_jsonl_samples_print_accuracy_and_write_verdicts(tmp_path):
    completions = ["2 + 3 = 5\n#### 5", "The answer is 1,200.", "4 * 3 = 7\n#### 7\nQuestion: 9?"]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({**r, "completion": c}) + "\n" for r, c in zip(GSM8K, completions)))
    out = tmp_path / "verdicts.jsonl"

    done = score("--task", "paper:gsm8k", "--samples", str(samples), "--out", str(out))

    assert done.returncode == 0, done.stderr
    assert "paper:gsm8k" in done.stdout and "66.7% (2/3)" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["uid"], r["correct"], r["extracted"]) for r in rows] == [
        ("paper:gsm8k:0", True, "5"), ("paper:gsm8k:1", True, "1200."), ("paper:gsm8k:2", False, "7")]


def test_a_reports_samples_are_rescored_per_configuration(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    uids = [ex.uid for ex in load_paper_task("paper:gsm8k", str(data), prompts=False).examples]
    answers = {"streaming": ["#### 5", "#### 1200", "#### 12"], "ar": ["#### 5", "#### 12", "no idea"]}
    samples = [SampleRecord("paper:gsm8k", method, 0.4 if method == "streaming" else None, uid, text,
                            "", "", False, 3, 1, 0.1)
               for method, texts in answers.items() for uid, text in zip(uids, texts)]
    report = tmp_path / "report.json"
    report.write_text(EvalReport("tiny", {}, [], samples).to_json())

    done = score("--task", f"paper:gsm8k:{data}", "--samples", str(report))

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "streaming (tau=0.4)" in lines[0] and "100.0% (3/3)" in lines[0]
    assert "ar" in lines[1] and "33.3% (1/3)" in lines[1]


def test_bad_input_is_named(tmp_path):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps(GSM8K[0]) + "\n")  # no completion
    done = score("--task", "paper:gsm8k", "--samples", str(samples))
    assert done.returncode == 2 and "lacks column(s) ['completion']" in done.stderr
    with pytest.raises(ValueError, match="pass a report.json"):  # this project's own gsm8k task
        score_file(str(samples), "gsm8k")
    with pytest.raises(ValueError, match="without a path"):
        score_file(str(samples), "paper:gsm8k:/data/test.jsonl")


def test_rescoring_a_runner_report_gives_the_runners_verdicts(tmp_path, monkeypatch):
    records = [
        {"id": f"q{i}", "question": f"Pick {k}", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]},
         "answerKey": k}
        for i, k in enumerate("ABC")
    ]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    task = load_paper_task("paper:arc_e", str(data))
    tokenizer = build_tiny_tokenizer()
    replies = dict(zip((ex.prompt for ex in task.examples), [" A", " is C", "Answer: C\nQuestion: more"]))

    def decode(model, prompt_ids, settings, **kwargs):
        ids = tokenizer(replies[tokenizer.decode(prompt_ids)])["input_ids"]
        return GenerationResult(ids, len(ids), len(ids), 0.01, settings.method)

    monkeypatch.setattr(runner, "generate", decode)
    model = build_tiny_model(tokenizer, arch="qwen3", seed=1)
    report = evaluate(model, tokenizer, EvalPlan([task], ["ar"], warmup=False))
    path = tmp_path / "report.json"
    path.write_text(report.to_json())

    (run,) = score_report(str(path), f"paper:arc_e:{data}")
    assert [s.correct for s in report.samples] == [True, False, False]
    assert [j.correct for j in run.judgements] == [s.correct for s in report.samples]
    assert [j.extracted for j in run.judgements] == [s.extracted for s in report.samples] == ["A", "C", "A"]


def test_a_report_of_this_projects_own_gsm8k_task_is_rescored_with_its_own_rules(tmp_path):
    records = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # the first 4 records are the default shots; records 4 and 5 are scored
    uids = [ex.uid for ex in load_task(f"gsm8k:{data}").examples]
    samples = [SampleRecord("gsm8k", "ar", None, uids[0], "4 + 1 = 5\n#### 5", "", "", False, 3, 3, 0.1),
               SampleRecord("gsm8k", "ar", None, uids[1], "The answer is 7", "", "", False, 3, 3, 0.1)]
    report = tmp_path / "report.json"
    report.write_text(EvalReport("tiny", {}, [], samples).to_json())

    (run,) = score_file(str(report), f"gsm8k:{data}")

    assert run.task == "gsm8k" and [(j.extracted, j.correct) for j in run.judgements] == [("5", True), ("7", False)]
    with pytest.raises(ValueError, match="holds no samples of task 'paper:gsm8k'"):
        score_file(str(report), f"paper:gsm8k:{data}")
