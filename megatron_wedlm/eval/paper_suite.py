"""The paper's evaluation protocol as a named suite: ``paper:gsm8k``, ``paper:math``, ... .

Each task does what the WeDLM reference evaluation (Tencent/WeDLM ``evaluation/``, commit
0216110) does for one benchmark: prompt layout and few-shot text (``reference_prompts``), token
budget, temperature, stops, answer extraction and equivalence (``paper_extraction``), so scores
compare with the paper's. docs/evaluation.md tables the tasks and their data layouts.

Stops: the reference stops at the token sequences of ``Question`` and ``Problem``, which match
where the word begins a token (after a newline), hence ``\\nQuestion`` and ``\\nProblem`` here.
The reference keeps the stop word in its text, the runner drops it; verdicts differ only where a
rule reads it (GPQA's ``#### D\\nQuestion``; an MMLU/ARC answer with no letter before
``Problem``, whose ``b`` the reference reads as B). The runner decodes at the temperature it is
given: pass the task's ``temperature`` to reproduce the reference's sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from megatron_wedlm.eval import paper_extraction as px
from megatron_wedlm.eval.code_tasks import CodeTask
from megatron_wedlm.eval.dataset_files import Layout, as_list, data_files, read_records, require
from megatron_wedlm.eval.reference_prompts import PREFIXES, few_shot_prefix
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task, arc_spelling

PREFIX = "paper:"
STOP_STRINGS = ("\nQuestion", "\nProblem")
_LETTERS = ("A", "B", "C", "D", "E")


def _uid(name: str, record: Mapping[str, Any], index: int) -> str:
    for key in ("task_id", "id", "Record ID"):
        if record.get(key) not in (None, ""):
            return f"{name}:{record[key]}"
    return f"{name}:{index}"


class _Protocol:
    """What every benchmark of the suite states: its data layout, budget, temperature and how a
    record becomes an example (``example`` returns ``None`` for a record the reference skips)."""

    benchmark: str
    layout: Layout
    max_new_tokens: int
    temperature: float = 0.0
    stop_strings = STOP_STRINGS

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample | None:
        raise NotImplementedError

    def _examples(self, path: str, reference: str | None, prompts: bool) -> list[EvalExample]:
        #: the files the records were read from (a directory's: its config's test split, see ``layout``)
        self.data_files = tuple(data_files(path, self.layout))
        records = read_records(path, self.layout, list(self.data_files))
        prefix = few_shot_prefix(self.benchmark, reference) if prompts and self.benchmark in PREFIXES else ""
        examples = [self.example(r, i, prefix) for i, r in enumerate(records)]
        # "row": the record's position in the file, which pairs it with a saved completion
        kept = [replace(ex, meta={**ex.meta, "row": i}) for i, ex in enumerate(examples) if ex is not None]
        #: records the reference would have skipped (or stopped on), kept out of the score
        self.skipped = len(records) - len(kept)
        return kept


class PaperTask(_Protocol, Task):
    """A text benchmark of the suite, read from ``path``; ``prompts=False`` leaves the few-shot
    text out (no reference checkout needed), for scoring saved completions."""

    def __init__(self, path: str, *, reference: str | None = None, prompts: bool = True):
        self.name = PREFIX + self.benchmark
        Task.__init__(self, self._examples(path, reference, prompts))


class PaperCodeTask(_Protocol, CodeTask):
    """A code benchmark of the suite: completions are run against the tests in the sandbox."""

    def __init__(self, path: str, *, reference: str | None = None, prompts: bool = True, **sandbox: Any):
        self.name = PREFIX + self.benchmark
        CodeTask.__init__(self, self._examples(path, reference, prompts), **sandbox)


# --------------------------------------------------------------------------- maths


class PaperGSM8K(PaperTask):
    """Three worked solutions ending ``#### N``, then ``Question: ...\\nAnswer:\\n`` (the reference's
    layout, the final question on the ``Question:`` line, the shots' on the next)."""

    benchmark = "gsm8k"
    layout = Layout("paper:gsm8k", ("question", "answer"),
                    "openai/gsm8k, config main: main/test-00000-of-00001.parquet, or test.jsonl of "
                    "github.com/openai/grade-school-math", config="main", splits=("test",))
    max_new_tokens = 768
    temperature = 0.1

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample:
        question = require(record["question"], str, "'question'", self.layout)
        answer = require(record["answer"], str, "'answer'", self.layout)
        return EvalExample(_uid(self.name, record, index), f"{prefix}Question: {question}\nAnswer:\n",
                           px.gsm8k_final_number(answer))

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        predicted = px.gsm8k_prediction(completion)
        return Judgement(predicted, px.gsm8k_equal(predicted, example.reference))


class PaperMath(PaperTask):
    """MATH-500 with the four Minerva examples; ``Problem:\\n...\\nSolution:\\n``. The reference answer
    is the last boxed expression of ``solution``; a record without one is skipped, as there."""

    benchmark = "math"
    layout = Layout("paper:math", ("problem", "solution"), "HuggingFaceH4/MATH-500: test.jsonl", splits=("test",))
    max_new_tokens = 1024

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample | None:
        problem = require(record["problem"], str, "'problem'", self.layout)
        answer = px.math_boxed_content(require(record["solution"], str, "'solution'", self.layout))
        if answer is None:
            return None
        return EvalExample(_uid(self.name, record, index), f"{prefix}Problem:\n{problem}\nSolution:\n", answer)

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        predicted = px.math_prediction(completion)
        return Judgement(predicted, px.math_equal(predicted, example.reference))


# --------------------------------------------------------------------------- multiple choice


class _ChoiceTask(PaperTask):
    max_new_tokens = 4

    def choose(self, example: EvalExample, completion: str) -> str:
        raise NotImplementedError

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        chosen = self.choose(example, completion)
        return Judgement(chosen, bool(chosen) and chosen == example.reference)


def _four(texts: Sequence[Any]) -> list[str]:
    return [str(t) for t in texts][:4] + [""] * max(0, 4 - len(texts))


class PaperMMLU(_ChoiceTask):
    """Five elementary-mathematics questions as shots for every subject (the reference's
    choice), then ``question\\nA. ...\\nD. ...\\nAnswer:``."""

    benchmark = "mmlu"
    layout = Layout("paper:mmlu", ("question", "choices", "answer"),
                    "cais/mmlu, config all: all/test-00000-of-00001.parquet; 'answer' is 0-3",
                    config="all", splits=("test",))

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample:
        a, b, c, d = _four(as_list(record["choices"], "'choices'", self.layout))
        answer = record["answer"]
        if not isinstance(answer, int) or not 0 <= answer < 4:
            raise ValueError(f"paper:mmlu: record {index}: 'answer' is {answer!r}; expected "
                             f"{self.layout.describe()}")
        prompt = f"{prefix}{record['question']}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"
        return EvalExample(_uid(self.name, record, index), prompt, _LETTERS[answer],
                           {"subject": record.get("subject", "")})

    def choose(self, example: EvalExample, completion: str) -> str:
        return px.mmlu_letter(completion)


#: ARC's hub splits, all read: the reference joins them (``evaluation/dataset_download/arc.py``
#: lines 62-71 at 0216110: every split of ``load_dataset("allenai/ai2_arc", subset)`` into one file).
_ARC_SPLITS = ("train", "validation", "test")


class _PaperARC(_ChoiceTask):
    """Zero-shot ``Question: ...\\nA. ...\\nAnswer:`` over the question's own options (A-D or A-E).
    Hub labels 1-5 are read as A-E (the reference's loader stops on them); a record whose answer is
    not among the options is skipped."""

    letters: tuple[str, ...]

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample | None:
        choices = require(record["choices"], Mapping, "'choices'", self.layout)
        labels = [str(x) for x in as_list(choices.get("label"), "'choices.label'", self.layout)]
        texts = as_list(choices.get("text"), "'choices.text'", self.layout)

        def letter(label: str) -> str:
            return _LETTERS[int(label) - 1] if label.isdigit() and 1 <= int(label) <= 5 else label

        options = {letter(lb): t for lb, t in zip(labels, texts) if letter(lb) in self.letters and t}
        answer = letter(str(record["answerKey"]).strip().upper())
        if len(options) < 2 or answer not in options:
            return None
        lines = [f"Question: {record['question']}"] + [f"{k}. {options[k]}" for k in sorted(options)]
        return EvalExample(_uid(self.name, record, index), "\n".join(lines + ["Answer:"]), answer,
                           {"options": sorted(options)})

    def choose(self, example: EvalExample, completion: str) -> str:
        return px.arc_letter(completion, example.meta["options"])


class PaperARCChallenge(_PaperARC):
    benchmark = "arc_c"
    layout = Layout("paper:arc_c", ("question", "choices", "answerKey"),
                    "allenai/ai2_arc, config ARC-Challenge: ARC-Challenge/{train,validation,test}-"
                    "00000-of-00001.parquet; the reference joins all three splits: pass the directory",
                    config="ARC-Challenge", splits=_ARC_SPLITS)
    letters = _LETTERS[:4]


class PaperARCEasy(_PaperARC):
    benchmark = "arc_e"
    layout = Layout("paper:arc_e", ("question", "choices", "answerKey"),
                    "allenai/ai2_arc, config ARC-Easy: ARC-Easy/{train,validation,test}-"
                    "00000-of-00001.parquet; the reference joins all three splits: pass the directory",
                    config="ARC-Easy", splits=_ARC_SPLITS)
    letters = _LETTERS


class PaperHellaSwag(_ChoiceTask):
    """Ten shots, then ``activity: context\\nA) ...\\nD) ...\\nWhat is the right option?\\n``.

    Oddity kept: the reference evaluates the *test* split, whose labels are blank and read as 0, so
    every answer counts as A; use the validation split for a score that means something."""

    benchmark = "hellaswag"
    layout = Layout("paper:hellaswag", ("ctx", "endings", "label"),
                    "Rowan/hellaswag: data/{validation,test}-00000-of-00001.parquet (the reference "
                    "uses test, whose labels are blank; a directory means test)", splits=("test",))

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample:
        endings = _four(as_list(record["endings"], "'endings'", self.layout))
        activity = record.get("activity_label") or ""
        question = f"{activity}: {record['ctx']}" if activity else str(record["ctx"])
        label = record["label"]
        if isinstance(label, str):
            label = int(label) if label.isdigit() else 0
        answer = _LETTERS[label] if isinstance(label, int) and 0 <= label < 4 else "A"
        options = "".join(f"{k}) {e}\n" for k, e in zip(_LETTERS, endings))
        return EvalExample(_uid(self.name, record, index),
                           f"{prefix}{question}\n{options}What is the right option?\n", answer)

    def choose(self, example: EvalExample, completion: str) -> str:
        return px.hellaswag_letter(completion)


class PaperGPQA(_ChoiceTask):
    """GPQA-Diamond, five worked answers ending ``#### X``, then ``Question: ...\\nA) ...\\nAnswer:\\n``.
    Oddity kept: the correct answer is always listed as D, as the reference lists it."""

    benchmark = "gpqa"
    layout = Layout("paper:gpqa", ("Question", "Correct Answer", "Incorrect Answer 1",
                                   "Incorrect Answer 2", "Incorrect Answer 3"),
                    "Idavidrein/gpqa (gated: accept its terms on the hub): gpqa_diamond.csv",
                    splits=("gpqa_diamond",))
    max_new_tokens = 512
    temperature = 0.1

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample | None:
        question = record["Question"] or ""
        if not question:
            return None
        texts = [record[f"Incorrect Answer {i}"] for i in (1, 2, 3)] + [record["Correct Answer"]]
        options = "".join(f"{k}) {t}\n" for k, t in zip(_LETTERS, texts))
        return EvalExample(_uid(self.name, record, index), f"{prefix}Question: {question}\n{options}Answer:\n", "D")

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        chosen, guessed = px.gpqa_letter(completion, example.uid)
        return Judgement(chosen, bool(chosen) and chosen == example.reference,
                         "no '####': letter guessed" if guessed else "")


# --------------------------------------------------------------------------- code


class PaperHumanEval(PaperCodeTask):
    """Four example functions, then the problem's prompt; the extracted body is appended to the
    prompt and run against the dataset's ``test`` (the same inputs as EvalPlus's base tests, which
    the reference reports). Oddities kept: the last example is HumanEval/0 itself, and a fenced
    answer repeating the ``def`` line is nested inside the prompt's function, so it fails."""

    benchmark = "humaneval"
    layout = Layout("paper:humaneval", ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
                    "openai/openai_humaneval: openai_humaneval/test-00000-of-00001.parquet, or HumanEval.jsonl",
                    splits=("test",))
    max_new_tokens = 256

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample:
        prompt = require(record["prompt"], str, "'prompt'", self.layout)
        return EvalExample(_uid(self.name, record, index), prefix + prompt, record["canonical_solution"],
                           {"problem": prompt, "test": record["test"], "entry_point": record["entry_point"]})

    def extract(self, completion: str) -> str:
        return px.humaneval_body(completion)

    def program(self, example: EvalExample, code: str) -> str:
        meta = example.meta
        return f"{meta['problem']}\n{code}\n\n{meta['test']}\n\ncheck({meta['entry_point']})\n"


class PaperMBPP(PaperCodeTask):
    """Three MBPP tasks, code between ``[BEGIN]`` and ``[DONE]``, then the task. The reference
    evaluates every record of the ``full`` config, its splits joined (shot tasks included): pass the
    directory to do the same. ``challenge_test_list`` is not run."""

    benchmark = "mbpp"
    layout = Layout("paper:mbpp", ("task_id", "text", "code", "test_list"),
                    "google-research-datasets/mbpp, config full: full/{train,test,validation,prompt}-"
                    "00000-of-00001.parquet, or mbpp.jsonl", config="full",
                    splits=("train", "validation", "test", "prompt"))
    max_new_tokens = 512
    temperature = 0.1

    def example(self, record: Mapping[str, Any], index: int, prefix: str) -> EvalExample:
        tests = [str(t) for t in as_list(record["test_list"], "'test_list'", self.layout)]
        task = (f"You are an expert Python programmer, and here is your task: {record['text']} "
                f"Your code should pass these tests:\n\n {chr(10).join(tests)}  \n[BEGIN]\n")
        return EvalExample(_uid(self.name, record, index), f"{prefix}\n{task}" if prefix else task,
                           record["code"], {"tests": tests, "setup": record.get("test_setup_code") or ""})

    def extract(self, completion: str) -> str:
        return px.mbpp_code(completion)

    def program(self, example: EvalExample, code: str) -> str:
        return px.mbpp_program(code, example.meta["setup"], example.meta["tests"])


#: suite task name -> class
PAPER_TASKS: dict[str, type[PaperTask] | type[PaperCodeTask]] = {
    PREFIX + cls.benchmark: cls
    for cls in (PaperGSM8K, PaperMath, PaperHumanEval, PaperMBPP, PaperMMLU, PaperARCChallenge,
                PaperARCEasy, PaperHellaSwag, PaperGPQA)
}


def paper_task_name(name: str) -> str:
    """A suite task's name as the suite spells it, lower case, ARC as the reference does:
    ``paper:ARC_Challenge`` -> ``paper:arc_c`` (``tasks.ARC_SPELLINGS``); a name outside the suite unchanged."""
    lowered = name.strip().lower()
    if not lowered.startswith(PREFIX):
        return name
    return PREFIX + arc_spelling(lowered.removeprefix(PREFIX).strip(), reference=True)


def load_paper_task(
    name: str,
    path: str,
    *,
    reference: str | None = None,
    prompts: bool = True,
    sandbox_timeout_s: float = 10.0,
    sandbox_memory_mb: int = 1024,
    sandbox_workers: int = 4,
) -> Task:
    """The suite's task ``name`` (``paper:gsm8k``, ...) on the data at ``path``; ``reference``: a
    Tencent/WeDLM checkout for the few-shot text (default ``$WEDLM_REFERENCE``), not needed with
    ``prompts=False`` (scoring only)."""
    name = paper_task_name(name)
    if name not in PAPER_TASKS:
        raise ValueError(f"unknown paper task {name!r}; the suite has {', '.join(PAPER_TASKS)}")
    cls = PAPER_TASKS[name]
    if issubclass(cls, PaperCodeTask):
        return cls(path, reference=reference, prompts=prompts, timeout_s=sandbox_timeout_s,
                   memory_mb=sandbox_memory_mb, workers=sandbox_workers)
    return cls(path, reference=reference, prompts=prompts)
