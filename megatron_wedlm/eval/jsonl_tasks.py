"""GSM8K, MATH, ARC and MMLU from local jsonl files, in few-shot generation formats.

Nothing is downloaded: records carry the public datasets' field names (gsm8k ``question``,
``answer``; math ``problem``, ``solution``; arc ``question``, ``choices``, ``answerKey``; mmlu
``question``, ``choices``, ``answer``, optional ``subject``). Shots come from ``shots_path``, else
the first ``num_shots`` records, which are then not scored; MMLU prefers its own subject's. The
default counts follow common base-model practice (GSM8K and MATH 4-shot CoT, ARC 0, MMLU 5). All
four are scored from generated text (``answer_extraction``): the decoder must produce the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_wedlm.eval import answer_extraction as ax
from megatron_wedlm.eval.dataset_files import Layout, read_records
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

DEFAULT_SHOTS = {"gsm8k": 4, "math": 4, "arc": 0, "mmlu": 5, "mbpp": 3}


def read_jsonl(path: str, required: Sequence[str], task: str) -> list[dict[str, Any]]:
    """Records of a local jsonl file (our own protocol's layout), each checked to have the
    ``required`` fields; read by the one benchmark-file reader."""
    return read_records(path, Layout(task, tuple(required), "a local jsonl file, one record per line"))


def split_shots(
    records: list[dict[str, Any]], num_shots: int, shot_records: list[dict[str, Any]] | None, task: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(shots, records to evaluate); shots come from ``shot_records`` or the head of ``records``."""
    if num_shots < 0:
        raise ValueError(f"{task}: number of shots must be >= 0, got {num_shots}")
    if shot_records is not None:
        if len(shot_records) < num_shots:
            raise ValueError(f"{task}: asked for {num_shots} shots, shots file has {len(shot_records)}")
        return shot_records, records
    if len(records) <= num_shots:
        raise ValueError(
            f"{task}: {len(records)} records cannot provide {num_shots} shots and leave any to "
            "evaluate; pass a separate shots file"
        )
    return records[:num_shots], records[num_shots:]


def _uid(task: str, record: Mapping[str, Any], index: int) -> str:
    for key in ("task_id", "id", "unique_id"):
        if key in record:
            return f"{task}:{record[key]}"
    return f"{task}:{index}"


# --------------------------------------------------------------------------- GSM8K / MATH


class _WorkedSolutionTask(Task):
    """Few-shot chain of thought: worked solutions as shots, then the question; the answer is
    extracted from the solution the model writes. A subclass names its jsonl fields, formats a
    record, and says how to read a reference and an answer and when two answers agree."""

    #: The jsonl fields of a question and of its worked solution.
    fields: tuple[str, str]
    #: The final answer of a worked solution (the reference).
    reference: Callable[[str], str]
    #: The final answer of a completion.
    extract: Callable[[str], str]
    #: Whether an extracted answer equals the reference.
    equal: Callable[[str, str], bool]

    @staticmethod
    def format(record: Mapping[str, Any], with_answer: bool) -> str:
        raise NotImplementedError

    def __init__(self, path: str, num_shots: int | None = None, shots_path: str | None = None):
        num_shots = DEFAULT_SHOTS[self.name] if num_shots is None else num_shots
        records = read_jsonl(path, self.fields, self.name)
        shot_records = read_jsonl(shots_path, self.fields, self.name) if shots_path else None
        shots, rows = split_shots(records, num_shots, shot_records, self.name)
        prefix = "".join(self.format(r, True) + "\n\n" for r in shots[:num_shots])
        examples = [
            EvalExample(
                uid=_uid(self.name, r, i),
                prompt=prefix + self.format(r, False),
                reference=self.reference(r[self.fields[1]]),
            )
            for i, r in enumerate(rows)
        ]
        super().__init__(examples)

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        extracted = self.extract(completion)
        return Judgement(extracted, self.equal(extracted, example.reference))


class GSM8KTask(_WorkedSolutionTask):
    """Grade-school maths: ``Question: ...\\nAnswer: <worked solution> #### N``."""

    name = "gsm8k"
    stop_strings = ("Question:", "\n\n")
    max_new_tokens = 256
    fields = ("question", "answer")
    reference = staticmethod(ax.gsm8k_reference)
    extract = staticmethod(ax.extract_number_answer)
    equal = staticmethod(ax.numbers_equal)

    @staticmethod
    def format(record: Mapping[str, Any], with_answer: bool) -> str:
        text = f"Question: {record['question']}\nAnswer:"
        return text + f" {record['answer']}" if with_answer else text


class MathTask(_WorkedSolutionTask):
    """Competition maths: ``Problem:\\n...\\n\\nSolution:\\n<solution with \\boxed{}>``."""

    name = "math"
    stop_strings = ("Problem:",)
    max_new_tokens = 512
    fields = ("problem", "solution")
    reference = staticmethod(ax.math_reference)
    extract = staticmethod(ax.extract_math_answer)
    equal = staticmethod(ax.math_answers_equal)

    @staticmethod
    def format(record: Mapping[str, Any], with_answer: bool) -> str:
        text = f"Problem:\n{record['problem']}\n\nSolution:"
        return text + f"\n{record['solution']}" if with_answer else text


# --------------------------------------------------------------------------- multiple choice


class MultipleChoiceTask(Task):
    """The model writes the label of its choice after ``Answer:``; scored by ``extract_choice``."""

    stop_strings = ("\n",)
    max_new_tokens = 16

    def __init__(self, name: str, examples: Sequence[EvalExample]):
        self.name = name
        super().__init__(examples)

    @staticmethod
    def format(question: str, texts: Sequence[str], labels: Sequence[str], answer: str | None) -> str:
        lines = [f"Question: {question.strip()}"]
        lines += [f"{label}. {text}" for label, text in zip(labels, texts)]
        lines.append("Answer:" + (f" {answer}" if answer is not None else ""))
        return "\n".join(lines)

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        extracted = ax.extract_choice(completion, example.meta["labels"])
        return Judgement(extracted, extracted == example.reference)


def _arc_fields(record: Mapping[str, Any], where: str) -> tuple[list[str], list[str], str]:
    choices = record["choices"]
    if not isinstance(choices, Mapping) or "text" not in choices or "label" not in choices:
        raise ValueError(f"arc: {where}: 'choices' must be {{'text': [...], 'label': [...]}}")
    texts, labels = list(choices["text"]), [str(x) for x in choices["label"]]
    answer = str(record["answerKey"])
    if len(texts) != len(labels) or answer not in labels:
        raise ValueError(f"arc: {where}: answerKey {answer!r} not among labels {labels}")
    return texts, labels, answer


def arc_task(
    path: str, num_shots: int = DEFAULT_SHOTS["arc"], shots_path: str | None = None, name: str = "arc"
) -> MultipleChoiceTask:
    fields = ("question", "choices", "answerKey")
    records = read_jsonl(path, fields, name)
    shot_records = read_jsonl(shots_path, fields, name) if shots_path else None
    shots, rows = split_shots(records, num_shots, shot_records, name)
    prefix = ""
    for i, r in enumerate(shots[:num_shots]):
        texts, labels, answer = _arc_fields(r, f"shot {i}")
        prefix += MultipleChoiceTask.format(r["question"], texts, labels, answer) + "\n\n"
    examples = []
    for i, r in enumerate(rows):
        texts, labels, answer = _arc_fields(r, f"record {i}")
        prompt = prefix + MultipleChoiceTask.format(r["question"], texts, labels, None)
        examples.append(EvalExample(_uid(name, r, i), prompt, answer, {"labels": labels}))
    return MultipleChoiceTask(name, examples)


def _mmlu_fields(record: Mapping[str, Any], where: str) -> tuple[list[str], list[str], str]:
    texts = list(record["choices"])
    labels = [chr(ord("A") + i) for i in range(len(texts))]
    answer = record["answer"]
    if isinstance(answer, int) and 0 <= answer < len(texts):
        return texts, labels, labels[answer]
    if isinstance(answer, str) and answer in labels:
        return texts, labels, answer
    raise ValueError(f"mmlu: {where}: 'answer' must be an index 0-{len(texts) - 1} or a letter, got {answer!r}")


def _mmlu_header(subject: str | None) -> str:
    topic = f" about {subject.replace('_', ' ')}" if subject else ""
    return f"The following are multiple choice questions (with answers){topic}.\n\n"


def mmlu_task(
    path: str, num_shots: int = DEFAULT_SHOTS["mmlu"], shots_path: str | None = None, name: str = "mmlu"
) -> MultipleChoiceTask:
    fields = ("question", "choices", "answer")
    records = read_jsonl(path, fields, name)
    shot_records = read_jsonl(shots_path, fields, name) if shots_path else None
    pool, rows = split_shots(records, num_shots, shot_records, name)
    examples = []
    for i, r in enumerate(rows):
        subject = r.get("subject")
        # Same-subject shots first (the standard MMLU setup), topped up from other subjects.
        same = [s for s in pool if s.get("subject") == subject]
        shots = (same + [s for s in pool if s.get("subject") != subject])[:num_shots]
        prompt = _mmlu_header(subject)
        for j, s in enumerate(shots):
            texts, labels, answer = _mmlu_fields(s, f"shot {j}")
            prompt += MultipleChoiceTask.format(s["question"], texts, labels, answer) + "\n\n"
        texts, labels, answer = _mmlu_fields(r, f"record {i}")
        prompt += MultipleChoiceTask.format(r["question"], texts, labels, None)
        examples.append(EvalExample(_uid(name, r, i), prompt, answer, {"labels": labels}))
    return MultipleChoiceTask(name, examples)
