"""The quickstart's report: base AR model vs WeDLM model, the targets, the stages.

Streaming accuracy is held to a *reference* AR decoding: in a from-scratch preset the base
model's (``base-ar`` rows), in a pretrained preset the WeDLM model's own (``ar`` rows; the base
model never saw the task format), where the base model is instead the reference for the general
prompts (``settings.accuracy_reference``).

Input: the two ``report.json`` files written by ``inference/evaluate.py`` on the test prompts
(base model: AR decoding; WeDLM model: streaming, block-wise and AR decoding over the tau
sweep), the calibration (``quickstart/calibration.py``: the operating tau, chosen on other
prompts), the stage records and the training metrics. Output, in the run's directory:

* ``report.json``: the merged evaluation report (loadable with ``EvalReport.load``; the base
  model's rows have method ``base-ar``) plus a ``quickstart`` section: the settings with the
  chosen ``eval.operating_tau``, the calibration, targets (judged at the operating tau),
  headline figures, agreement with the base model's outputs, stage timings, training losses,
  and a fingerprint;
* ``report.md``: targets (met / not met, with the measured value), stages, one table per task;
* ``speed_accuracy.png``: the evaluation package's plot of the merged report (the whole sweep).

Accuracies come with their 95% Wilson interval (``megatron_wedlm.eval.results.wilson_interval``).

Speed-ups compare methods of the *same* model in the *same* process, decoded interleaved per
prompt (see ``megatron_wedlm.eval.runner``), which is what the speed target is about. The
base model ran in another process, so its tokens/s is shown but not divided into anything.

The fingerprint is a hash of every number that does not depend on timing (training losses,
calibration, token counts, forwards, slots, correct answers, generated text). Two runs with the
same seed and preset on the same machine must have the same fingerprint; ``--compare-with``
checks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_wedlm.eval.report import COLUMNS, PLOT_NAME, brief_model_name, format_interval, plot_speed_accuracy
from megatron_wedlm.eval.results import EvalReport, MethodResult, SampleRecord
from megatron_wedlm.quickstart.calibration import REFERENCE_NAMES, Calibration, keeps_up, points, unlearned_message
from megatron_wedlm.quickstart.settings import AnySettings

BASE_METHOD = "base-ar"
REPORT_JSON, REPORT_MD = "report.json", "report.md"
MET, NOT_MET, NOT_CHECKED = "met", "not met", "not checked"


@dataclass
class TargetCheck:
    name: str
    target: str
    measured: str
    status: str  # met | not met | not checked


def _key(task: str, method: str, tau: float | None) -> str:
    return f"{task}/{method}" + ("" if tau is None else f"@{tau:g}")


def merge_reports(base: EvalReport, wedlm: EvalReport) -> EvalReport:
    """One report: the base model's AR rows (as ``base-ar``) then the WeDLM model's rows, per task."""
    def renamed(r: MethodResult) -> MethodResult:
        return MethodResult(**{**{k: getattr(r, k) for k in MethodResult.__dataclass_fields__},
                               "method": BASE_METHOD, "speedup_vs_ar": None})

    results = []
    for task in wedlm.tasks:
        results += [renamed(r) for r in base.results if r.task == task and r.method == "ar"]
        results += [r for r in wedlm.results if r.task == task]
    samples = [SampleRecord(**{**asdict(s), "method": BASE_METHOD}) for s in base.samples if s.method == "ar"]
    samples += list(wedlm.samples)
    settings = {"base": base.settings, "wedlm": wedlm.settings}
    model = f"{brief_model_name(base.model)} (AR) vs {brief_model_name(wedlm.model)} (WeDLM)"
    return EvalReport(model=model, settings=settings, results=results, samples=samples)


def reference_method(settings: Any) -> str:
    """The rows streaming accuracy is held to: the base model's AR, or the same model's AR."""
    return BASE_METHOD if settings.accuracy_reference == "base" else "ar"


def _reference_name(settings: Any) -> str:
    return "base AR" if settings.accuracy_reference == "base" else "AR of the same model"


def _ref_label(method: str) -> str:
    """How tables name the reference rows of ``method`` (:func:`reference_method`)."""
    return REFERENCE_NAMES["base" if method == BASE_METHOD else "self"][1]


def agreement_with_reference(report: EvalReport, method: str = BASE_METHOD) -> dict[str, float]:
    """Per other row: the fraction of prompts whose extracted answer equals the ``method`` rows' answer."""
    base = {(s.task, s.uid): s.extracted for s in report.samples if s.method == method}
    out: dict[str, float] = {}
    for r in report.results:
        if r.method == method:
            continue
        pairs = [(s.extracted, base.get((s.task, s.uid))) for s in report.samples
                 if s.task == r.task and s.method == r.method and s.tau == r.tau]
        pairs = [p for p in pairs if p[1] is not None]
        if pairs:
            out[_key(r.task, r.method, r.tau)] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def fingerprint(report: EvalReport, training: dict[str, dict[str, Any]], calibration: Calibration) -> str:
    """SHA-256 over everything a same-seed rerun must reproduce (no timings)."""
    recorded = asdict(calibration)
    if not recorded["task_taus"]:  # one tau for all: fingerprinted as before per-task calibration existed
        del recorded["task_taus"]
    if not recorded["min_gain"]:  # speeds only decide the tau with a min gain: as before it existed
        del recorded["min_gain"], recorded["tokens_per_forward"]
    payload = {
        "calibration": recorded,
        "results": [[r.task, r.method, r.tau, r.num_examples, r.num_correct, r.generated_tokens, r.forwards, r.slots]
                    for r in report.results],
        "samples": [[s.task, s.method, s.tau, s.uid, s.completion, s.forwards] for s in report.samples],
        "training": {stage: result.get("losses") for stage, result in sorted(training.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _accuracy(r: MethodResult) -> str:
    """``95.0% (89.0-98.0)``: accuracy with its 95% Wilson interval."""
    return f"{_pct(r.accuracy)} ({format_interval(r.accuracy_ci95)})"


def _base_model_check(task: str, calibration: Calibration, reference: str = "base") -> list[TargetCheck]:
    """For a task the reference model did not learn: that failure, and the WeDLM targets left unjudged."""
    model, ar = REFERENCE_NAMES[reference]
    reason = unlearned_message(task, calibration, reference)
    return [TargetCheck(f"{task}: {model} learned the task",
                        f"{ar} >= {100 * calibration.learned_accuracy:g}% on the calibration prompts",
                        reason, NOT_MET)] + [
        TargetCheck(f"{task}: {name}", f"judged only when the {model} learned the task", reason, NOT_CHECKED)
        for name in ("streaming accuracy", "tokens per forward", "wall-clock speed-up")]


def check_targets(report: EvalReport, settings: AnySettings, calibration: Calibration, timings: dict[str, Any],
                  agreement: dict[str, float], current_fingerprint: str,
                  previous_fingerprint: str | None, general: dict[str, tuple[int, int]] | None = None,
                  general_tokens: dict[str, tuple[int, int]] | None = None) -> list[TargetCheck]:
    """Each target of the quickstart with its measured value, streaming judged at the task's tau
    (:meth:`Calibration.tau_for`: the operating tau, or the task's own with per-task calibration);
    a task the reference model did not learn fails as such (:func:`_base_model_check`), not as WeDLM's.
    ``general``: model -> (replies equal to the base model's, prompts) on the general prompts;
    ``general_tokens``: model -> (reply tokens it predicts as the base model's reply has them,
    teacher-forced, reply tokens) on the same prompts (:mod:`megatron_wedlm.eval.reply_agreement`),
    stated beside the target as how far the model moved."""
    t = settings.targets
    reference, ref_name = reference_method(settings), _reference_name(settings)
    which_tau = "the task's tau" if calibration.task_taus else "operating tau"
    checks: list[TargetCheck] = []
    total = float(timings.get("total_seconds", 0.0))
    checks.append(TargetCheck("total time", f"whole command < {t.max_total_seconds:.0f} s",
                              f"{total:.0f} s wall", MET if total < t.max_total_seconds else NOT_MET))
    gap = float(timings.get("longest_silence_seconds", 0.0))
    checks.append(TargetCheck("progress visible", f"no console silence > {t.max_silence_seconds:.0f} s",
                              f"longest silence {gap:.1f} s", MET if gap <= t.max_silence_seconds else NOT_MET))
    for task in t.low_entropy_tasks:
        if task in calibration.unlearned:
            checks += _base_model_check(task, calibration, settings.accuracy_reference)
            continue
        tau = calibration.tau_for(task)
        base = report.result(task, reference)
        stream = report.result(task, "streaming", tau)
        ar = report.result(task, "ar")
        agree = agreement.get(_key(task, "streaming", tau))
        drop = t.max_accuracy_drop
        checks.append(TargetCheck(
            f"{task}: streaming accuracy",
            f"WeDLM streaming ({which_tau}={tau:g}) exact match >= {ref_name} - {100 * drop:g} points",
            f"{_accuracy(stream)} vs {_accuracy(base)} (95% Wilson intervals); same answer as {ref_name} on "
            f"{'-' if agree is None else _pct(agree)} of prompts",
            MET if keeps_up({task: stream.accuracy}, {task: base.accuracy}, drop) else NOT_MET))
        tpf = stream.tokens_per_forward or 0.0
        checks.append(TargetCheck(
            f"{task}: tokens per forward", f">= {t.min_tokens_per_forward:g} tokens/forward (streaming)",
            f"{tpf:.2f}", MET if tpf >= t.min_tokens_per_forward else NOT_MET))
        speedup = stream.speedup_vs_ar
        checks.append(TargetCheck(
            f"{task}: wall-clock speed-up",
            f"streaming tokens/s > {t.min_speedup_vs_ar:g}x AR tokens/s of the same model",
            "-" if speedup is None else f"{speedup:.2f}x ({stream.tokens_per_second or 0:.1f} vs "
            f"{ar.tokens_per_second or 0:.1f} tokens/s)",
            MET if speedup is not None and speedup > t.min_speedup_vs_ar else NOT_MET))
    if general is not None:
        (same, n), (replayed, n_base) = general["wedlm"], general["base"]
        checks.append(TargetCheck(
            "general prompts: the base model's answers kept",
            f"WeDLM model's AR reply = the base model's on >= {100 * t.min_general_same_answer:g}% of held-out prompts",
            f"{same}/{n} ({_pct(same / n)}); before SFT (the base model replaying its references): {replayed}/{n_base}"
            + ("" if general_tokens is None else
               "; teacher-forced, the next token of the base model's reply is predicted on "
               + ", ".join((f"{_pct(k / m)} of {m} tokens" if m else "none (every reply empty)")
                           + f" by the {model} model"
                           for model, (k, m) in general_tokens.items())),
            MET if same >= t.min_general_same_answer * n - 1e-9 else NOT_MET))
    speedups = {task: report.result(task, "streaming", calibration.tau_for(task)).speedup_vs_ar
                for task in report.tasks}
    checks.append(TargetCheck(
        "speed-up on every task", "streaming / AR tokens/s of the same model, stated for every task",
        ", ".join(f"{task} {'-' if s is None else f'{s:.2f}x'}" for task, s in speedups.items()),
        MET if all(s is not None for s in speedups.values()) else NOT_MET))
    if previous_fingerprint is None:
        checks.append(TargetCheck("same seed, same numbers", "a rerun reproduces every non-timing number",
                                  f"fingerprint {current_fingerprint} (rerun with --compare-with to check)", NOT_CHECKED))
    else:
        same = previous_fingerprint == current_fingerprint
        checks.append(TargetCheck("same seed, same numbers", "a rerun reproduces every non-timing number",
                                  f"fingerprint {current_fingerprint} vs {previous_fingerprint}", MET if same else NOT_MET))
    return checks


def _training_summary(training: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for stage, result in training.items():
        losses = [v for _, v in sorted(result.get("losses", {}).items(), key=lambda kv: int(kv[0]))]
        out[stage] = {"steps": result.get("final_step"), "first_loss": losses[0] if losses else None,
                      "last_loss": losses[-1] if losses else None, "checkpoint": (result.get("checkpoints") or [None])[-1],
                      "skipped_steps": result.get("skipped_steps", [])}
    return out


def headline_figures(report: EvalReport, calibration: Calibration, timings: dict[str, Any],
                     agreement: dict[str, float], reference: str = BASE_METHOD) -> dict[str, float | None]:
    """The numbers a reader compares across seeds (``tools/bench_quickstart.py --seeds``), per task at
    its tau (:meth:`Calibration.tau_for`)."""
    figures: dict[str, float | None] = {"operating tau": calibration.operating_tau}
    figures.update({f"{task}: tau": tau for task, tau in calibration.task_taus.items()})
    ref = _ref_label(reference)
    for task in report.tasks:
        tau = calibration.tau_for(task)
        stream = report.result(task, "streaming", tau)
        agree = agreement.get(_key(task, "streaming", tau))
        figures.update({
            f"{task}: {ref} %": 100 * report.result(task, reference).accuracy,
            f"{task}: streaming %": 100 * stream.accuracy,
            f"{task}: same answer as {ref} %": None if agree is None else 100 * agree,
            f"{task}: tokens/forward": stream.tokens_per_forward,
            f"{task}: speed-up vs AR": stream.speedup_vs_ar,
        })
    figures["total seconds"] = float(timings.get("total_seconds", 0.0))
    return figures


@dataclass(frozen=True)
class RunRecord:
    """What a quickstart run recorded besides its evaluation reports.

    ``previous_fingerprint``: of a same-seed earlier run; ``general``, ``general_tokens``: see
    :func:`check_targets`.
    """

    stages: Sequence[Any]
    timings: dict[str, Any]
    training: dict[str, dict[str, Any]]
    previous_fingerprint: str | None = None
    general: dict[str, tuple[int, int]] | None = None
    general_tokens: dict[str, tuple[int, int]] | None = None


def build_summary(base_report: str | Path | None, wedlm_report: str | Path, settings: AnySettings, seed: int,
                  calibration: Calibration, run: RunRecord) -> dict[str, Any]:
    """The full report as a dict (``report.json``).

    ``base_report``: the base model's AR test report, merged in as ``base-ar`` rows (None in a
    pretrained preset).
    """
    wedlm = EvalReport.load(str(wedlm_report))
    merged = wedlm if base_report is None else merge_reports(EvalReport.load(str(base_report)), wedlm)
    tau = calibration.operating_tau
    reference = reference_method(settings)
    agreement = agreement_with_reference(merged, reference)
    stages, timings, training, general, general_tokens = (run.stages, run.timings, run.training, run.general,
                                                          run.general_tokens)
    fp = fingerprint(merged, training, calibration)
    targets = check_targets(merged, settings, calibration, timings, agreement, fp, run.previous_fingerprint, general,
                            general_tokens)
    recorded = asdict(settings)
    recorded["eval"]["operating_tau"] = tau  # next to window_size and distance_penalty: the operating point
    data = merged.to_dict()
    data["quickstart"] = {
        "preset": settings.name,
        "seed": seed,
        "settings": recorded,
        "calibration": asdict(calibration),
        "timings": timings,
        "stages": [asdict(s) for s in stages if s.status != "running"],  # not the report being written
        "training": _training_summary(training),
        "base_model_unlearned": {task: unlearned_message(task, calibration, settings.accuracy_reference)
                                 for task in calibration.unlearned},
        "accuracy_reference": reference,
        "agreement_with_reference": agreement,
        "general_prompts": general,
        "general_prompts_teacher_forced_tokens": general_tokens,
        "figures": {**headline_figures(merged, calibration, timings, agreement, reference),
                    **({} if general is None else {"general: same reply as base %": 100 * general["wedlm"][0]
                                                   / general["wedlm"][1]}),
                    **({} if general_tokens is None else {
                        "general: base reply tokens predicted, teacher-forced %": 100 * general_tokens["wedlm"][0]
                        / max(general_tokens["wedlm"][1], 1)})},
        "targets": [asdict(c) for c in targets],
        "fingerprint": fp,
    }
    return data


def _rows(data: dict[str, Any]) -> list[tuple[str, MethodResult, float | None]]:
    report = EvalReport.from_dict(data)
    agreement = data["quickstart"]["agreement_with_reference"]
    return [(r.task, r, agreement.get(_key(r.task, r.method, r.tau))) for r in report.results]


def _calibration(q: dict[str, Any]) -> Calibration:
    """report.json's calibration record as the :class:`Calibration` it was written from."""
    return Calibration(**q["calibration"])


def _taus_label(c: Calibration) -> str:
    """``the operating tau 0.4``, or with per-task calibration ``each task's tau (counting 0.2,
    copying 0.6, others 0.2)`` (tasks not calibrated are reported at the operating tau)."""
    if c.task_taus:
        return ("each task's tau (" + ", ".join(f"{task} {tau:g}" for task, tau in c.task_taus.items())
                + f", others {c.operating_tau:g})")
    return f"the operating tau {c.operating_tau:g}"


def _model(r: MethodResult, tau: float) -> str:
    """Which model a row is of; ``*`` marks the streaming row at the task's tau (``tau``)."""
    if r.method == BASE_METHOD:
        return "base"
    return "WeDLM*" if r.method == "streaming" and r.tau == tau else "WeDLM"


def _calibration_lines(q: dict[str, Any]) -> list[str]:
    c = q["calibration"]
    tasks = c["tasks"]
    ref = _ref_label(q["accuracy_reference"])
    lines = ["## Calibration", "",
             f"The operating tau is chosen on {c['num_examples']} calibration prompts per task, disjoint from "
             f"the test prompts below: the largest tau whose streaming accuracy stays within "
             f"{points(c['tolerance'])} of {ref} on every task ({', '.join(tasks)})"
             + (f", a larger tau taken only where it decodes {100 * c['min_gain']:g}% more tokens per forward "
                f"than the tau taken below it" if c.get("min_gain") else "")
             + f", else the one closest to {ref} (the largest among equals). "
             f"Chosen: **tau = {c['operating_tau']:g}** (written into the WeDLM model's generation_config.json "
             f"with window {q['settings']['eval']['window_size']}, distance penalty "
             f"{q['settings']['eval']['distance_penalty']:g}, stop fill "
             f"{q['settings']['eval'].get('stop_fill', 'anywhere')} and stop penalty "
             f"{'on' if q['settings']['eval'].get('stop_penalty') else 'off'})."
             + ("" if not c.get("task_taus") else
                f" Each task is also calibrated alone by the same rule and reported at its own tau: "
                + ", ".join(f"**{task} {tau:g}**" for task, tau in c["task_taus"].items()) + "."), "",
             "| decoding | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks),
             f"| {ref} | " + " | ".join(_pct(c["base_accuracy"][t]) for t in tasks) + " |"]
    if c.get("unlearned"):
        lines[2] += (f" Left out of the rule: {', '.join(c['unlearned'])}, which the reference did not learn "
                     f"({ref} below {100 * c['learned_accuracy']:g}%).")
    speeds = c.get("tokens_per_forward") or {}
    lines += [f"| streaming tau {tau} | " + " | ".join(
        _pct(acc[t]) + (f", {speeds[tau][t]:.2f} tokens/forward" if tau in speeds else "") for t in tasks) + " |"
        for tau, acc in c["sweep"].items()]
    return lines + [""]


_INTRO = {
    BASE_METHOD: "Base model: a small Qwen-style model pretrained from scratch with next-token prediction. "
                 "WeDLM model: the same model after WeDLM continued pretraining and WeDLM SFT on the task "
                 "pairs. Both exported to HF and evaluated on held-out prompts of the built-in tasks.",
    "ar": "Base model: a pretrained chat model, converted to Megatron. WeDLM model: the same model after WeDLM "
          "SFT on chat-formatted task pairs and the base model's own replies to general prompts, exported to "
          "HF and evaluated with its chat template on held-out prompts; streaming is held to AR decoding of "
          "the same model, and the base model is the reference on held-out general prompts.",
}


def markdown(data: dict[str, Any]) -> str:
    q = data["quickstart"]
    lines = [f"# WeDLM quickstart (preset {q['preset']}, seed {q['seed']})", "",
             _INTRO[q["accuracy_reference"]] + " Speed-up = tokens/s of a method over "
             "AR tokens/s of the same model, decoded side by side in one process"
             + (f" (weights in {data['settings']['dtype']})." if data["settings"].get("dtype") else "."), "",
             *[f"**Warning: {message}.**\n" for message in q.get("base_model_unlearned", {}).values()],
             "## Targets", "", "| target | wanted | measured | status |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['target']} | {t['measured']} | **{t['status']}** |" for t in q["targets"]]
    lines += [""] + _calibration_lines(q)
    lines += ["", "## Stages", "", "| stage | status | wall s | CPU s | command |", "|---|---|---|---|---|"]
    for s in q["stages"]:
        cmd = "<br>".join(f"`{c}`" for c in s["commands"]) or "(in process)"
        lines.append(f"| {s['name']} | {s['status']} | {s['wall_seconds']:.1f} | {s['cpu_seconds']:.1f} | {cmd} |")
    lines += ["", "CPU seconds are those of the stage's processes; on a shared machine wall time also "
              "counts other users' work.", ""]
    for stage, t in q["training"].items():
        if t["first_loss"] is not None:
            lines.append(f"* {stage}: loss {t['first_loss']:.3f} -> {t['last_loss']:.3f} over {t['steps']} steps")
    calibration = _calibration(q)
    lines += ["", f"Test prompts per task below; `WeDLM*` is streaming at {_taus_label(calibration)}, the "
              "other taus are the sweep (also in speed_accuracy.png)."]
    headers = ["model"] + [h for h, _ in COLUMNS] + [f"same answer as {_ref_label(q['accuracy_reference'])}"]
    for task in dict.fromkeys(task for task, _, _ in _rows(data)):
        lines += ["", f"## {task}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for t, r, agree in _rows(data):
            if t == task:
                cells = ([_model(r, calibration.tau_for(task))] + [cell(r) for _, cell in COLUMNS]
                         + ["-" if agree is None else _pct(agree)])
                lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Fingerprint of all non-timing numbers: `{q['fingerprint']}`.", ""]
    return "\n".join(lines)


def write_summary(data: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"json": out_dir / REPORT_JSON, "markdown": out_dir / REPORT_MD, "plot": out_dir / PLOT_NAME}
    paths["json"].write_text(json.dumps(data, indent=2))
    paths["markdown"].write_text(markdown(data))
    q = data["quickstart"]
    report = EvalReport.from_dict(data)
    plot_speed_accuracy(report, str(paths["plot"]), title=(
        f"WeDLM quickstart ({q['preset']}, seed {q['seed']}): {report.model}; at {_taus_label(_calibration(q))} "
        "(point labels: tau)"))
    return paths


def print_summary(data: dict[str, Any], emit: Callable[[str], None]) -> None:
    """The table a user came for, then the targets, on the console."""
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    q = data["quickstart"]
    calibration = _calibration(q)
    head = f"{'task':<11} {'model':<6} {'method':<20} {'acc':>6} {'95% CI':>11} {'tok/fwd':>7} {'p_cache':>7} " \
           f"{'tok/s':>7} {'vs AR':>6} {'=ref':>6}"
    lines = [head, "-" * len(head)]
    for task, r, agree in _rows(data):
        label = "ar" if r.method == BASE_METHOD else r.label
        lines.append(f"{task:<11} {_model(r, calibration.tau_for(task)):<6} {label:<20} {100 * r.accuracy:5.1f}% "
                     f"{format_interval(r.accuracy_ci95):>11} {f(r.tokens_per_forward, '.2f'):>7} "
                     f"{f(r.p_cache, '.3f'):>7} {f(r.tokens_per_second, '.1f'):>7} "
                     f"{f(r.speedup_vs_ar, '.2f'):>6} {'-' if agree is None else _pct(agree):>6}")
    lines += [f"WeDLM* = streaming at {_taus_label(calibration)}, chosen on calibration prompts "
              "(the test prompts above are others)", "", "targets:"]
    lines += [f"  [{t['status']:^11}] {t['name']}: {t['measured']}  (wanted: {t['target']})"
              for t in data["quickstart"]["targets"]]
    lines += [f"WARNING: {message}" for message in data["quickstart"].get("base_model_unlearned", {}).values()]
    emit("\n".join(lines))
