"""The quickstart's operating point: the entropy threshold tau, chosen on calibration prompts
disjoint from the test prompts, so the reported test figures are not the best of a sweep.

One operating tau for all tasks travels with the export as its default; with ``per_task`` each
task is also reported at its own tau. A task the base AR model did not learn
(:attr:`Calibration.unlearned`) is left out of the rule and reported as the base model's failure.
The rule and its reasons: docs/quickstart.md, "Settings and why".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_wedlm.eval.results import EvalReport

#: Default "within 1 point of base AR": accuracies are fractions.
CALIBRATION_TOLERANCE = 0.01
_EPS = 1e-9  # accuracies are ratios of counts; keep an exact "1 point lower" inside the tolerance


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured and the tau it chose (recorded in report.json)."""

    tasks: list[str]
    num_examples: int  # calibration prompts per task
    tolerance: float
    base_accuracy: dict[str, float]  # task -> base AR accuracy
    sweep: dict[str, dict[str, float]]  # f"{tau:g}" -> task -> streaming accuracy
    operating_tau: float
    learned_accuracy: float = 0.0  # base AR accuracy below which a task counts as not learned
    unlearned: list[str] = field(default_factory=list)  # tasks the base model did not learn (not in the rule)
    task_taus: dict[str, float] = field(default_factory=dict)  # per-task calibration: task -> its tau
    min_gain: float = 0.0  # a larger tau must buy this much more tokens per forward (0.1 = 10%); 0: any
    tokens_per_forward: dict[str, dict[str, float]] = field(default_factory=dict)  # f"{tau:g}" -> task -> streaming

    def tau_for(self, task: str) -> float:
        """The tau ``task`` is reported at: its own with per-task calibration, else the operating tau."""
        return self.task_taus.get(task, self.operating_tau)


def choose_operating_tau(sweep: Mapping[float, Mapping[str, float]], base: Mapping[str, float],
                         tolerance: float = CALIBRATION_TOLERANCE, speed: Mapping[float, float] | None = None,
                         min_gain: float = 0.0) -> float:
    """The largest tau of ``sweep`` (tau -> task -> accuracy) within ``tolerance`` of ``base`` (task ->
    base AR accuracy) on every task; else the smallest worst shortfall, the largest among equals (not
    the smallest tau: a late range end is lost at every tau). With ``min_gain`` > 0 a larger keeping
    tau is taken only for ``1 + min_gain`` times the ``speed`` (tokens per forward) of the one before."""
    if not sweep:
        raise ValueError("calibration needs at least one tau in the sweep")
    if not base:
        raise ValueError("calibration needs the base AR accuracy of at least one task")
    if min_gain < 0:
        raise ValueError(f"min_gain is a fraction >= 0 (0.1 = 10% more tokens per forward), got {min_gain}")
    for tau, accuracy in sweep.items():
        missing = sorted(set(base) - set(accuracy))
        if missing:
            raise ValueError(f"calibration at tau={tau:g} has no accuracy for task(s) {missing}")
    if min_gain and (speed is None or set(sweep) - set(speed)):
        raise ValueError(f"min_gain needs the tokens per forward of every tau of the sweep {sorted(sweep)}, "
                         f"got them for {sorted(speed or ())}")
    good = sorted(tau for tau, accuracy in sweep.items() if keeps_up(accuracy, base, tolerance))
    if good:
        taken = good[0]
        for tau in good[1:]:  # without a min gain every larger tau is taken: the largest
            if not min_gain or speed[tau] >= (1 + min_gain) * speed[taken] - _EPS:  # type: ignore[index]
                taken = tau
        return taken
    least = min(shortfall(accuracy, base) for accuracy in sweep.values())
    return max(tau for tau, accuracy in sweep.items() if shortfall(accuracy, base) <= least + _EPS)


def shortfall(accuracy: Mapping[str, float], base: Mapping[str, float]) -> float:
    """The largest amount by which ``accuracy`` falls below ``base`` over the tasks of ``base`` (0 if none)."""
    return max(0.0, *(base[task] - accuracy[task] for task in base))


def keeps_up(accuracy: Mapping[str, float], base: Mapping[str, float], tolerance: float) -> bool:
    """Whether ``accuracy`` is within ``tolerance`` of ``base`` (or above) on every task of ``base``."""
    return all(accuracy[task] >= base[task] - tolerance - _EPS for task in base)


def calibration_from_reports(base_report: EvalReport, wedlm_report: EvalReport, tasks: Sequence[str],
                             tolerance: float = CALIBRATION_TOLERANCE, learned_accuracy: float = 0.0,
                             per_task: bool = False, min_gain: float = 0.0) -> Calibration:
    """:func:`choose_operating_tau` over the tasks whose base AR accuracy reaches ``learned_accuracy``
    (the smallest tau when none does), and with ``per_task`` over each alone; speed is streaming
    tokens per forward, for the operating tau the tasks' mean."""
    base = {task: base_report.result(task, "ar").accuracy for task in tasks}
    taus = sorted({r.tau for r in wedlm_report.results if r.method == "streaming" and r.tau is not None})
    streaming = {tau: {task: wedlm_report.result(task, "streaming", tau) for task in tasks} for tau in taus}
    sweep = {tau: {task: r.accuracy for task, r in rows.items()} for tau, rows in streaming.items()}
    speeds = {tau: {task: r.tokens_per_forward for task, r in rows.items()} for tau, rows in streaming.items()}
    counts = {r.num_examples for r in wedlm_report.results if r.task in tasks}
    unlearned = [task for task in tasks if base[task] < learned_accuracy - _EPS]
    learned = {task: accuracy for task, accuracy in base.items() if task not in unlearned}
    mean_speed = {tau: sum(speeds[tau][task] for task in learned) / max(len(learned), 1) for tau in taus}
    tau = choose_operating_tau(sweep, learned, tolerance, mean_speed, min_gain) if learned else min(sweep)
    task_taus = {task: choose_operating_tau({t: {task: acc[task]} for t, acc in sweep.items()}, {task: base_accuracy},
                                            tolerance, {t: speeds[t][task] for t in taus}, min_gain)
                 for task, base_accuracy in learned.items()} if per_task else {}
    return Calibration(tasks=list(tasks), num_examples=min(counts, default=0), tolerance=tolerance,
                       base_accuracy=base, sweep={f"{tau:g}": acc for tau, acc in sweep.items()},
                       operating_tau=tau, learned_accuracy=learned_accuracy, unlearned=unlearned,
                       task_taus=task_taus, min_gain=min_gain,
                       tokens_per_forward={f"{tau:g}": speed for tau, speed in speeds.items()})


#: How messages name the reference model and its AR decoding, by a preset's ``accuracy_reference``:
#: the base model (from-scratch presets) or the fine-tuned model itself (pretrained presets).
REFERENCE_NAMES = {"base": ("base model", "base AR"), "self": ("fine-tuned model", "AR")}


def unlearned_message(task: str, c: Calibration, reference: str = "base") -> str:
    """The one sentence that says a task's WeDLM figures mean nothing (console, report.md, targets)."""
    model, ar = REFERENCE_NAMES[reference]
    return (f"the {model} did not learn {task} ({ar} {100 * c.base_accuracy[task]:.1f}% on {c.num_examples} "
            f"calibration prompts, below {100 * c.learned_accuracy:g}%): the WeDLM comparison on it means nothing")


def points(fraction: float) -> str:
    """``0.01`` -> ``"1 point"``, ``0.02`` -> ``"2 points"``."""
    n = 100 * fraction
    return f"{n:g} point" + ("" if abs(n - 1) < _EPS else "s")


def describe(c: Calibration, reference: str = "base") -> list[str]:
    """Console lines: the calibration's figures and chosen tau (``reference``: a key of :data:`REFERENCE_NAMES`)."""
    def row(accuracy: Mapping[str, float], speed: Mapping[str, float] | None = None) -> str:
        return ", ".join(f"{task} {100 * a:.1f}%" + (f" ({speed[task]:.2f} tokens/forward)" if speed else "")
                         for task, a in accuracy.items())

    chosen = f"{c.operating_tau:g}"
    worth = (f", a larger tau taken only for {100 * c.min_gain:g}% more tokens per forward than the tau taken "
             f"below it" if c.min_gain else "")
    learned = {task: a for task, a in c.base_accuracy.items() if task not in c.unlearned}
    within = bool(learned) and keeps_up(c.sweep[chosen], learned, c.tolerance)
    model, ar = REFERENCE_NAMES[reference]
    which = ("every task" if not c.unlearned
             else f"{', '.join(learned) or 'no task'} (the tasks the {model} learned)")
    return ([f"{ar}: {row(c.base_accuracy)} ({c.num_examples} calibration prompts per task)"]
            + [unlearned_message(task, c, reference) for task in c.unlearned]
            + [f"streaming tau {tau}: {row(acc, c.tokens_per_forward.get(tau))}" for tau, acc in c.sweep.items()]
            + [f"operating tau {chosen}: " + (f"the largest within {points(c.tolerance)} of {ar} on {which}{worth}"
                                              if within else f"no tau stayed within {points(c.tolerance)} "
                                              f"of {ar} on {which}; the closest to it (the largest among "
                                              f"equals)")]
            + (["tau per task: " + ", ".join(f"{task} {tau:g}" for task, tau in c.task_taus.items())
                + f" (each the largest within {points(c.tolerance)} of {ar} on its own prompts{worth}, else the "
                  f"closest)"]
               if c.task_taus else []))
