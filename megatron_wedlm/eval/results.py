"""The evaluation report: accuracy and speed per (task, decoding method, tau), JSON round-trip.

Speed follows the paper's definitions on the decoders' counts (``decoding.result``):
``tokens_per_forward`` = tokens / forwards, ``p_cache`` = tokens / generated slots processed,
``tokens_per_second`` over the examples timed one at a time (``timed_examples``), prefill
included. Sums are taken before dividing, so long answers weigh by their length. Accuracy carries
its 95% Wilson interval: on 20 or 100 prompts the sampling error is several points.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_VERSION = 1
Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (default 95%): unlike ``p +- z*sqrt(p(1-p)/n)``
    it stays in [0, 1] and does not collapse at 0 or n successes, where small evaluations land."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"Wilson interval needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class SampleRecord:
    """One generated answer, for inspecting failures."""

    task: str
    method: str
    tau: float | None
    uid: str
    completion: str
    extracted: str
    reference: str
    correct: bool
    new_tokens: int
    forwards: int
    seconds: float | None  # None: decoded in accuracy mode (batched), not timed
    detail: str = ""


@dataclass
class MethodResult:
    """Totals and derived metrics for one task under one decoding configuration."""

    task: str
    method: str
    tau: float | None
    num_examples: int
    num_correct: int
    generated_tokens: int
    forwards: int
    slots: int
    seconds: float
    speedup_vs_ar: float | None = None
    #: examples decoded one at a time and timed (speed mode), and the tokens they emitted; None in
    #: reports where every example was timed
    timed_examples: int | None = None
    timed_tokens: int | None = None

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_examples if self.num_examples else 0.0

    @property
    def accuracy_ci95(self) -> tuple[float, float] | None:
        """95% Wilson interval of the accuracy (``None`` without examples)."""
        return wilson_interval(self.num_correct, self.num_examples) if self.num_examples else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.generated_tokens / self.forwards if self.forwards else None

    @property
    def p_cache(self) -> float | None:
        return self.generated_tokens / self.slots if self.slots else None

    @property
    def tokens_per_second(self) -> float | None:
        tokens = self.generated_tokens if self.timed_tokens is None else self.timed_tokens
        return tokens / self.seconds if self.seconds > 0 else None

    @property
    def label(self) -> str:
        return self.method if self.tau is None else f"{self.method} (tau={self.tau:g})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            accuracy=self.accuracy,
            accuracy_ci95=self.accuracy_ci95,
            tokens_per_forward=self.tokens_per_forward,
            p_cache=self.p_cache,
            tokens_per_second=self.tokens_per_second,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MethodResult":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class EvalReport:
    model: str
    settings: dict[str, Any]
    results: list[MethodResult]
    samples: list[SampleRecord] = field(default_factory=list)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r.task for r in self.results))

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(r.method for r in self.results))

    def result(self, task: str, method: str, tau: float | None = None) -> MethodResult:
        for r in self.results:
            if r.task == task and r.method == method and (tau is None or r.tau == tau):
                return r
        raise KeyError(f"no result for task={task!r} method={method!r} tau={tau!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "model": self.model,
            "settings": self.settings,
            "results": [r.to_dict() for r in self.results],
            "samples": [asdict(s) for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalReport":
        if d.get("version") != REPORT_VERSION:
            raise ValueError(f"report version {d.get('version')!r} is not {REPORT_VERSION}")
        return cls(
            model=d["model"],
            settings=d["settings"],
            results=[MethodResult.from_dict(r) for r in d["results"]],
            samples=[SampleRecord(**s) for s in d.get("samples", [])],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str) -> "EvalReport":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
