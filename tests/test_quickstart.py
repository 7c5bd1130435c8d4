"""The quickstart's ``ci`` preset end to end: every stage runs through its real entry point.

The ``ci`` preset (a tiny model, a few steps: it checks that the machinery works, not that the
model learns) run by the seeds runner, ``tools/bench_quickstart.py --seeds 1,2``, as a user would
measure the quickstart over seeds; the other checks look at seed 1. The checks: every stage ran
and is recorded, every artefact exists and parses, both exported models load with
``AutoModelForCausalLM`` and carry the tokenizer's mask token, and the numbers in the report come
from those models (the exported WeDLM model, decoded greedily with HF ``generate``, reproduces the
report's AR answers; the report's totals add up from its samples); tau was chosen on calibration
prompts disjoint from the test prompts and travels with the exported model; the seeds table
holds every seed's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_wedlm.decoding.generation_defaults import read_decoding_defaults
from megatron_wedlm.eval.builtin_tasks import builtin_task
from megatron_wedlm.eval.results import EvalReport, wilson_interval
from megatron_wedlm.quickstart.calibration import choose_operating_tau
from megatron_wedlm.quickstart.pipeline import STAGES
from megatron_wedlm.quickstart.summary import BASE_METHOD

ROOT = Path(__file__).resolve().parents[1]


SEEDS = (1, 2)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_quickstart.py"), "--preset", "ci",
                           "--seeds", ",".join(map(str, SEEDS)), "--out", str(root)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, proc.stdout


@pytest.fixture(scope="module")
def run(bench):
    root, stdout = bench
    return root / f"seed-{SEEDS[0]}", stdout


def test_every_stage_ran_in_order_with_visible_progress(run):
    out, stdout = run
    stages = json.loads((out / "stages.json").read_text())
    assert [s["name"] for s in stages] == list(STAGES)
    assert all(s["status"] == "done" and s["wall_seconds"] > 0 for s in stages)
    for i, name in enumerate(STAGES, 1):
        assert f"=== stage {i}: {name} done in" in stdout
    by_name = {s["name"]: s for s in stages}
    # the real entry points, with the commands recorded
    prepare = by_name["prepare_data"]["commands"]  # the two ran at once: in either order
    assert len(prepare) == 2 and all("tools/prepare_data.py" in c for c in prepare)
    assert sum("--task sft --raw-sft" in c for c in prepare) == 1
    for stage, script in (("ar_pretrain", "pretrain/pretrain_wedlm.py"), ("wedlm_pretrain", "pretrain/pretrain_wedlm.py"),
                          ("sft", "sft/sft_wedlm.py")):
        assert "torch.distributed.run" in by_name[stage]["commands"][0]
        assert f"--nproc_per_node=2 {script}" in by_name[stage]["commands"][0]
    # each stage starts from the previous stage's last checkpoint
    for stage, previous in (("wedlm_pretrain", "ar"), ("sft", "wedlm")):
        checkpoint = json.loads((out / "runs" / previous / "result.json").read_text())["checkpoints"][-1]
        assert f"model.init_from={checkpoint}" in by_name[stage]["commands"][0]
    assert f"data.path={out / 'data' / 'sft_shards'}" in by_name["sft"]["commands"][0]
    assert all("convert_checkpoint.py megatron-to-hf" in c for c in by_name["export"]["commands"])
    evaluations = by_name["evaluate"]["commands"]  # base/WeDLM x calibration/test, WeDLM block-wise apart
    assert len(evaluations) == 5 and all("inference/evaluate.py" in c for c in evaluations)
    assert sum("--methods blockwise" in c for c in evaluations) == 1
    assert not (out / "eval" / "wedlm" / "blockwise").exists()  # joined into the WeDLM report
    assert sum("calibration" in c for c in evaluations) == 2
    for tag in ("evaluate:wedlm", "evaluate:ar-base_calibration", "export:wedlm", "prepare_data:sft"):
        assert f"[{tag}] $ " in stdout  # commands run at once are told apart on the console
    for stage in stages:
        if stage["log"]:
            assert (out / stage["log"]).stat().st_size > 0


def test_data_artefacts_parse(run):
    out, _ = run
    lines = (out / "data" / "corpus.jsonl").read_text().splitlines()
    assert lines and all(json.loads(x)["text"] for x in lines)
    manifest = json.loads((out / "data" / "shards" / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert manifest["mask_token_id"] == tok.mask_token_id
    shards = sorted((out / "data" / "shards").glob("*.tar"))
    assert shards and all(tarfile.is_tarfile(s) for s in shards)
    pairs = [json.loads(x) for x in (out / "data" / "sft.jsonl").read_text().splitlines()]
    assert pairs and all(p["prompt"] and p["response"].endswith("\n") for p in pairs)
    sft_manifest = json.loads((out / "data" / "sft_shards" / "manifest.json").read_text())
    assert sft_manifest["num_samples"] == len(pairs) and sft_manifest["mask_token_id"] == tok.mask_token_id
    # every answer ends with the newline, which the manifest names as the reply end
    assert sft_manifest["end_token_id"] == tok.convert_tokens_to_ids("Ċ") and sft_manifest["bad_lines"] == 0


def test_training_runs_wrote_losses_and_checkpoints(run):
    out, _ = run
    for name, wedlm in (("ar", False), ("wedlm", True), ("sft", True)):
        result = json.loads((out / "runs" / name / "result.json").read_text())
        assert result["final_step"] > 0 and len(result["losses"]) == result["final_step"]
        assert Path(result["checkpoints"][-1]).is_dir()
        metrics = [json.loads(x) for x in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert metrics and all("loss" in m for m in metrics)
        # plain AR training has no masked-token loss; WeDLM training has both losses
        assert any(m["masked_tokens"] > 0 for m in metrics) == wedlm
        assert all(m["ar_loss"] > 0 for m in metrics)


def test_exported_models_load_and_reproduce_the_reported_ar_answers(run):
    out, _ = run
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    report = EvalReport.load(str(out / "report.json"))
    for name in ("ar-base", "wedlm"):
        model = AutoModelForCausalLM.from_pretrained(str(out / "hf" / name)).eval()
        assert model.config.mask_token_id == tok.mask_token_id
        exported_tok = AutoTokenizer.from_pretrained(str(out / "hf" / name))
        method = BASE_METHOD if name == "ar-base" else "ar"
        sample = next(s for s in report.samples if s.method == method and s.task == "copying")
        prompt = next(ex.prompt for ex in _task("copying", out).examples if ex.uid == sample.uid)
        ids = exported_tok(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == tok(prompt)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=sample.new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        text = exported_tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.split("\n", 1)[0] == sample.completion


def _task(name, out):
    q = json.loads((out / "report.json").read_text())["quickstart"]
    return builtin_task(name, num_examples=q["settings"]["eval"]["num_examples"], seed=q["seed"])


def test_report_parses_and_its_totals_add_up(run):
    out, stdout = run
    data = json.loads((out / "report.json").read_text())
    report = EvalReport.from_dict(data)
    q = data["quickstart"]
    assert q["preset"] == "ci" and q["seed"] == 1
    methods = {(r.task, r.method) for r in report.results}
    for task in q["settings"]["eval"]["tasks"]:
        assert {(task, m) for m in (BASE_METHOD, "ar", "streaming", "blockwise")} <= methods
    for r in report.results:
        mine = [s for s in report.samples if (s.task, s.method, s.tau) == (r.task, r.method, r.tau)]
        assert len(mine) == r.num_examples
        assert sum(s.correct for s in mine) == r.num_correct
        assert sum(s.new_tokens for s in mine) == r.generated_tokens
        assert sum(s.forwards for s in mine) == r.forwards
    names = [t["name"] for t in q["targets"]]
    assert {"total time", "progress visible", "counting: tokens per forward", "copying: wall-clock speed-up",
            "same seed, same numbers"} <= set(names)
    assert all(t["status"] in ("met", "not met", "not checked") for t in q["targets"])
    md = (out / "report.md").read_text()
    assert "## Targets" in md and all(f"| {n} |" in md for n in names)
    assert (out / "speed_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "targets:" in stdout and f"report: {out / 'report.md'}" in stdout
    for r in data["results"]:
        assert tuple(r["accuracy_ci95"]) == wilson_interval(r["num_correct"], r["num_examples"])


def _sample_prompts(report_json: Path, split: str, seed: int) -> set[str]:
    """The prompts behind a report's samples, regenerated from their task, split and seed."""
    report = EvalReport.load(str(report_json))
    prompts = set()
    for task, count in report.settings["tasks"].items():
        by_uid = {ex.uid: ex.prompt for ex in builtin_task(task, count, seed=seed, split=split).examples}
        uids = {s.uid for s in report.samples if s.task == task}
        assert uids == set(by_uid)  # the report's samples are exactly that split's prompts
        prompts |= set(by_uid.values())
    return prompts


def test_tau_is_chosen_on_calibration_prompts_disjoint_from_the_test_prompts(run):
    out, stdout = run
    q = json.loads((out / "report.json").read_text())["quickstart"]
    c = q["calibration"]
    calibration = set()
    for model in ("ar-base", "wedlm"):
        calibration |= _sample_prompts(out / "eval" / "calibration" / model / "report.json", "calibration", q["seed"])
    test = _sample_prompts(out / "eval" / "wedlm" / "report.json", "test", q["seed"])
    assert len(calibration) == len(c["tasks"]) * c["num_examples"] and test
    assert not calibration & test
    # the recorded accuracies come from the calibration reports, and the rule applied to them gives the tau
    wedlm = EvalReport.load(str(out / "eval" / "calibration" / "wedlm" / "report.json"))
    assert {f"{t:g}" for t in q["settings"]["eval"]["taus"]} == set(c["sweep"])
    for tau, accuracy in c["sweep"].items():
        assert accuracy == {t: wedlm.result(t, "streaming", float(tau)).accuracy for t in c["tasks"]}
    sweep = {float(tau): acc for tau, acc in c["sweep"].items()}
    assert c["tolerance"] == q["settings"]["eval"]["calibration_tolerance"] == 0.5  # the preset's, not the default
    assert c["operating_tau"] == choose_operating_tau(sweep, c["base_accuracy"], c["tolerance"])
    assert q["settings"]["eval"]["operating_tau"] == c["operating_tau"]
    assert f"operating tau {c['operating_tau']:g}" in stdout


def test_exported_wedlm_model_carries_the_calibrated_decoding_defaults(run):
    out, _ = run
    e = json.loads((out / "report.json").read_text())["quickstart"]["settings"]["eval"]
    assert read_decoding_defaults(out / "hf" / "wedlm") == {
        "window_size": e["window_size"], "entropy_threshold": e["operating_tau"],
        "distance_penalty": e["distance_penalty"], "contiguous_stop": e["stop_fill"] == "contiguous",
        "stop_penalty": e["stop_penalty"]}
    generation_config = json.loads((out / "hf" / "wedlm" / "generation_config.json").read_text())
    assert "transformers_version" in generation_config  # HF's own keys are kept next to ours


def test_seeds_runner_prints_every_seed_and_the_range_of_each_figure(bench):
    root, stdout = bench
    figures = {seed: json.loads((root / f"seed-{seed}" / "report.json").read_text())["quickstart"]["figures"]
               for seed in SEEDS}
    assert {json.loads((root / f"seed-{seed}" / "report.json").read_text())["quickstart"]["seed"]
            for seed in SEEDS} == set(SEEDS)
    table = stdout[stdout.index("=== ci preset over seeds 1,2"):]
    assert table.splitlines()[1].split() == [f"{w}" for s in SEEDS for w in ("seed", str(s))] + ["min", "median", "max"]
    for name in figures[SEEDS[0]]:
        row = next(line for line in table.splitlines() if line.startswith(name + "  "))
        values = [figures[seed][name] for seed in SEEDS]
        expected = values + [min(values), sum(values) / 2, max(values)] if None not in values else None
        cells = row[len(name):].split()
        if expected is not None:
            assert cells == [f"{v:.2f}" for v in expected], row
    assert "counting: tokens per forward" in table and "same seed, same numbers" in table
