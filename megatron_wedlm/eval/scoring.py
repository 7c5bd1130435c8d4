"""Scoring saved completions without generating again.

A completion is scored as the runner scores it: cut at the task's first stop string
(``truncate_at_stop``), then judged by the task's own ``judge_all``. Completions come from

* a report's samples (``report.json`` of ``inference/evaluate.py``): matched to the task's
  examples by ``uid``, one score per decoding configuration (method, tau);
* a jsonl file whose lines hold a dataset record's fields plus ``"completion"``: the lines are
  read as the task's data file (so only tasks of the paper's suite, which take records as they
  are published, read this form), one score for the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_wedlm.eval.dataset_files import Layout, read_records
from megatron_wedlm.eval.paper_suite import PAPER_TASKS, load_paper_task
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
    parts = [p.strip() for p in spec.strip().split(":")]
    length = 2 if parts[0].lower() == "paper" else 1
    if len(parts) > length:
        raise ValueError(f"{samples_path} is not a report, so its lines are the data: give the task "
                         f"as {':'.join(parts[:length])}, without a path")
    name = ":".join(parts).lower()
    return [score_jsonl(samples_path, name, **sandbox)]
