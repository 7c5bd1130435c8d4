"""Evaluation tasks: built-in generators, answer extraction, jsonl few-shot tasks, task specs."""

from __future__ import annotations

import json
import random
import re

import pytest

from megatron_wedlm.eval import answer_extraction as ax
from megatron_wedlm.eval.builtin_tasks import (
    _GENERATORS,
    FAMILIES,
    SPLITS,
    _keys,
    builtin_task,
    held_out_split,
    is_held_out,
    split_size,
    training_corpus,
    training_pairs,
)
from megatron_wedlm.eval.jsonl_tasks import GSM8KTask, MathTask, arc_task, mmlu_task
from megatron_wedlm.eval.registry import load_task, load_tasks, parse_task_spec
from megatron_wedlm.eval.tasks import EvalExample, truncate_at_stop


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---------------------------------------------------------------- built-in tasks


def _solve(prompt: str) -> str:
    """Independent solver for the built-in prompt formats."""
    if m := re.fullmatch(r"Count from (\d+) to (\d+):", prompt):
        return " ".join(map(str, range(int(m[1]), int(m[2]) + 1)))
    if m := re.fullmatch(r"Repeat ([a-z ]+):", prompt):
        return m[1]
    if m := re.fullmatch(r"(\d+) \+ (\d+) =", prompt):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"(\d+) x (\d+) =", prompt):
        return str(int(m[1]) * int(m[2]))
    if m := re.fullmatch(r"First (\d+) multiples of (\d+):", prompt):
        return " ".join(str(int(m[2]) * i) for i in range(1, int(m[1]) + 1))
    raise AssertionError(f"unexpected prompt {prompt!r}")


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_references_are_correct_and_deterministic(family):
    task = builtin_task(family, num_examples=40, seed=3)
    assert [e.prompt for e in task.examples] == [e.prompt for e in builtin_task(family, 40, seed=3).examples]
    assert [e.prompt for e in task.examples] != [e.prompt for e in builtin_task(family, 40, seed=4).examples]
    assert len({e.uid for e in task.examples}) == 40
    for ex in task.examples:
        assert ex.reference == _solve(ex.prompt)
        assert is_held_out(ex.uid)


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_and_test_prompts_are_disjoint_for_any_seeds(family):
    """Tau is chosen on the calibration split and reported on the test split: no prompt may be in both."""
    test = {e.prompt for s in range(3) for e in builtin_task(family, 100, seed=s).examples}
    calibration = {e.prompt for s in range(3) for e in builtin_task(family, 50, seed=s, split="calibration").examples}
    assert len(calibration) >= 50 and len(test) >= 100
    assert not test & calibration
    for ex in builtin_task(family, 50, seed=0, split="calibration").examples:
        assert held_out_split(ex.uid) == "calibration" and is_held_out(ex.uid) and ex.reference == _solve(ex.prompt)
    with pytest.raises(ValueError, match="unknown split 'train'"):
        builtin_task(family, 5, split="train")


def test_builtin_scorer_right_and_wrong_answers():
    task = builtin_task("counting", num_examples=5, seed=0)
    ex = task.examples[0]
    assert task.judge(ex, " " + ex.reference + "\nCount from 1 to 9: 1 2").correct
    assert task.judge(ex, "  " + ex.reference.replace(" ", "   ") + "  ").correct  # whitespace collapsed
    numbers = ex.reference.split()
    assert not task.judge(ex, " " + " ".join(numbers[:-1])).correct  # one number short
    assert not task.judge(ex, " " + ex.reference + " " + str(int(numbers[-1]) + 1)).correct
    assert not task.judge(ex, "").correct
    assert task.max_new_tokens >= 1


def test_training_corpus_is_disjoint_from_eval_prompts_and_matches_the_format():
    eval_prompts = {e.prompt for f in FAMILIES for s in range(3) for e in builtin_task(f, 60, seed=s).examples}
    pairs = training_pairs(3000, seed=0) + training_pairs(3000, seed=1)
    assert not eval_prompts & {p for p, _ in pairs}
    for prompt, completion in pairs[:300]:
        assert completion.startswith(" ") and completion.endswith("\n")
        assert completion.strip() == _solve(prompt)
        task = builtin_task("counting", 1)  # scorer is family independent
        assert task.judge(EvalExample("x", prompt, _solve(prompt)), completion).correct
    corpus = training_corpus(30, seed=0)
    assert corpus == [p + c for p, c in training_pairs(30, seed=0)]
    assert corpus == training_corpus(30, seed=0) and corpus != training_corpus(30, seed=1)
    assert {_family(p) for p, _ in training_pairs(9)} == set(FAMILIES)


def test_prompt_and_completion_tokenize_separately_as_joined():
    """So an SFT split at the prompt boundary matches the evaluation prompt token for token."""
    from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(extra_texts=training_corpus(200, seed=9))
    for prompt, completion in training_pairs(60, seed=2):
        joined = tokenizer(prompt + completion)["input_ids"]
        assert joined == tokenizer(prompt)["input_ids"] + tokenizer(completion)["input_ids"]


def _family(prompt: str) -> str:
    return "counting" if prompt.startswith("Count") else "copying" if prompt.startswith("Repeat") else "arithmetic"


@pytest.mark.parametrize("family, draws", [("counting", 40_000), ("arithmetic", 400_000)])
def test_split_sizes_count_every_prompt_the_generator_can_draw(family, draws):
    """split_size counts an enumerated key set: it must be exactly the set the generator draws from,
    and a task asking for every prompt of a split gets them all, one more is refused up front."""
    rng = random.Random(0)
    drawn = {_GENERATORS[family](rng)[0] for _ in range(draws)}
    assert drawn == set(_keys(family))
    for split in SPLITS:
        size = split_size(family, split)
        assert size == sum(held_out_split(k) == split for k in drawn)
        assert len({e.uid for e in builtin_task(family, size, split=split).examples}) == size
        with pytest.raises(ValueError, match=f"has {size} prompts in its {split} split, {size + 1} were asked"):
            builtin_task(family, size + 1, split=split)
    assert split_size("copying", "test") is None


def test_builtin_bad_input():
    with pytest.raises(ValueError, match="unknown built-in"):
        builtin_task("sorting")
    with pytest.raises(ValueError, match="num_examples"):
        builtin_task("counting", num_examples=0)


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    "completion, expected",
    [
        (" She has 3 + 4 = 7 apples.\n#### 7", "7"),
        (" 2 * 1,250 = 2,500 dollars. The answer is $2,500.", "2500"),
        (" First 12, then 18. So 30 in total", "30"),
        (" It costs 0.50 each, 1.5 total.", "1.5"),
        (" no numbers here", ""),
    ],
)
def test_number_extraction(completion, expected):
    assert ax.extract_number_answer(completion) == expected


def test_gsm8k_reference_and_comparison():
    assert ax.gsm8k_reference("Step <<2*3=6>>6\n#### 1,234") == "1234"
    assert ax.numbers_equal("1234.0", "1234") and ax.numbers_equal("$1,234", "1234")
    assert not ax.numbers_equal("1235", "1234") and not ax.numbers_equal("", "")
    with pytest.raises(ValueError, match="####"):
        ax.gsm8k_reference("no final answer")


@pytest.mark.parametrize(
    "predicted, reference, equal",
    [
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "\\frac{1}{2}", True),
        ("x = 5", "5", True),
        ("90^\\circ", "90", True),
        ("\\text{(B)}", "(B)", True),
        ("\\left( 3, 4 \\right)", "(3,4)", True),
        ("\\sqrt2", "\\sqrt{2}", True),
        ("\\frac{1}{3}", "\\frac{1}{2}", False),
        ("5", "6", False),
        ("", "0", False),
    ],
)
def test_math_answer_equivalence(predicted, reference, equal):
    assert ax.math_answers_equal(predicted, reference) is equal


def test_boxed_extraction():
    assert ax.last_boxed("so $\\boxed{\\frac{a}{b}}$ and then \\boxed{x^{2}+1}.") == "x^{2}+1"
    assert ax.last_boxed("\\boxed 7$") == "7"
    assert ax.last_boxed("\\boxed{unfinished") is None and ax.last_boxed("none") is None
    assert ax.extract_math_answer("thus the answer is $12$.") == "12"
    with pytest.raises(ValueError, match="boxed"):
        ax.math_reference("no box")


@pytest.mark.parametrize(
    "completion, expected",
    [(" B", "B"), (" (C) because", "C"), (" D. Paris", "D"), (" I think the answer is (a).", "A"),
     ("Bx", ""), ("", "")],
)
def test_choice_extraction(completion, expected):
    assert ax.extract_choice(completion, ["A", "B", "C", "D"]) == expected


def test_truncate_at_stop_picks_earliest():
    assert truncate_at_stop("a\n\nQuestion: b", ("Question:", "\n\n")) == "a"
    assert truncate_at_stop("abc", ()) == "abc"


# ---------------------------------------------------------------- jsonl tasks


def _gsm8k_records(n):
    return [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
            for i in range(1, n + 1)]


def test_gsm8k_few_shot_prompt_and_scoring(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", _gsm8k_records(7))
    task = GSM8KTask(path, num_shots=4)
    assert len(task.examples) == 3  # the first 4 records are the shots
    ex = task.examples[0]
    assert ex.prompt.count("Question:") == 5 and ex.prompt.count("####") == 4
    assert ex.prompt.endswith("Question: What is 5 plus 5?\nAnswer:")
    assert ex.reference == "10"
    assert task.judge(ex, " 5 + 5 = 10\n#### 10").correct
    assert not task.judge(ex, " 5 + 5 = 11\n#### 11").correct
    # a separate shots file: every record is evaluated
    shots = write_jsonl(tmp_path / "train.jsonl", _gsm8k_records(4))
    assert len(GSM8KTask(path, num_shots=2, shots_path=shots).examples) == 7
    assert GSM8KTask(path, num_shots=0).examples[0].prompt == "Question: What is 1 plus 1?\nAnswer:"


def test_jsonl_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        GSM8KTask(str(tmp_path / "missing.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\]"):
        GSM8KTask(bad)
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        GSM8KTask(str(tmp_path / "broken.jsonl"))
    few = write_jsonl(tmp_path / "few.jsonl", _gsm8k_records(3))
    with pytest.raises(ValueError, match="shots"):
        GSM8KTask(few, num_shots=4)


def test_math_task(tmp_path):
    records = [{"problem": f"Compute {i}/{i + 1}.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}$."}
               for i in range(1, 7)]
    task = MathTask(write_jsonl(tmp_path / "math.jsonl", records), num_shots=4)
    ex = task.examples[0]
    assert ex.reference == "\\frac{5}{6}" and ex.prompt.count("Problem:") == 5
    assert ex.prompt.endswith("Problem:\nCompute 5/6.\n\nSolution:")
    assert task.judge(ex, " So we get \\boxed{\\dfrac56}.").correct
    assert not task.judge(ex, " So we get \\boxed{\\frac{6}{5}}.").correct


def test_arc_and_mmlu_formats(tmp_path):
    arc = [{"id": f"q{i}", "question": f"Which is {i}?", "answerKey": "2",
            "choices": {"text": ["one", "two", "three"], "label": ["1", "2", "3"]}} for i in range(4)]
    task = arc_task(write_jsonl(tmp_path / "arc.jsonl", arc), num_shots=0, name="arc_easy")
    assert task.name == "arc_easy" and len(task.examples) == 4
    ex = task.examples[0]
    assert ex.uid == "arc_easy:q0"
    assert ex.prompt == "Question: Which is 0?\n1. one\n2. two\n3. three\nAnswer:"
    assert task.judge(ex, " 2").correct and not task.judge(ex, " 3").correct
    assert arc_task(str(tmp_path / "arc.jsonl"), num_shots=2).examples[0].prompt.count("Answer: 2") == 2

    mmlu = [{"question": f"Q{i}", "choices": ["w", "x", "y", "z"], "answer": i % 4,
             "subject": "astronomy" if i % 2 else "high_school_physics"} for i in range(8)]
    task = mmlu_task(write_jsonl(tmp_path / "mmlu.jsonl", mmlu), num_shots=2)
    ex = task.examples[0]  # record 2, physics
    assert ex.reference == "C"
    assert ex.prompt.startswith("The following are multiple choice questions (with answers) about high school physics.")
    assert ex.prompt.count("Answer:") == 3 and ex.prompt.endswith("D. z\nAnswer:")
    assert task.judge(ex, " C").correct and not task.judge(ex, " A").correct
    bad = write_jsonl(tmp_path / "bad_mmlu.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 5}] * 2)
    with pytest.raises(ValueError, match="answer"):
        mmlu_task(bad, num_shots=0)


# ---------------------------------------------------------------- specs


def test_task_specs(tmp_path):
    assert parse_task_spec("gsm8k:/x/y.jsonl") == ("gsm8k", "/x/y.jsonl")
    assert parse_task_spec(" Counting ") == ("counting", None)
    with pytest.raises(ValueError, match="unknown task"):
        parse_task_spec("squad")
    with pytest.raises(ValueError, match="gsm8k:PATH"):
        parse_task_spec("gsm8k")
    with pytest.raises(ValueError, match="no path"):
        parse_task_spec("counting:/tmp/x")
    calibration = load_task("copying:calibration", num_examples=4, seed=2)
    assert calibration.split == "calibration" and calibration.name == "copying"
    assert [e.uid for e in calibration.examples] == [e.uid for e in builtin_task("copying", 4, 2, "calibration").examples]
    path = write_jsonl(tmp_path / "g.jsonl", _gsm8k_records(9))
    tasks = load_tasks(f"counting,gsm8k:{path}", shots={"gsm8k": 2}, limit=3, num_examples=10)
    assert [t.name for t in tasks] == ["counting", "gsm8k"]
    assert [len(t.examples) for t in tasks] == [3, 3]
    assert tasks[1].examples[0].prompt.count("Question:") == 3
    assert len(load_task("humaneval", limit=2).examples) == 2
    with pytest.raises(ValueError, match="repeat"):
        load_tasks("counting,counting")


def test_replies_task_judges_whole_replies_and_names_bad_records(tmp_path):
    path = tmp_path / "replies.jsonl"
    path.write_text(json.dumps({"prompt": "Capital of France?", "reference": "Paris."}) + "\n"
                    + json.dumps({"prompt": "Say hi", "reference": "Hi!", "max_new_tokens": 64}) + "\n")
    task = load_task(f"replies:{path}")
    assert task.name == "replies" and task.max_new_tokens == 64 and len(task.examples) == 2
    first = task.examples[0]
    assert task.judge(first, "  Paris.\n").correct
    assert not task.judge(first, "Paris. It is in France.").correct  # the whole reply, not its start
    assert not task.judge(first, "paris.").correct
    with pytest.raises(ValueError, match="zero-shot"):
        load_task(f"replies:{path}", num_shots=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "reference": 3}) + "\n")
    with pytest.raises(ValueError, match="record 1 'reference' is int"):
        load_task(f"replies:{bad}")
    with pytest.raises(ValueError, match="reads a local jsonl"):
        parse_task_spec("replies")
