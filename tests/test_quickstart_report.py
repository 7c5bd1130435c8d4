"""Quickstart report logic on real evaluation reports, and the stage runner on real subprocesses."""

from __future__ import annotations

import copy
import json
import sys

import pytest

from megatron_wedlm.eval import EvalPlan, builtin_task, evaluate
from megatron_wedlm.eval.report import brief_model_name
from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.quickstart import summary as S
from megatron_wedlm.quickstart.calibration import (Calibration, calibration_from_reports, choose_operating_tau, points,
                                                   shortfall)
from megatron_wedlm.quickstart.calibration import describe as calibration_describe
from megatron_wedlm.quickstart.pipeline import previous_fingerprint
from megatron_wedlm.quickstart.settings import load_settings, preset_path
from megatron_wedlm.quickstart.stages import Console, StageError, StageRunner
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

TASKS = ("counting", "copying", "arithmetic")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Real reports of two tiny random models: 'base' (AR only) and 'wedlm' (all methods)."""
    tok = build_tiny_tokenizer()
    tasks = [builtin_task(t, num_examples=2, seed=0) for t in TASKS]
    base = evaluate(build_tiny_model(tok, seed=1), tok, EvalPlan(tasks, ["ar"], max_new_tokens=6,
                                                                 model_name="/runs/q/hf/base"))
    wedlm = evaluate(build_tiny_model(tok, seed=2), tok, EvalPlan(tasks, ["streaming", "blockwise", "ar"],
                                                                  taus=(0.4, 0.8), max_new_tokens=6,
                                                                  model_name="/runs/q/hf/wedlm"))
    root = tmp_path_factory.mktemp("reports")
    (root / "base.json").write_text(base.to_json())
    (root / "wedlm.json").write_text(wedlm.to_json())
    return root


TRAINING = {"ar_pretrain": {"final_step": 3, "losses": {"1": 5.0, "2": 4.5, "3": 4.0}, "checkpoints": ["c1"]},
            "wedlm_pretrain": {"final_step": 2, "losses": {"1": 3.0, "2": 2.5}, "checkpoints": ["c2"]}}


def _summary(reports, timings=None, training=None, previous=None):
    settings = load_settings(preset_path("ci"))
    settings.eval.taus = [0.4, 0.8]
    # the calibration rule applied to real reports (here the test reports stand in for calibration ones)
    calibration = calibration_from_reports(EvalReport.load(str(reports / "base.json")),
                                           EvalReport.load(str(reports / "wedlm.json")), ["counting", "copying"])
    return S.build_summary(reports / "base.json", reports / "wedlm.json", settings, seed=0, calibration=calibration,
                           run=S.RunRecord(stages=[], timings=timings or {"total_seconds": 100.0,
                                                                          "longest_silence_seconds": 5.0},
                                           training=training or TRAINING, previous_fingerprint=previous))


def _tau(data):
    return data["quickstart"]["calibration"]["operating_tau"]


def test_merged_report_keeps_every_row_and_renames_the_base_model(reports):
    base, wedlm = EvalReport.load(str(reports / "base.json")), EvalReport.load(str(reports / "wedlm.json"))
    merged = S.merge_reports(base, wedlm)
    assert len(merged.results) == len(base.results) + len(wedlm.results)
    for task in TASKS:
        b = merged.result(task, S.BASE_METHOD)
        assert (b.num_correct, b.generated_tokens, b.forwards) == (
            base.result(task, "ar").num_correct, base.result(task, "ar").generated_tokens, base.result(task, "ar").forwards)
        assert merged.result(task, "streaming", 0.8).forwards == wedlm.result(task, "streaming", 0.8).forwards
    assert {s.method for s in merged.samples} == {S.BASE_METHOD, "streaming", "blockwise", "ar"}


def test_agreement_matches_a_direct_comparison_of_the_samples(reports):
    data = _summary(reports)
    report = EvalReport.from_dict(data)
    agreement = data["quickstart"]["agreement_with_reference"]
    for r in report.results:
        if r.method == S.BASE_METHOD:
            continue
        same = 0
        for s in report.samples:
            if (s.task, s.method, s.tau) == (r.task, r.method, r.tau):
                base = next(b for b in report.samples if b.method == S.BASE_METHOD and (b.task, b.uid) == (s.task, s.uid))
                same += s.extracted == base.extracted
        assert agreement[S._key(r.task, r.method, r.tau)] == same / r.num_examples


def _targets(data):
    return {t["name"]: t for t in data["quickstart"]["targets"]}


def test_target_statuses_follow_the_measured_numbers_at_the_operating_tau(reports):
    data = _summary(reports)
    report = EvalReport.from_dict(data)
    targets = _targets(data)
    tau = _tau(data)
    for task in ("counting", "copying"):
        stream, base = report.result(task, "streaming", tau), report.result(task, S.BASE_METHOD)
        close = stream.accuracy >= base.accuracy - 0.02
        assert targets[f"{task}: streaming accuracy"]["status"] == (S.MET if close else S.NOT_MET)
        assert f"operating tau={tau:g}" in targets[f"{task}: streaming accuracy"]["target"]
        tpf_ok = stream.tokens_per_forward >= 4.0
        assert targets[f"{task}: tokens per forward"]["status"] == (S.MET if tpf_ok else S.NOT_MET)
        assert f"{stream.tokens_per_forward:.2f}" in targets[f"{task}: tokens per forward"]["measured"]
        fast = stream.speedup_vs_ar > 1.0
        assert targets[f"{task}: wall-clock speed-up"]["status"] == (S.MET if fast else S.NOT_MET)
        assert data["quickstart"]["figures"][f"{task}: tokens/forward"] == stream.tokens_per_forward
    every = targets["speed-up on every task"]["measured"]
    assert all(f"{t} {report.result(t, 'streaming', tau).speedup_vs_ar:.2f}x" in every for t in TASKS)
    assert targets["total time"]["status"] == S.MET
    slow = _targets(_summary(reports, timings={"total_seconds": 901.0, "longest_silence_seconds": 31.0}))
    assert slow["total time"]["status"] == S.NOT_MET and slow["progress visible"]["status"] == S.NOT_MET
    assert targets["same seed, same numbers"]["status"] == S.NOT_CHECKED


def test_accuracy_target_fails_when_streaming_is_worse_than_the_base_model(reports, tmp_path):
    base = json.loads((reports / "base.json").read_text())
    wedlm = json.loads((reports / "wedlm.json").read_text())
    for r in base["results"]:
        r["num_correct"] = r["num_examples"]
    for r in wedlm["results"]:
        r["num_correct"] = 0
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "wedlm.json").write_text(json.dumps(wedlm))
    targets = _targets(_summary(tmp_path))
    assert targets["counting: streaming accuracy"]["status"] == S.NOT_MET
    # with the 95% Wilson intervals of 0 and 2 correct out of 2
    assert "0.0% (0.0-65.8) vs 100.0% (34.2-100.0)" in targets["counting: streaming accuracy"]["measured"]


def test_fingerprint_ignores_timings_and_sees_every_result(reports, tmp_path):
    data = _summary(reports)
    (tmp_path / "first.json").write_text(json.dumps(data))
    first = previous_fingerprint(tmp_path / "first.json", "ci", 0)
    with pytest.raises(ValueError, match="seed 1"):
        previous_fingerprint(tmp_path / "first.json", "ci", 1)
    retimed = _summary(reports, timings={"total_seconds": 1.0, "longest_silence_seconds": 1.0}, previous=first)
    assert retimed["quickstart"]["fingerprint"] == data["quickstart"]["fingerprint"]
    assert _targets(retimed)["same seed, same numbers"]["status"] == S.MET
    other_training = copy.deepcopy(TRAINING)
    other_training["wedlm_pretrain"]["losses"]["2"] = 2.5000001
    changed = _summary(reports, training=other_training, previous=first)
    assert changed["quickstart"]["fingerprint"] != data["quickstart"]["fingerprint"]
    assert _targets(changed)["same seed, same numbers"]["status"] == S.NOT_MET


def test_written_report_parses_and_shows_every_target_and_row(reports, tmp_path):
    data = _summary(reports)
    paths = S.write_summary(data, tmp_path)
    loaded = EvalReport.load(str(paths["json"]))
    assert len(loaded.results) == len(data["results"])
    assert json.loads(paths["json"].read_text())["quickstart"]["fingerprint"] == data["quickstart"]["fingerprint"]
    md = paths["markdown"].read_text()
    for t in data["quickstart"]["targets"]:
        assert f"| {t['name']} | {t['target']} | {t['measured']} | **{t['status']}** |" in md
    for r in loaded.results:
        assert f"| {r.method} | {'-' if r.tau is None else format(r.tau, 'g')} | {r.num_examples} | " in md
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = []
    S.print_summary(data, lines.append)
    assert "targets:" in lines[0] and lines[0].count("\n") >= len(loaded.results) + len(data["quickstart"]["targets"])


def test_a_task_the_base_never_learned_is_reported_as_the_base_models_failure(reports, tmp_path):
    """Base AR gets copying wrong: the report says so, tau is chosen on counting alone, and the
    copying targets are the base model's failure, not WeDLM's."""
    base = json.loads((reports / "base.json").read_text())
    for r in base["results"]:
        r["num_correct"] = 0 if r["task"] == "copying" else r["num_examples"]
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "wedlm.json").write_text((reports / "wedlm.json").read_text())
    base_report, wedlm_report = (EvalReport.load(str(tmp_path / f"{n}.json")) for n in ("base", "wedlm"))
    calibration = calibration_from_reports(base_report, wedlm_report, ["counting", "copying"], learned_accuracy=0.8)
    assert calibration.unlearned == ["copying"]
    sweep = {tau: {"counting": wedlm_report.result("counting", "streaming", tau).accuracy}
             for tau in (0.4, 0.8) if wedlm_report.result("counting", "streaming", tau) is not None}
    assert calibration.operating_tau == choose_operating_tau(sweep, {"counting": 1.0}, calibration.tolerance)
    settings = load_settings(preset_path("ci"))
    data = S.build_summary(tmp_path / "base.json", tmp_path / "wedlm.json", settings, seed=0, calibration=calibration,
                           run=S.RunRecord(stages=[], timings={"total_seconds": 100.0, "longest_silence_seconds": 5.0},
                                           training=TRAINING))
    targets = _targets(data)
    message = "the base model did not learn copying (base AR 0.0%"
    assert targets["copying: base model learned the task"]["status"] == S.NOT_MET
    assert message in targets["copying: base model learned the task"]["measured"]
    for name in ("streaming accuracy", "tokens per forward", "wall-clock speed-up"):
        assert targets[f"copying: {name}"]["status"] == S.NOT_CHECKED
    assert "counting: base model learned the task" not in targets and "counting: streaming accuracy" in targets
    assert message in data["quickstart"]["base_model_unlearned"]["copying"]
    assert message in S.markdown(data) and any(message in line for line in calibration_describe(calibration))
    lines = []
    S.print_summary(data, lines.append)
    assert f"WARNING: {message}" in lines[0]
    # learned by the base at the threshold: judged as usual
    assert calibration_from_reports(base_report, wedlm_report, ["counting", "copying"], learned_accuracy=0.0).unlearned == []


def test_per_task_calibration_reports_each_task_at_its_own_tau(reports, tmp_path):
    """Counting keeps up with base AR only at tau 0.4, copying at 0.4 and 0.8: one tau for all is 0.4,
    per task copying goes to 0.8, is judged there, and the export default stays 0.4."""
    base = json.loads((reports / "base.json").read_text())
    wedlm = json.loads((reports / "wedlm.json").read_text())
    for r in base["results"]:
        r["num_correct"] = r["num_examples"]
    for r in wedlm["results"]:
        lost = r["method"] == "streaming" and r["task"] == "counting" and r["tau"] == 0.8
        r["num_correct"] = 0 if lost else r["num_examples"]
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "wedlm.json").write_text(json.dumps(wedlm))
    base_report, wedlm_report = (EvalReport.load(str(tmp_path / f"{n}.json")) for n in ("base", "wedlm"))
    shared = calibration_from_reports(base_report, wedlm_report, ["counting", "copying"])
    calibration = calibration_from_reports(base_report, wedlm_report, ["counting", "copying"], per_task=True)
    assert shared.operating_tau == calibration.operating_tau == 0.4 and shared.task_taus == {}
    assert calibration.task_taus == {"counting": 0.4, "copying": 0.8}
    assert calibration.tau_for("copying") == 0.8 and calibration.tau_for("arithmetic") == 0.4
    settings = load_settings(preset_path("ci"))
    settings.eval.tau_per_task = True
    data = S.build_summary(tmp_path / "base.json", tmp_path / "wedlm.json", settings, seed=0, calibration=calibration,
                           run=S.RunRecord(stages=[], timings={"total_seconds": 100.0, "longest_silence_seconds": 5.0},
                                           training=TRAINING))
    q, targets, report = data["quickstart"], _targets(data), EvalReport.from_dict(data)
    for task, tau in (("counting", 0.4), ("copying", 0.8)):
        stream = report.result(task, "streaming", tau)
        assert f"the task's tau={tau:g}" in targets[f"{task}: streaming accuracy"]["target"]
        assert targets[f"{task}: tokens per forward"]["measured"] == f"{stream.tokens_per_forward:.2f}"
        assert q["figures"][f"{task}: tau"] == tau and q["figures"][f"{task}: tokens/forward"] == stream.tokens_per_forward
    assert q["figures"]["operating tau"] == q["settings"]["eval"]["operating_tau"] == 0.4
    assert S.fingerprint(report, TRAINING, calibration) != S.fingerprint(report, TRAINING, shared)
    assert "each task's tau (counting 0.4, copying 0.8, others 0.4)" in S.markdown(data)
    assert "tau per task: counting 0.4, copying 0.8" in "\n".join(calibration_describe(calibration))
    lines = []
    S.print_summary(data, lines.append)
    starred = [line for line in lines[0].splitlines() if " WeDLM* " in line]  # the rows each task is judged on
    assert [line.split()[0] for line in starred] == list(TASKS)
    assert all(f"(tau={calibration.tau_for(line.split()[0]):g})" in line for line in starred)


def test_operating_tau_rule_on_hand_made_accuracies():
    base = {"counting": 0.90, "copying": 1.00}
    sweep = {0.1: {"counting": 0.92, "copying": 1.00}, 0.3: {"counting": 0.89, "copying": 0.99},
             0.5: {"counting": 0.85, "copying": 1.00}, 0.7: {"counting": 0.95, "copying": 0.97}}
    # 0.3 is exactly 1 point below base on both tasks (kept); 0.5 drops 5 on counting, 0.7 3 on copying
    assert choose_operating_tau(sweep, base) == 0.3
    assert choose_operating_tau({0.5: sweep[0.5], 0.1: sweep[0.1]}, base) == 0.1  # order of the sweep is irrelevant
    # none keeps up: the closest to base (0.7 is 3 points short on copying, 0.5 5 on counting) ...
    assert choose_operating_tau({0.5: sweep[0.5], 0.7: sweep[0.7]}, base) == 0.7
    assert shortfall(sweep[0.7], base) == pytest.approx(0.03) and shortfall(sweep[0.1], base) == 0.0
    # ... the largest among equally close ones (the same prompts lost at every tau)
    flat = {tau: {"counting": 0.871, "copying": 1.00} for tau in (0.2, 0.3, 0.4)}
    assert choose_operating_tau(flat, base) == 0.4
    assert choose_operating_tau({**flat, 0.3: {"counting": 0.88, "copying": 1.00}}, base) == 0.3
    assert choose_operating_tau(sweep, base, tolerance=0.03) == 0.7  # within 3 points: 0.7 keeps up
    assert points(0.01) == "1 point" and points(0.02) == "2 points"
    with pytest.raises(ValueError, match=r"tau=0.3 has no accuracy for task\(s\) \['copying'\]"):
        choose_operating_tau({0.3: {"counting": 0.9}}, base)
    with pytest.raises(ValueError, match="at least one tau"):
        choose_operating_tau({}, base)


def test_min_gain_takes_a_larger_tau_only_for_enough_more_tokens_per_forward():
    """A tau that keeps up is taken over the one taken below it only for ``1 + min_gain`` times its
    tokens per forward; without a min gain the rule is the largest tau that keeps up."""
    base = {"counting": 1.00}
    sweep = {0.2: {"counting": 1.00}, 0.3: {"counting": 1.00}, 0.4: {"counting": 0.99}, 0.6: {"counting": 0.80}}
    speed = {0.2: 2.95, 0.3: 3.16, 0.4: 3.30, 0.6: 3.60}
    assert choose_operating_tau(sweep, base, 0.03) == choose_operating_tau(sweep, base, 0.03, speed) == 0.4
    assert choose_operating_tau(sweep, base, 0.03, speed, min_gain=0.05) == 0.3  # +7.1%, then +4.4% over 0.3
    # each larger tau is weighed against the one taken, not its neighbour: 0.4 is +11.9% over 0.2
    assert choose_operating_tau(sweep, base, 0.03, speed, min_gain=0.1) == 0.4
    assert choose_operating_tau(sweep, base, 0.03, speed, min_gain=0.2) == 0.2
    assert choose_operating_tau(sweep, base, 0.03, {**speed, 0.3: 2.95 * 1.1}, min_gain=0.1) == 0.3  # exactly 10%
    # 0.6 would be the fastest but does not keep up; no tau keeping up falls back as before, speeds aside
    assert choose_operating_tau(sweep, base, 0.03, {**speed, 0.6: 9.0}, min_gain=0.1) == 0.4
    short = {tau: {"counting": 0.9} for tau in (0.2, 0.3)}
    assert choose_operating_tau(short, base, 0.03, {0.2: 3.0, 0.3: 3.1}, min_gain=0.1) == 0.3
    with pytest.raises(ValueError, match="min_gain is a fraction >= 0"):
        choose_operating_tau(sweep, base, 0.03, speed, min_gain=-0.1)
    with pytest.raises(ValueError, match=r"min_gain needs the tokens per forward of every tau of the sweep"):
        choose_operating_tau(sweep, base, 0.03, {0.2: 3.0}, min_gain=0.1)


def test_min_gain_weighs_the_calibration_reports_tokens_per_forward(reports, tmp_path):
    """Every prompt right at every tau: each task's speeds are its streaming rows' tokens per forward,
    the one tau's their mean, each recorded; a min gain above any the sweep shows keeps the smallest
    tau, and the fingerprint carries the speeds only when they decide."""
    base = json.loads((reports / "base.json").read_text())
    wedlm = json.loads((reports / "wedlm.json").read_text())
    for r in base["results"] + wedlm["results"]:
        r["num_correct"] = r["num_examples"]
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "wedlm.json").write_text(json.dumps(wedlm))
    base_report, wedlm_report = (EvalReport.load(str(tmp_path / f"{n}.json")) for n in ("base", "wedlm"))
    tasks = ["counting", "copying"]
    plain = calibration_from_reports(base_report, wedlm_report, tasks, per_task=True)
    assert plain.operating_tau == 0.8 and plain.task_taus == {"counting": 0.8, "copying": 0.8}
    speeds = {tau: {t: wedlm_report.result(t, "streaming", tau).tokens_per_forward for t in tasks}
              for tau in (0.4, 0.8)}
    for gain in (0.0, 0.25, 10.0):
        c = calibration_from_reports(base_report, wedlm_report, tasks, per_task=True, min_gain=gain)
        assert c.min_gain == gain and c.tokens_per_forward == {f"{tau:g}": s for tau, s in speeds.items()}
        sweep = {tau: {t: 1.0 for t in tasks} for tau in speeds}
        mean = {tau: sum(s.values()) / len(s) for tau, s in speeds.items()}
        assert c.operating_tau == choose_operating_tau(sweep, c.base_accuracy, c.tolerance, mean, gain)
        for t in tasks:
            assert c.task_taus[t] == choose_operating_tau({tau: {t: 1.0} for tau in speeds}, {t: 1.0}, c.tolerance,
                                                          {tau: s[t] for tau, s in speeds.items()}, gain)
        if gain == 10.0:
            assert c.operating_tau == 0.4 and c.task_taus == {"counting": 0.4, "copying": 0.4}
            assert "a larger tau taken only for 1000% more tokens per forward" in "\n".join(calibration_describe(c))
    report = EvalReport.load(str(reports / "wedlm.json"))
    faster = {tau: {t: s + 1.0 for t, s in by_task.items()} for tau, by_task in plain.tokens_per_forward.items()}
    assert S.fingerprint(report, TRAINING, plain) == S.fingerprint(
        report, TRAINING, Calibration(**{**plain.__dict__, "tokens_per_forward": faster}))
    gained = calibration_from_reports(base_report, wedlm_report, tasks, per_task=True, min_gain=0.25)
    assert S.fingerprint(report, TRAINING, gained) != S.fingerprint(
        report, TRAINING, Calibration(**{**gained.__dict__, "tokens_per_forward": faster}))


def test_report_records_the_operating_point_and_names_models_briefly(reports):
    data = _summary(reports)
    q = data["quickstart"]
    assert q["calibration"]["operating_tau"] in (0.4, 0.8)
    assert {"window_size", "distance_penalty", "operating_tau"} <= set(q["settings"]["eval"])
    assert q["settings"]["eval"]["operating_tau"] == q["figures"]["operating tau"] == _tau(data)
    assert data["model"] == "base (AR) vs wedlm (WeDLM)"
    assert brief_model_name("/abs/run/hf/wedlm/ vs ./ckpt/x") == "wedlm vs x"
    assert brief_model_name("tencent/WeDLM-8B") == "tencent/WeDLM-8B"  # a hub id is not a path


# -- the stage runner ------------------------------------------------------------------------

CHILD = r"""
import sys, warnings
for i in range(3):
    sys.stdout.write(f"bar {i}\r"); sys.stdout.flush()
warnings.warn("noisy library")
print("line one")
print("line two", file=sys.stderr)
if sys.argv[1] == "fail":
    raise ValueError("bad thing")
"""


class ConsoleText:
    """A console stream that keeps what was written, in ``text``."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_stage_runner_logs_everything_filters_the_console_and_records_stages(tmp_path):
    out = ConsoleText()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runner = StageRunner(tmp_path, Console(out))
    record = runner.stage("child", "a real subprocess",
                          lambda: runner.run([sys.executable, str(script), "ok"]) or {"ok": 1})
    log = (tmp_path / "logs" / "child.log").read_text()
    for text in ("bar 0", "bar 2", "noisy library", "line one", "line two"):
        assert text in log
    console = out.text
    assert "line one" in console and "line two" in console and "noisy library" not in console
    assert "(1 Python warnings in child.log)" in console
    assert "bar 0" in console and "bar 1" not in console  # progress-bar updates are collapsed
    assert record.status == "done" and record.detail == {"ok": 1} and record.cpu_seconds > 0
    assert record.commands[0].startswith(sys.executable)
    with pytest.raises(StageError, match=r"exit status 1[\s\S]*reported:\n  ValueError: bad thing\n[\s\S]*line two"):
        runner.stage("failing", "raises", lambda: runner.run([sys.executable, str(script), "fail"]))
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in stages] == [("child", "done"), ("failing", "failed")]


def test_stage_runner_in_parallel_runs_jobs_at_once_and_raises_after_all_ended(tmp_path):
    """Two jobs that each wait for the other's file can only finish if they run at once; a failing
    job's error comes out only after the other job has ended (no child outlives its stage)."""
    out = ConsoleText()
    meet = ("import pathlib, sys, time\nmine, theirs = map(pathlib.Path, sys.argv[1:3])\nmine.touch()\n"
            "deadline = time.time() + 60\nwhile not theirs.exists():\n    assert time.time() < deadline, 'alone'\n"
            "    time.sleep(0.05)\ntime.sleep(float(sys.argv[4]))\nprint('met', mine.name)\nsys.exit(int(sys.argv[3]))\n")
    script = tmp_path / "meet.py"
    script.write_text(meet)
    a, b = tmp_path / "a", tmp_path / "b"
    runner = StageRunner(tmp_path, Console(out))

    def job(mine, theirs, code, tag, linger=0.0):
        return lambda: runner.run([sys.executable, str(script), str(mine), str(theirs), str(code), str(linger)],
                                  log_name=tag, tag=tag) or tag

    record = runner.stage("both", "two at once", lambda: {"done": runner.in_parallel([job(a, b, 0, "x"), job(b, a, 0, "y")])})
    assert record.detail == {"done": ["x", "y"]} and len(record.commands) == 2
    console = out.text
    assert "[x] met a" in console and "[y] met b" in console  # each child's lines carry its own tag

    for f in (a, b):
        f.unlink()
    with pytest.raises(StageError, match="exit status 3"):
        runner.stage("one fails", "", lambda: runner.in_parallel([job(a, b, 3, "p"), job(b, a, 0, "q", linger=1.0)]))
    assert "met b" in (tmp_path / "logs" / "q.log").read_text()  # q, 1 s slower than p's failure, ran to its end
