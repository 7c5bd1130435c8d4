"""Scoring saved completions without generating again, as the runner scores them.

Completions come from a report's samples (``report.json``, matched by ``uid``, one score per
configuration) or from a jsonl of dataset records plus ``"completion"`` (paper-suite tasks only,
which read records as published); each is cut at the first stop string and judged by the task.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_wedlm.eval.dataset_files import Layout, read_records
from megatron_wedlm.eval.paper_suite import PAPER_TASKS, load_paper_task, paper_task_name
from megatron_wedlm.eval.registry import load_task, parse_task_spec
from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task, truncate_at_stop

COMPLETION = "completion"


def score_samples(task: Task, samples: Sequence[tuple[EvalExample, str]]) -> tuple[float, list[Judgement]]:
    """(accuracy, one judgement per sample) for ``(example, completion)`` pairs of ``task``."""
    if not samples:
        raise ValueError(f"no samples to score for task {task.name!r}")
    examples = [ex for ex, _ in samples]
    completions = [truncate_at_stop(c, task.stop_strings) for _, c in samples]
    judgements = task.judge_all(examples, completions)
    return sum(j.correct for j in judgements) / len(judgements), judgements


@dataclass
class ScoredRun:
    """The verdicts for one decoding configuration (``method``/``tau`` ``None`` for a jsonl file)."""

    task: str
    method: str | None
    tau: float | None
    examples: list[EvalExample]
    judgements: list[Judgement]
    accuracy: float

    @property
    def label(self) -> str:
        if self.method is None:
            return "samples"
        return self.method if self.tau is None else f"{self.method} (tau={self.tau:g})"

    def verdicts(self) -> list[dict[str, Any]]:
        """One JSON-ready row per sample: the task, configuration, uid and the verdict."""
        return [
            {"task": self.task, "method": self.method, "tau": self.tau, "uid": ex.uid,
             "correct": j.correct, "extracted": j.extracted, "reference": ex.reference, "detail": j.detail}
            for ex, j in zip(self.examples, self.judgements)
        ]


def _is_report(path: str) -> bool:
    """Whether ``path`` holds a report (one JSON object with results and samples), not jsonl lines."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError:
        return False  # jsonl: more than one value
    except OSError as e:
        raise ValueError(f"cannot read samples file {path!r}: {e}") from None
    return isinstance(data, dict) and "samples" in data and "results" in data


def _task_for_scoring(spec: str, sandbox: dict[str, Any], data_path: str | None = None) -> Task:
    """The task to score with; a paper task is built without its few-shot text (never read here)."""
    name, path = parse_task_spec(spec) if data_path is None else (spec, data_path)
    if name in PAPER_TASKS:
        assert path is not None
        return load_paper_task(name, path, prompts=False, **sandbox)
    return load_task(spec, **sandbox)


def score_report(report_path: str, spec: str, **sandbox: Any) -> list[ScoredRun]:
    """Rescore a report's samples of the task named by ``spec`` (which names its data file)."""
    task = _task_for_scoring(spec, sandbox)
    report = EvalReport.load(report_path)
    by_uid = {ex.uid: ex for ex in task.examples}
    runs: dict[tuple[str, float | None], list[tuple[EvalExample, str]]] = {}
    for s in report.samples:
        if s.task != task.name:
            continue
        if s.uid not in by_uid:
            raise ValueError(f"{report_path}: sample {s.uid!r} of {task.name} is not in the task's data; "
                             f"score it with the data file the report was made from")
        runs.setdefault((s.method, s.tau), []).append((by_uid[s.uid], s.completion))
    if not runs:
        present = sorted({s.task for s in report.samples})
        raise ValueError(f"{report_path} holds no samples of task {task.name!r} (it has {present or 'none'}; "
                         "was it written with --no-samples?)")
    scored = []
    for (method, tau), samples in runs.items():
        accuracy, judgements = score_samples(task, samples)
        scored.append(ScoredRun(task.name, method, tau, [ex for ex, _ in samples], judgements, accuracy))
    return scored


def score_jsonl(samples_path: str, name: str, **sandbox: Any) -> ScoredRun:
    """Score a jsonl of dataset records, each with a ``"completion"``, for the paper task ``name``."""
    name = paper_task_name(name)
    if name not in PAPER_TASKS:
        raise ValueError(
            f"{samples_path}: jsonl samples are read as the data file of a task of the paper's suite "
            f"({', '.join(PAPER_TASKS)}); to rescore {name!r}, pass a report.json of inference/evaluate.py"
        )
    layout = Layout(name, (COMPLETION,), "a jsonl of the dataset's records, each with the model's \"completion\"")
    completions = [r[COMPLETION] for r in read_records(samples_path, layout)]
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise ValueError(f"{samples_path}: record {i}: \"completion\" must be a string, got {type(c).__name__}")
    task = _task_for_scoring(name, sandbox, data_path=samples_path)
    samples = [(ex, completions[ex.meta["row"]]) for ex in task.examples]
    accuracy, judgements = score_samples(task, samples)
    return ScoredRun(task.name, None, None, [ex for ex, _ in samples], judgements, accuracy)


def score_file(samples_path: str, spec: str, **sandbox: Any) -> list[ScoredRun]:
    """Score ``samples_path`` (a report.json or a jsonl of records + completions) for ``spec``."""
    if _is_report(samples_path):
        return score_report(samples_path, spec, **sandbox)
    parts = [p.strip() for p in spec.strip().split(":")]
    length = 2 if parts[0].lower() == "paper" else 1
    if len(parts) > length:
        raise ValueError(f"{samples_path} is not a report, so its lines are the data: give the task "
                         f"as {':'.join(parts[:length])}, without a path")
    return [score_jsonl(samples_path, ":".join(parts).lower(), **sandbox)]
