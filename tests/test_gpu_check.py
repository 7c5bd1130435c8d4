"""tools/gpu_check.py in its tiny CPU mode: every step runs and reports real figures, and a step
that raises is recorded with its traceback while the others still run.

The script exists for a rarely lent GPU; these runs are what keeps it working between loans. Each
is one real subprocess (~10-20 s on 2 cores): a real Megatron world of one, real training steps,
real decoding of a tiny random model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["environment", "attention", "training", "decoding"]


def run_gpu_check(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The tiny CPU run into ``out``: (process, parsed gpu_check.json)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((out / "gpu_check.json").read_text())


def steps_by_name(report: dict) -> dict[str, dict]:
    return {step["name"]: step for step in report["steps"]}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu_check")
    return out, run_gpu_check(out)[1]


def test_every_step_runs_and_passes_on_cpu(tiny_run):
    out, report = tiny_run
    assert report["device"] == "cpu" and report["started"]
    assert [step["name"] for step in report["steps"]] == STEPS
    for step in report["steps"]:
        assert step["ok"], f"{step['name']} failed:\n{step['error']}"
        assert step["error"] is None and step["seconds"] > 0 and step["result"]
    table_rows = [line for line in (out / "gpu_check.md").read_text().splitlines()
                  if line.startswith("| ") and not line.startswith("| step ")]
    assert [row.split("|")[1].strip() for row in table_rows] == STEPS
    assert all(row.split("|")[2].strip() == "yes" for row in table_rows)


def test_environment_reports_versions_and_imports(tiny_run):
    env = steps_by_name(tiny_run[1])["environment"]["result"]
    assert env["device_name"] == "cpu"
    assert env["megatron_core_version"].split(".")[0].isdigit()
    assert env["packages"]["megatron.core"]["imports"] is True
    for name in ("transformer_engine", "flash_attn"):  # importable or not, said either way
        status = env["packages"][name]
        assert status["imports"] or status["error"]


def test_attention_flex_matches_dense_sdpa(tiny_run):
    attention = steps_by_name(tiny_run[1])["attention"]["result"]
    row = attention["L64"]
    assert row["slots"] == 128 and row["dtype"] == "float32"
    assert row["max_abs_diff"] < 1e-4
    assert 0 < row["allowed_pair_fraction"] <= row["computed_tile_fraction"] <= 1
    assert row["forward_backward"]["skipped"]  # no flex backward on CPU, and the report says so


def test_training_losses_and_rates(tiny_run):
    training = steps_by_name(tiny_run[1])["training"]["result"]
    assert training["smollm2_shape_te"]["skipped"]  # Transformer Engine needs CUDA
    assert training["qwen3_moe_slice_grouped_gemm"]["skipped"] and training["moe_grouped_gemm_vs_loop"]["skipped"]
    moe = training["qwen3_moe_slice_dense"]
    assert moe["experts"] == 8 and all(0.99 < aux < moe["experts"] / moe["topk"] for aux in moe["moe_aux_loss"])
    for name in ("smollm2_shape_dense", "qwen3_8b_slice_dense", "qwen3_moe_slice_dense"):
        run = training[name]
        assert len(run["losses"]) == run["steps"] == 3
        assert all(math.isfinite(loss) for loss in run["losses"])
        assert run["losses"][-1] < run["losses"][0]  # the same documents, three AdamW steps: it learns
        assert run["tokens_per_s"] > 0 and run["tflops_per_s"] > 0
        assert run["mfu"] is None  # no peak given on a CPU


def test_decoding_streaming_and_ar(tiny_run):
    decoding = steps_by_name(tiny_run[1])["decoding"]["result"]
    assert decoding["cuda_graph_window_forward"].startswith("not offered")
    for rows, new_tokens in ((1, 12), (4, 12)):
        runs = decoding[f"batch_{rows}"]
        assert runs["streaming"]["tokens"] == runs["ar"]["tokens"] == rows * new_tokens
        assert runs["streaming"]["tokens_per_forward"] >= 1
        assert runs["ar"]["tokens_per_forward"] == 1
        assert 0 <= runs["streaming"]["outside_forward_fraction"] < 1


def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path):
    _, report = run_gpu_check(tmp_path, "--model", "/nonexistent/smollm")
    steps = steps_by_name(report)
    assert list(steps) == STEPS
    assert all(steps[name]["ok"] for name in STEPS[:-1]), [steps[n]["error"] for n in STEPS[:-1]]
    decoding = steps["decoding"]
    assert decoding["ok"] is False and decoding["result"] is None
    assert "Traceback" in decoding["error"] and "/nonexistent/smollm" in decoding["error"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| decoding | **FAILED** |" in table and "/nonexistent/smollm" in table
