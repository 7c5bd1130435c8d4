"""What an evaluation task is: prompts, references, stop strings and a scorer.

Every task is scored from generated text, because the evaluation compares *decoders* on one
model (likelihood scoring is the ``lm_eval`` adapter's). The runner cuts each completion at the
first stop string before scoring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EvalExample:
    """One prompt and what a correct answer looks like: ``reference`` is the answer text reports
    show; scorers that need more (test code, choice labels) read ``meta``."""

    uid: str
    prompt: str
    reference: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Judgement:
    """The answer a scorer extracted from a completion and whether it is correct."""

    extracted: str
    correct: bool
    detail: str = ""


#: ARC's two sets by the two spellings users meet: lm-eval's (this project's own tasks and
#: ``--mc-sets``) -> the WeDLM reference's (the paper suite: ``paper:arc_c``). Wherever a user names
#: one, both are accepted and read as that place's own (docs/evaluation.md, "ARC's names").
ARC_SPELLINGS = {"arc_challenge": "arc_c", "arc_easy": "arc_e"}


def arc_spelling(name: str, reference: bool = False) -> str:
    """``name`` with an ARC set spelt as lm-eval does (``arc_challenge``), or with ``reference`` as the
    WeDLM reference does (``arc_c``); any other name unchanged."""
    lm_eval = {short: long for long, short in ARC_SPELLINGS.items()}.get(name, name)
    return ARC_SPELLINGS.get(lm_eval, lm_eval) if reference else lm_eval


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """Cut ``text`` at the earliest occurrence of any stop string (the stop string is dropped)."""
    cut = len(text)
    for stop in stop_strings:
        if stop:
            pos = text.find(stop)
            if pos != -1:
                cut = min(cut, pos)
    return text[:cut]


class Task:
    """Base class: a named list of examples with a scorer. Subclasses implement ``judge``; those
    with costly scoring (code execution) override ``judge_all`` to work in parallel."""

    name: str = "task"
    #: Stop strings that end an answer; generation also stops at the tokenizer's EOS.
    stop_strings: tuple[str, ...] = ()
    #: Generation budget that fits every reference answer of the task.
    max_new_tokens: int = 256
    #: The data files the examples were read from, where the task records them (printed by evaluate.py).
    data_files: tuple[str, ...] = ()

    def __init__(self, examples: Sequence[EvalExample]):
        if not examples:
            raise ValueError(f"task {self.name!r} has no examples; check the data file or --limit")
        self.examples: list[EvalExample] = list(examples)

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        raise NotImplementedError

    def judge_all(
        self, examples: Sequence[EvalExample], completions: Sequence[str]
    ) -> list[Judgement]:
        if len(examples) != len(completions):
            raise ValueError(
                f"{len(examples)} examples but {len(completions)} completions for task {self.name!r}"
            )
        return [self.judge(ex, c) for ex, c in zip(examples, completions)]

    def limited(self, limit: int | None) -> "Task":
        """The same task restricted to its first ``limit`` examples (``None``: all)."""
        if limit is None or limit >= len(self.examples):
            return self
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.examples = self.examples[:limit]
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, examples={len(self.examples)})"
