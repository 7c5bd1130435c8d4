"""The evaluation runner, the report files and the inference/evaluate.py command line."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from megatron_wedlm.decoding import GenerationResult, generate, generate_batch, load_tokenizer
from megatron_wedlm.eval import EvalReport, builtin_task, evaluate, write_report
from megatron_wedlm.decoding.settings import DecodeSettings
from megatron_wedlm.eval import runner
from megatron_wedlm.eval.runner import EvalPlan, combine_reports
from megatron_wedlm.eval.tasks import truncate_at_stop
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer, arch="qwen3", seed=1)


class OracleDecoder:
    """Answers every prompt with a known text; 'parallel' methods claim 3 tokens per forward.

    Lets the runner's bookkeeping (stop tokens, truncation, scoring, metric sums) be checked
    against numbers computed here by hand.
    """

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def __call__(self, model, prompt_ids, settings, **kwargs):
        method = settings.method
        self.calls.append((method, settings.entropy_threshold))
        prompt = self.tokenizer.decode(prompt_ids)
        ids = self.tokenizer(self.answers[prompt])["input_ids"][:settings.max_new_tokens - 1] + [settings.stop_token_ids[0]]
        per_forward = 1 if method == "ar" else 3
        forwards = math.ceil(len(ids) / per_forward)
        seconds = 0.01 * forwards
        return GenerationResult(ids, forwards, forwards * (1 if method == "ar" else 4), seconds, method)


def test_runner_accounting_with_an_oracle_decoder(model, tokenizer, monkeypatch):
    counting, copying = builtin_task("counting", 4, seed=5), builtin_task("copying", 3, seed=5)
    answers = {e.prompt: f" {e.reference}\nCount from" for e in counting.examples}  # extra text after the stop
    answers |= {e.prompt: " " + e.reference.replace("a", "b") for e in copying.examples}  # wrong when it has an "a"
    oracle = OracleDecoder(tokenizer, answers)
    monkeypatch.setattr(runner, "generate", oracle)
    report = evaluate(model, tokenizer, EvalPlan([counting, copying], taus=(0.3, 0.7), warmup=False))

    assert report.tasks == ["counting", "copying"] and report.methods == ["streaming", "blockwise", "ar"]
    assert len(report.results) == 2 * 5 and len(oracle.calls) == 7 * 5
    assert [r.tau for r in report.results[:5]] == [0.3, 0.7, 0.3, 0.7, None]
    expected_copying = sum("a" not in e.reference for e in copying.examples) / 3
    for r in report.results:
        assert r.accuracy == (1.0 if r.task == "counting" else pytest.approx(expected_copying))
        samples = [s for s in report.samples if (s.task, s.method, s.tau) == (r.task, r.method, r.tau)]
        assert r.generated_tokens == sum(s.new_tokens for s in samples)
        assert r.forwards == sum(s.forwards for s in samples)
        assert r.tokens_per_forward == pytest.approx(r.generated_tokens / r.forwards)
        assert r.p_cache == pytest.approx(r.generated_tokens / r.slots)
        ar = report.result(r.task, "ar")
        assert r.speedup_vs_ar == pytest.approx(r.tokens_per_second / ar.tokens_per_second)
    # the stop token is not part of the text, and what follows the stop string is cut off
    sample = next(s for s in report.samples if s.task == "counting")
    assert sample.completion == " " + sample.reference and sample.correct


@pytest.mark.parametrize("fused_refill", [True, False], ids=["fused", "paper"])
def test_runner_matches_direct_decoding(model, tokenizer, fused_refill):
    task = builtin_task("arithmetic", 2, seed=0)
    report = evaluate(model, tokenizer, EvalPlan([task], ["streaming", "ar"], taus=(0.5,), max_new_tokens=6,
                                                 settings=DecodeSettings(fused_refill=fused_refill)))
    assert report.settings["refill"] == ("fused" if fused_refill else "paper")
    for sample in report.samples:
        ids = tokenizer(next(e.prompt for e in task.examples if e.uid == sample.uid))["input_ids"]
        refill = {} if sample.method == "ar" else {"fused_refill": fused_refill}
        direct = generate(model, ids, method=sample.method, mask_token_id=tokenizer.mask_token_id,
                          entropy_threshold=0.5, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id],
                          stop_strings=["\n"], tokenizer=tokenizer, **refill)
        assert sample.new_tokens == len(direct.token_ids) and sample.forwards == direct.num_forwards
        text = tokenizer.decode([t for t in direct.token_ids if t != tokenizer.eos_token_id], skip_special_tokens=True)
        assert sample.completion == truncate_at_stop(text, ["\n"])
    assert report.settings["mask_token_id"] == tokenizer.mask_token_id
    assert report.settings["tasks"] == {"arithmetic": 2}


def test_confident_model_fills_several_slots_per_forward(tokenizer):
    """A sharpened (low-entropy) model: the parallel methods emit more than one token per forward
    through the runner, AR exactly one."""
    model = build_tiny_model(tokenizer, arch="qwen2", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    report = evaluate(model, tokenizer, EvalPlan(["copying"], taus=(0.5,), limit=3, max_new_tokens=24, warmup=False))
    for method in ("streaming", "blockwise"):
        # Algorithm 1's fixed window commits a filled run one forward after filling it, so a
        # sharpened random model lands near 1.5 here; AR can never exceed 1.
        assert report.result("copying", method, 0.5).tokens_per_forward > 1.25
    ar = report.result("copying", "ar")
    assert ar.tokens_per_forward == ar.p_cache == 1.0


def test_sampled_runs_are_reproducible_from_the_seed(model, tokenizer):
    def run(seed):
        report = evaluate(model, tokenizer, EvalPlan(["counting"], ["streaming", "ar"], limit=2, max_new_tokens=5,
                                                     settings=DecodeSettings(temperature=1.0), seed=seed, warmup=False))
        return [(s.method, s.completion) for s in report.samples]

    first = run(seed=7)
    assert len(first) == 4 and first == run(seed=7)
    assert first != run(seed=8)


def test_runner_rejects_bad_input(model, tokenizer):
    task = builtin_task("counting", 1)
    with pytest.raises(ValueError, match="unknown decoding methods"):
        evaluate(model, tokenizer, EvalPlan([task], ["beam"]))
    with pytest.raises(ValueError, match="no tasks"):
        evaluate(model, tokenizer, EvalPlan([]))
    with pytest.raises(ValueError, match="entropy threshold"):
        evaluate(model, tokenizer, EvalPlan([task], taus=()))


def _table_rows(markdown: str) -> dict[tuple[str, str, str], dict[str, str]]:
    rows, task, header = {}, None, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            task = line[3:].strip()
        elif line.startswith("| method"):
            header = [c.strip() for c in line.strip("|").split("|")]
        elif line.startswith("| ") and header:
            cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            rows[(task, cells["method"], cells["tau"])] = cells
    return rows


def test_methods_decoded_in_separate_runs_combine_into_the_report_of_one_run(model, tokenizer, monkeypatch):
    """The quickstart decodes the block-wise baseline in a second process; the joined report must be
    the one a single run writes: same rows and samples in the same order, speed-ups against AR."""
    tasks = [builtin_task("counting", 3, seed=2), builtin_task("copying", 2, seed=2)]
    monkeypatch.setattr(runner, "generate", OracleDecoder(tokenizer, {e.prompt: " " + e.reference for t in tasks
                                                                      for e in t.examples}))

    def run(methods):
        report = evaluate(model, tokenizer, EvalPlan(tasks, methods, taus=(0.3, 0.6), model_name="tiny", warmup=False))
        report.settings.pop("time")
        return report

    whole = run(["streaming", "blockwise", "ar"])
    blockwise, rest = run(["blockwise"]), run(["streaming", "ar"])
    assert all(r.speedup_vs_ar is None for r in blockwise.results)  # no AR row in that run
    assert combine_reports([blockwise, rest]).to_dict() == whole.to_dict()  # any order of the parts
    assert combine_reports([rest, blockwise]).to_dict() == whole.to_dict()
    assert all(r.speedup_vs_ar is None for r in blockwise.results)  # the parts are left as they were
    with pytest.raises(ValueError, match="different models"):
        combine_reports([rest, EvalReport("other", blockwise.settings, blockwise.results)])
    with pytest.raises(ValueError, match=r"methods \['blockwise'\] are not in the order given"):
        combine_reports([rest, blockwise], methods=["streaming", "ar"])


def test_report_files_round_trip(model, tokenizer, tmp_path, monkeypatch):
    oracle = OracleDecoder(tokenizer, {})
    tasks = [builtin_task("counting", 3, seed=1), builtin_task("arithmetic", 3, seed=1)]
    oracle.answers = {e.prompt: " " + e.reference for t in tasks for e in t.examples}
    oracle.answers[tasks[1].examples[0].prompt] = " -1"
    monkeypatch.setattr(runner, "generate", oracle)
    report = evaluate(model, tokenizer, EvalPlan(tasks, taus=(0.2, 0.4, 0.6), model_name="tiny"))
    paths = write_report(report, str(tmp_path / "out"))

    loaded = EvalReport.load(paths["json"])
    assert loaded.to_dict() == report.to_dict()
    assert {(r.task, r.method, r.tau) for r in loaded.results} == {
        (t, m, tau) for t in ("counting", "arithmetic") for m in ("streaming", "blockwise") for tau in (0.2, 0.4, 0.6)
    } | {("counting", "ar", None), ("arithmetic", "ar", None)}

    rows = _table_rows(Path(paths["markdown"]).read_text())
    assert len(rows) == len(loaded.results)
    for r in loaded.results:
        cells = rows[(r.task, r.method, "-" if r.tau is None else f"{r.tau:g}")]
        assert float(cells["accuracy (%)"]) == pytest.approx(100 * r.accuracy, abs=0.05)
        assert float(cells["tokens/forward"]) == pytest.approx(r.tokens_per_forward, abs=0.005)
        assert float(cells["p_cache"]) == pytest.approx(r.p_cache, abs=0.0005)
        assert float(cells["speedup vs AR"]) == pytest.approx(r.speedup_vs_ar, abs=0.005)
        assert int(cells["forwards"]) == r.forwards and int(cells["tokens"]) == r.generated_tokens
    assert loaded.result("arithmetic", "ar").accuracy == pytest.approx(2 / 3)

    png = Path(paths["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    image = matplotlib.image.imread(paths["plot"])
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0  # not a blank canvas


def test_evaluate_cli_end_to_end(model, tokenizer, tmp_path):
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    reloaded = load_tokenizer(ckpt)  # the CLI must see the prompts tokenized as in training
    for example in builtin_task("counting", 3).examples + builtin_task("copying", 3).examples:
        assert reloaded(example.prompt)["input_ids"] == tokenizer(example.prompt)["input_ids"]
    # Loaded by path: the name "evaluate" also belongs to a PyPI package that lm-eval installs.
    spec = importlib.util.spec_from_file_location("wedlm_evaluate_cli", ROOT / "inference" / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "report"
    rc = cli.main([
        "--model", str(ckpt), "--tasks", "counting,copying", "--methods", "streaming,blockwise,ar",
        "--taus", "0.3,0.6", "--limit", "2", "--max-new-tokens", "5", "--out", str(out),
        "--device", "cpu", "--quiet",
    ])
    assert rc == 0
    report = EvalReport.load(str(out / "report.json"))
    assert report.tasks == ["counting", "copying"] and len(report.results) == 2 * 5
    assert all(r.num_examples == 2 and 0 < r.generated_tokens <= 10 for r in report.results)
    assert report.settings["taus"] == [0.3, 0.6] and report.model == str(ckpt)
    assert (out / "report.md").read_text().count("| streaming |") == 4
    assert re.search(r"\| ar \| - \| 2 \|", (out / "report.md").read_text())
    assert report.settings["mask_token_id"] == tokenizer.mask_token_id  # read from the checkpoint config
    assert report.settings["refill"] == "fused" and report.settings["stop_at_eos"] is True


def _outputs(report):
    """Per-example outputs and counts, and each row's totals, without the timings."""
    samples = [(s.task, s.method, s.tau, s.uid, s.completion, s.correct, s.new_tokens, s.forwards)
               for s in report.samples]
    rows = [(r.task, r.method, r.tau, r.num_examples, r.num_correct, r.generated_tokens, r.forwards, r.slots)
            for r in report.results]
    return samples, rows


@pytest.fixture(scope="module")
def confident(tokenizer):
    """A sharpened tiny model: the parallel methods fill several slots per forward, so rows of a
    batch advance at different rates and finish at different steps."""
    model = build_tiny_model(tokenizer, arch="qwen2", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def test_accuracy_mode_in_batches_equals_one_at_a_time(confident, tokenizer):
    """Batched decoding (any batch size, rows joining as others finish) gives every example the
    output and counts it gets decoded alone; only the speed sample is timed."""
    tasks = [builtin_task("copying", 7, seed=4), builtin_task("counting", 5, seed=4)]
    kw = dict(taus=(0.5,), max_new_tokens=16, warmup=False)
    alone = evaluate(confident, tokenizer, EvalPlan(tasks, speed_examples=None, **kw))
    assert all(r.timed_examples == r.num_examples for r in alone.results)
    for batch_size in (1, 3, 8):
        batched = evaluate(confident, tokenizer, EvalPlan(tasks, speed_examples=2, batch_size=batch_size, **kw))
        assert _outputs(batched) == _outputs(alone)
        assert all(r.timed_examples == 2 and r.tokens_per_second for r in batched.results)
        assert [s.seconds is None for s in batched.samples if s.task == "copying" and s.method == "ar"] == \
            [False, False] + [True] * 5
    assert batched.settings["batch_size"] == 8 and batched.settings["speed_examples"] == 2


def test_a_restarted_evaluation_skips_the_decodes_kept_in_its_parts(confident, tokenizer, tmp_path, monkeypatch):
    tasks = [builtin_task("copying", 4, seed=1), builtin_task("counting", 3, seed=1)]
    decoded = []

    def counting_batch(model, prompts, settings, **kwargs):
        decoded.extend([settings.method] * len(prompts))
        return generate_batch(model, prompts, settings, **kwargs)

    monkeypatch.setattr(runner, "generate_batch", counting_batch)

    def run(**kw):
        report = evaluate(confident, tokenizer, EvalPlan(tasks, ["streaming", "ar"], taus=(0.5,), max_new_tokens=12,
                                                         speed_examples=0, parts_dir=str(tmp_path / "parts"),
                                                         model_name="tiny", **kw))
        report.settings.pop("time")
        return report

    whole = run(identity={"weights": 1})
    assert len(decoded) == 2 * 7
    part = tmp_path / "parts" / "rank0.jsonl"
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # killed while writing the sixth line
    decoded.clear()
    assert run(identity={"weights": 1}).to_dict() == whole.to_dict()
    assert len(decoded) == 2 * 7 - 5  # the five complete records were kept
    decoded.clear()
    assert run(identity={"weights": 2}).to_dict() == whole.to_dict()  # another checkpoint: its records are stale
    assert len(decoded) == 2 * 7


def test_evaluate_cli_refuses_a_device_map_without_gpus(model, tokenizer, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    spec = importlib.util.spec_from_file_location("wedlm_evaluate_cli", ROOT / "inference" / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit, match="--device-map spreads a model over GPUs"):
        cli.main(["--model", str(tmp_path), "--tasks", "counting", "--limit", "1", "--device-map", "auto",
                  "--out", str(tmp_path / "out")])
