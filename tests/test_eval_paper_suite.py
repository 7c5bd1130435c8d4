"""The paper's protocol suite: hub-layout data files, the reference's prompts and its verdicts.

Every data file is written here in the layout the dataset is published in (jsonl, parquet or
csv), and every completion is hand-written to exercise one extraction rule of the reference
evaluator; the expected verdicts are the reference's, oddities included.
"""

from __future__ import annotations

import csv
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_wedlm.eval import reference_prompts
from megatron_wedlm.eval.paper_suite import PAPER_TASKS, load_paper_task
from megatron_wedlm.eval.registry import load_task, load_tasks, parse_task_spec
from megatron_wedlm.eval.scoring import score_samples


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def verdicts(task, completions):
    """(extracted, correct) per completion, all judged against the task's first example."""
    _, judgements = score_samples(task, [(task.examples[0], c) for c in completions])
    return [(j.extracted, j.correct) for j in judgements]


# ---------------------------------------------------------------- GSM8K


@pytest.fixture
def gsm8k(tmp_path):
    path = write_parquet(tmp_path / "test-00000-of-00001.parquet",
                         [{"question": "How many?", "answer": "1000 + 234 = 1,234\n#### 1,234"}])
    return load_paper_task("paper:gsm8k", path, prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    ("1000 + 234 = 1234\n#### 1,234", "1234", True),              # '#### N', thousands comma
    ("#### $1,234 in all", "1234", True),                          # first number after ####
    ("The answer is 1234.", "1234.", True),                        # no ####: last number, '.' kept
    ("12 apples, 1234 pears\n####", "1234", True),                 # empty ####: back to the last number
    ("#### 1234.0", "1234.0", True),                               # compared as numbers
    ("#### 1234\n\nQuestion: 7 more?", "1234", True),              # the next question is cut off
    ("It is 1234, from 5-3", "-3", False),                         # a hyphen reads as a minus sign
    ("I do not know", "", False),                                  # nothing to extract
])
def test_gsm8k_rules(gsm8k, completion, extracted, correct):
    assert gsm8k.examples[0].reference == "1234"
    assert verdicts(gsm8k, [completion]) == [(extracted, correct)]


def test_gsm8k_settings_are_the_references(gsm8k):
    assert (gsm8k.name, gsm8k.max_new_tokens, gsm8k.temperature) == ("paper:gsm8k", 768, 0.1)
    assert "\nQuestion" in gsm8k.stop_strings and "\nProblem" in gsm8k.stop_strings


# ---------------------------------------------------------------- MATH-500


@pytest.fixture
def math500(tmp_path):
    records = [
        {"problem": "Half?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
         "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
        {"problem": "No box", "solution": "The answer is 3.", "answer": "3", "subject": "Algebra",
         "level": 1, "unique_id": "test/algebra/2.json"},
        {"problem": "Angle?", "solution": "$\\boxed{1,000^\\circ}$", "answer": "1000", "subject": "Geometry",
         "level": 2, "unique_id": "test/geometry/3.json"},
    ]
    return load_paper_task("paper:math", write_jsonl(tmp_path / "test.jsonl", records), prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    ("So $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", True),                    # nested braces
    ("$\\boxed{\\dfrac{1}{2}}$", "\\dfrac{1}{2}", True),                      # dfrac == frac
    ("$\\boxed{{\\frac{1}{2}}}$", "\\frac{1}{2}", True),                      # outer braces dropped
    ("$\\boxed{ \\left( \\frac{1}{2} \\right) }$", " \\left( \\frac{1}{2} \\right) ", False),  # parens stay
    ("first \\boxed{3}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),   # the last box counts
    ("\\fbox{\\frac{1}{2}}", "\\frac{1}{2}", True),                           # \fbox as \boxed
    ("\\boxed{\\frac{1}{2}}\nProblem: next\n\\boxed{7}", "\\frac{1}{2}", True),  # next problem cut
    ("$\\boxed{0.5}$", "0.5", False),                                         # no numeric equivalence
    ("$\\boxed{\\frac12}$", "\\frac12", False),                               # shorthand not expanded
    ("$\\boxed{\\frac{1}{2}", "", False),                                     # unclosed box
    ("\\boxed 1/2", "", False),                                               # braceless box
    ("The answer is $\\frac{1}{2}$.", "", False),                             # no box, no answer
])
def test_math_rules(math500, completion, extracted, correct):
    assert math500.examples[0].reference == "\\frac{1}{2}"
    assert verdicts(math500, [completion]) == [(extracted, correct)]


def test_math_reference_comes_from_the_solution_and_is_normalised(math500):
    assert math500.skipped == 1 and len(math500.examples) == 2  # the record without a box is dropped
    angle = math500.examples[1]
    assert angle.reference == "1,000^\\circ"
    _, judgements = score_samples(math500, [(angle, "\\boxed{1000}"), (angle, "\\boxed{1,000}"), (angle, "\\boxed{100}")])
    assert [j.correct for j in judgements] == [True, True, False]
    assert (math500.max_new_tokens, math500.temperature) == (1024, 0.0)


# ---------------------------------------------------------------- multiple choice


@pytest.fixture
def mmlu(tmp_path):
    record = {"question": "Which?", "subject": "anatomy", "choices": ["w", "x", "y", "z"], "answer": 2}
    return load_paper_task("paper:mmlu", write_parquet(tmp_path / "test.parquet", [record]), prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    (" C", "C", True),                  # a lone letter
    ("C. y\n\nWhich", "C", True),       # letter first, trailing text
    ("c", "C", True),                   # the first character in either case
    ("The answer is C", "C", True),     # 'is X'
    ("(C)", "C", True),                 # a standalone letter
    ("Answer: (C)", "A", False),        # the first character rule reads the A of 'Answer'
    ("E", "", False),                   # no letter A-D anywhere
])
def test_mmlu_rules(mmlu, completion, extracted, correct):
    assert mmlu.examples[0].reference == "C" and mmlu.max_new_tokens == 4
    assert verdicts(mmlu, [completion]) == [(extracted, correct)]


@pytest.fixture
def arc_challenge(tmp_path):
    records = [
        {"id": "q1", "question": "Why?", "choices": {"text": ["p", "q", "r"], "label": ["A", "B", "C"]}, "answerKey": "B"},
        {"id": "q2", "question": "Numbered?", "choices": {"text": ["p", "q", "r", "s"], "label": ["1", "2", "3", "4"]},
         "answerKey": "4"},
        {"id": "q3", "question": "Five?", "choices": {"text": list("pqrst"), "label": list("ABCDE")}, "answerKey": "E"},
    ]
    directory = tmp_path / "ARC-Challenge"
    directory.mkdir()
    write_parquet(directory / "test-00000-of-00001.parquet", records[:2])
    write_parquet(directory / "train-00000-of-00001.parquet", records[2:])
    return load_paper_task("paper:arc_c", str(directory), prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    ("B", "B", True),
    ("(B) q", "B", True),
    ("The answer is B", "B", True),
    ("Answer: B", "A", False),   # the first character is an option: A
    ("D", "", False),            # not one of this question's options
])
def test_arc_rules(arc_challenge, completion, extracted, correct):
    assert verdicts(arc_challenge, [completion]) == [(extracted, correct)]


def test_arc_reads_split_files_numbered_labels_and_drops_answers_beyond_d(arc_challenge):
    # test file then train file (sorted); the E-answer record of ARC-Challenge is dropped
    assert [e.uid for e in arc_challenge.examples] == ["paper:arc_c:q1", "paper:arc_c:q2"]
    assert arc_challenge.skipped == 1
    numbered = arc_challenge.examples[1]
    assert numbered.reference == "D" and numbered.prompt.endswith("C. r\nD. s\nAnswer:")


@pytest.fixture
def hellaswag(tmp_path):
    records = [
        {"ind": 1, "activity_label": "Cooking", "ctx": "He cuts bread. He", "endings": ["a", "b", "c", "d"], "label": "2"},
        {"ind": 2, "activity_label": "", "ctx": "Unlabelled test item.", "endings": ["a", "b", "c", "d"], "label": ""},
    ]
    return load_paper_task("paper:hellaswag", write_jsonl(tmp_path / "validation.jsonl", records), prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    ("C", "C", True),
    ("C) then he eats", "C", True),
    ("The answer is c", "C", True),      # 'answer/option/choice X' ignores case
    ("option: C", "C", True),
    ("I think B or C", "C", True),       # the last standalone letter
    ("I think C or B", "B", False),
    ("none", "", False),
])
def test_hellaswag_rules(hellaswag, completion, extracted, correct):
    assert hellaswag.examples[0].reference == "C"
    assert verdicts(hellaswag, [completion]) == [(extracted, correct)]


def test_hellaswag_blank_label_counts_as_a(hellaswag):
    unlabelled = hellaswag.examples[1]
    assert unlabelled.reference == "A"
    assert "Cooking: He cuts bread. He\nA) a\n" in hellaswag.examples[0].prompt


@pytest.fixture
def gpqa(tmp_path):
    path = tmp_path / "gpqa_diamond.csv"
    columns = ["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
               "Incorrect Answer 3", "Explanation"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerow(dict(zip(columns, ["rec1", "Which spin?", "up", "down", "left", "right", "..."])))
        writer.writerow(dict(zip(columns, ["rec2", "", "x", "y", "z", "w", "..."])))  # no question: skipped
    return load_paper_task("paper:gpqa", str(path), prompts=False)


@pytest.mark.parametrize("completion, extracted, correct", [
    ("Spin is conserved.\n#### D", "D", True),
    ("#### D\n\nQuestion: another", "D", True),
    ("#### D.", "D.", False),              # the whole text after #### must be the letter
    ("#### D) up", "D) up", False),
    ("#### C", "C", False),
])
def test_gpqa_rules(gpqa, completion, extracted, correct):
    assert verdicts(gpqa, [completion]) == [(extracted, correct)]


def test_gpqa_correct_answer_is_always_d_and_a_missing_answer_is_a_repeatable_guess(gpqa):
    example = gpqa.examples[0]
    assert gpqa.skipped == 1 and example.reference == "D"
    assert example.prompt.endswith("Question: Which spin?\nA) down\nB) left\nC) right\nD) up\nAnswer:\n")
    first = gpqa.judge(example, "I am not sure.")
    assert first.extracted in "ABCD" and first.detail == "no '####': letter guessed"
    assert gpqa.judge(example, "I am not sure.") == first


# ---------------------------------------------------------------- code


@pytest.fixture
def humaneval(tmp_path):
    record = {"task_id": "HumanEval/7", "prompt": 'def inc(x: int) -> int:\n    """Add one."""\n',
              "canonical_solution": "    return x + 1\n",
              "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
              "entry_point": "inc"}
    return load_paper_task("paper:humaneval", write_parquet(tmp_path / "test.parquet", [record]),
                           prompts=False, sandbox_workers=2)


def test_humaneval_rules(humaneval):
    cases = {
        "    return x + 1\n": True,                                            # a body
        "return x + 1": True,                                                  # at column 0: indented
        "```python\n    return x + 1\n```\nDone.": True,                       # fenced body
        "import math\n    return x + 1": True,                                 # leading imports dropped
        "def inc(x):\n    return x + 1\n\nprint(inc(1))": True,               # a full def: its body kept
        "    y = x\n    return y + 1\nThis adds one.\n    return 0": True,     # stops at the dedent
        "```python\ndef inc(x):\n    return x + 1\n```": False,                # fenced full def: nested
        "    return x": False,
    }
    got = verdicts(humaneval, list(cases))
    assert [correct for _, correct in got] == list(cases.values())
    assert got[1][0] == "    return x + 1" and got[4][0] == "    return x + 1"
    assert humaneval.max_new_tokens == 256


def test_mbpp_rules(tmp_path):
    record = {"task_id": 11, "text": "Return one.", "code": "def one():\r\n  return 1",
              "test_list": ["assert one() == 1", "assert one() + K == 2"], "test_setup_code": "K = 1",
              "challenge_test_list": []}
    task = load_paper_task("paper:mbpp", write_jsonl(tmp_path / "mbpp.jsonl", [record]), prompts=False,
                           sandbox_workers=2)
    cases = {
        " 'def one():\r\n  return 1' \n[DONE] \n\n \nYou are an expert": True,  # quoted, then the next shot
        "def one():\n    return 1\n[DONE]": True,
        "def one():\n    return 1": True,                                      # no [DONE]: all of it
        "def one():\n    return 2\n[DONE]": False,
        "```python\ndef one():\n    return 1\n```\n[DONE]": False,             # fences are not removed
    }
    assert [correct for _, correct in verdicts(task, list(cases))] == list(cases.values())
    assert (task.max_new_tokens, task.temperature) == (512, 0.1)


# ---------------------------------------------------------------- downloaded hub directories


def gsm8k_record(question):
    return {"question": question, "answer": "#### 1"}


def test_a_hub_download_is_searched_for_its_configs_test_split(tmp_path):
    """openai/gsm8k as ``hf download`` leaves it: the main config's test split is
    scored, found below the directory given; train, the socratic config and .cache are not."""
    root = tmp_path / "gsm8k"
    for folder in ("main", "socratic", ".cache/huggingface"):
        (root / folder).mkdir(parents=True)
    write_parquet(root / "main" / "train-00000-of-00001.parquet", [gsm8k_record("train q")] * 3)
    test = write_parquet(root / "main" / "test-00000-of-00001.parquet",
                         [gsm8k_record("test q1"), gsm8k_record("test q2")])
    write_parquet(root / "socratic" / "test-00000-of-00001.parquet", [gsm8k_record("socratic q")])
    write_jsonl(root / ".cache" / "huggingface" / "test.jsonl", [gsm8k_record("cached q")])
    for given in (root, root / "main"):
        task = load_paper_task("paper:gsm8k", str(given), prompts=False)
        assert task.data_files == (test,)
        assert [e.meta["row"] for e in task.examples] == [0, 1]
        assert all("Question: test q" in e.prompt for e in task.examples)


def test_a_directory_without_the_expected_split_is_refused_with_what_it_holds(tmp_path):
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", [gsm8k_record("q")])
    with pytest.raises(ValueError, match=r"holds no file named test\.\* or test-\*\.\* under main/; it holds "
                                         r"main/train-00000-of-00001\.parquet"):
        load_paper_task("paper:gsm8k", str(tmp_path / "gsm8k"), prompts=False)
    (tmp_path / "other" / "socratic").mkdir(parents=True)  # another config only: not read as main
    write_parquet(tmp_path / "other" / "socratic" / "test-00000-of-00001.parquet", [gsm8k_record("q")])
    with pytest.raises(ValueError, match="under main/; it holds socratic/test-00000-of-00001.parquet"):
        load_paper_task("paper:gsm8k", str(tmp_path / "other"), prompts=False)


def test_arc_reads_every_split_of_its_own_config_as_the_reference_does(tmp_path):
    """allenai/ai2_arc with both configs: paper:arc_c reads ARC-Challenge's three splits (the reference
    joins them), never ARC-Easy's; ``paper:arc_challenge`` is the same task."""
    record = {"question": "Q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
    for config, split in [("ARC-Challenge", "train"), ("ARC-Challenge", "validation"), ("ARC-Challenge", "test"),
                          ("ARC-Easy", "test")]:
        (tmp_path / config).mkdir(exist_ok=True)
        write_parquet(tmp_path / config / f"{split}-00000-of-00001.parquet",
                      [{**record, "id": f"{config}-{split}"}])
    for spelling in ("arc_c", "arc_challenge", "ARC_C"):
        task = load_task(f"paper:{spelling}:{tmp_path}")
        assert task.name == "paper:arc_c"
        splits = ("test", "train", "validation")  # sorted path order
        assert [e.uid for e in task.examples] == [f"paper:arc_c:ARC-Challenge-{s}" for s in splits]


# ---------------------------------------------------------------- prompts from a reference checkout


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A stand-in for a Tencent/WeDLM checkout, its texts pinned as the real ones are."""
    datasets = tmp_path / "WeDLM" / "evaluation" / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "gsm8k.py").write_text(
        "class Gsm8kDataset:\n    def __init__(self):\n        self.path = 'x'\n"
        "        self._fewshot_prefix = (\n            'Solve it.\\n'\n            'Question:\\n1+1?\\nAnswer:\\n#### 2\\n\\n'\n        )\n"
    )
    (datasets / "mbpp.py").write_text("class M:\n    def __init__(self):\n        self._fewshot_block = 'SHOTS\\n \\n'\n")
    monkeypatch.setitem(reference_prompts.PINNED_SHA256, "gsm8k",
                        reference_prompts.sha256("Solve it.\nQuestion:\n1+1?\nAnswer:\n#### 2\n\n"))
    monkeypatch.setitem(reference_prompts.PINNED_SHA256, "mbpp", reference_prompts.sha256("SHOTS\n \n"))
    monkeypatch.setenv(reference_prompts.REFERENCE_ENV, str(tmp_path / "WeDLM"))
    return tmp_path / "WeDLM"


def test_prompts_are_the_reference_shots_then_the_question(checkout, tmp_path):
    data = write_jsonl(tmp_path / "g.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    task = load_task(f"paper:gsm8k:{data}")
    assert task.examples[0].prompt == "Solve it.\nQuestion:\n1+1?\nAnswer:\n#### 2\n\nQuestion: 2+2?\nAnswer:\n"
    mbpp = load_task("paper:mbpp:" + write_jsonl(tmp_path / "m.jsonl", [
        {"task_id": 5, "text": "Do X.", "code": "pass", "test_list": ["assert 1", "assert 2"]}]))
    assert mbpp.examples[0].prompt == ("SHOTS\n \n\nYou are an expert Python programmer, and here is your task: "
                                       "Do X. Your code should pass these tests:\n\n assert 1\nassert 2  \n[BEGIN]\n")


def test_a_changed_reference_text_is_refused(checkout, tmp_path, monkeypatch):
    monkeypatch.setitem(reference_prompts.PINNED_SHA256, "gsm8k", "0" * 64)
    data = write_jsonl(tmp_path / "g.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    with pytest.raises(ValueError, match="differs from the one this suite was checked against"):
        load_task(f"paper:gsm8k:{data}")


def test_prompts_without_a_checkout_say_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.delenv(reference_prompts.REFERENCE_ENV, raising=False)
    data = write_jsonl(tmp_path / "g.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    with pytest.raises(ValueError) as error:
        load_task(f"paper:gsm8k:{data}")
    message = str(error.value)
    assert message.startswith("paper:gsm8k needs WEDLM_REFERENCE, the path of a clone of the WeDLM reference")
    assert "git clone https://github.com/Tencent/WeDLM" in message and "export WEDLM_REFERENCE=" in message
    assert "Tasks that need it: paper:gsm8k, paper:math, " in message and "paper:arc_c and paper:arc_e" in message
    # ARC has no few-shot text: it needs no checkout
    arc = {"question": "Q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
    assert load_task("paper:arc_e:" + write_jsonl(tmp_path / "a.jsonl", [arc])).examples[0].prompt == (
        "Question: Q\nA. a\nB. b\nAnswer:")


@pytest.mark.skipif(not os.environ.get(reference_prompts.REFERENCE_ENV), reason="no Tencent/WeDLM checkout given")
def test_a_real_checkout_matches_every_pin():
    for benchmark in reference_prompts.PREFIXES:
        assert reference_prompts.few_shot_prefix(benchmark)  # raises on a mismatch


# ---------------------------------------------------------------- data files and specs


def test_missing_and_malformed_files_name_the_layout(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*columns question, answer \(openai/gsm8k"):
        load_paper_task("paper:gsm8k", str(tmp_path / "nope.parquet"), prompts=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2 lacks column\(s\) \['answer'\]"):
        load_paper_task("paper:gsm8k", str(bad), prompts=False)
    bad.write_text('{"question": "q", \n')
    with pytest.raises(ValueError, match=rf"{bad}:1 is not valid JSON"):
        load_paper_task("paper:gsm8k", str(bad), prompts=False)
    parquet = write_parquet(tmp_path / "mmlu.parquet", [{"question": "q", "choices": ["a"]}])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\].*cais/mmlu"):
        load_paper_task("paper:mmlu", parquet, prompts=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .* file.*Idavidrein/gpqa"):
        load_paper_task("paper:gpqa", str(tmp_path / "empty"), prompts=False)
    with pytest.raises(ValueError, match="'answer' is 7"):
        load_paper_task("paper:mmlu", write_jsonl(tmp_path / "m.jsonl", [
            {"question": "q", "choices": ["a", "b", "c", "d"], "answer": 7}]), prompts=False)


def test_specs_of_the_suite(tmp_path):
    assert len(PAPER_TASKS) == 9
    assert parse_task_spec("paper:GSM8K:/d/test.parquet") == ("paper:gsm8k", "/d/test.parquet")
    assert parse_task_spec("gsm8k:/d/test.jsonl") == ("gsm8k", "/d/test.jsonl")  # our own protocol
    with pytest.raises(ValueError, match="the paper's suite has paper:gsm8k"):
        parse_task_spec("paper:gsm9k:/x")
    with pytest.raises(ValueError, match="write it as paper:math:PATH"):
        parse_task_spec("paper:math")
    # ARC's two spellings are read as each protocol's own
    assert parse_task_spec("paper:arc_easy:/d") == ("paper:arc_e", "/d")
    assert parse_task_spec("arc_c:/d/arc.jsonl") == ("arc_challenge", "/d/arc.jsonl")
    arc = write_jsonl(tmp_path / "a.jsonl", [{"question": "Q", "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                                              "answerKey": "A"}])
    with pytest.raises(ValueError, match="shots are fixed"):
        load_tasks(f"paper:arc_c:{arc}", shots={"paper:arc_c": 5})
    both = load_tasks(f"paper:arc_c:{arc},paper:arc_e:{arc}")
    assert [t.name for t in both] == ["paper:arc_c", "paper:arc_e"]


@pytest.mark.skipif(not os.environ.get(reference_prompts.REFERENCE_ENV), reason="no Tencent/WeDLM checkout given")
def test_rules_agree_with_the_reference_evaluators_on_random_text(monkeypatch):
    """Differential check: the reference's own evaluator functions, imported from the checkout,
    and ``paper_extraction`` read the same answers out of random mixtures of the rules' tokens."""
    import random

    from megatron_wedlm.eval import paper_extraction as px

    monkeypatch.syspath_prepend(os.environ[reference_prompts.REFERENCE_ENV])
    from evaluation.evaluators.arc_c_evaluator import ARCCEvaluator
    from evaluation.evaluators.gsm8k_evaluator import Gsm8kEvaluator
    from evaluation.evaluators.hellaswag_evaluator import HellaSwagEvaluator
    from evaluation.evaluators.humaneval_evaluator import HumanEvalEvaluator
    from evaluation.evaluators.math_evaluator import MATHEvaluator, _strip_string
    from evaluation.evaluators.mbpp_evaluator import MBPPEvaluator
    from evaluation.evaluators.mmlu_evaluator import MMLUEvaluator

    rng = random.Random(0)
    tokens = ["####", " ", "\n", "\n\n", "Question:", "\nProblem:", "The answer is ", "Answer: ", "is", "(C)",
              "A", "B", "C", "D", "a", "c", ")", ".", "1,234", "42", "5-3", ".5", "$", "\\boxed{", "\\fbox{",
              "{", "}", "\\frac{1}{2}", "\\dfrac", "\\left(", "^\\circ", "\\%", "\\\\", "1,2,3", "option"]
    code = ["def f(x):", "def g(a,\n      b):", "    return x", "return x", "        y = 1", "  z = 2", "# note",
            "'''doc'''", "import os", "from a import b", "```python", "```", "~~~", "print(f(1))", "", "[DONE]", "'"]
    gsm8k, math, mmlu, arc, hellaswag = Gsm8kEvaluator(), MATHEvaluator(), MMLUEvaluator(), ARCCEvaluator(), HellaSwagEvaluator()
    humaneval, mbpp = object.__new__(HumanEvalEvaluator), MBPPEvaluator()  # no evalplus needed for extraction
    for _ in range(3000):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 12)))
        assert px.gsm8k_prediction(text) == gsm8k._postprocess_prediction(text).replace("NULL", ""), text
        assert px.math_prediction(text) == math._extract_answer(text), text
        assert px.math_normalize(text) == _strip_string(text), text
        assert px.mmlu_letter(text) == mmlu._extract_answer(text), text
        assert px.arc_letter(text, "ABC") == arc._extract_answer(text, ["A", "B", "C"]), text
        assert px.hellaswag_letter(text) == hellaswag._extract_answer(text), text
        program = "\n".join(rng.choice(code) for _ in range(rng.randint(0, 10)))
        assert px.humaneval_body(program) == humaneval._postprocess(program), program
        assert px.mbpp_code(program) == mbpp._process_answer(program), program
