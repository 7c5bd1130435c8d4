"""inference/evaluate.py spread over processes by torchrun: the same report as one process, and a failing rank ends the run."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_wedlm.eval import EvalReport
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"seconds", "tokens_per_second", "speedup_vs_ar"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A sharpened tiny model on disk: parallel methods fill several slots per forward, so rows of a
    batch finish at different steps."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch="qwen2", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _evaluate(checkpoint: Path, out: Path, nproc: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(ROOT / "inference" / "evaluate.py"), "--model", str(checkpoint),
           "--tasks", "counting,copying", "--methods", "streaming,ar", "--taus", "0.5", "--num-examples", "5",
           "--max-new-tokens", "12", "--speed-examples", "2", "--batch-size", "2", "--device", "cpu",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _without_timings(report: EvalReport) -> dict:
    d = copy.deepcopy(report.to_dict())
    for section in ("results", "samples"):
        d[section] = [{k: v for k, v in row.items() if k not in TIMING} for row in d[section]]
    for key in ("time", "processes"):
        d["settings"].pop(key)
    return d


def test_two_processes_write_the_report_of_one(checkpoint, tmp_path):
    one, two = _evaluate(checkpoint, tmp_path / "one", 1), _evaluate(checkpoint, tmp_path / "two", 2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    single, split = EvalReport.load(str(tmp_path / "one" / "report.json")), EvalReport.load(
        str(tmp_path / "two" / "report.json"))
    assert _without_timings(split) == _without_timings(single)
    assert split.settings["processes"] == 2 and len(split.samples) == 2 * 5 * 2
    assert all(r.timed_examples == 2 and r.tokens_per_second for r in split.results)
    # each rank kept its own examples as they finished: rank r has examples r, r + 2, ...
    for rank, count in ((0, 3), (1, 2)):
        lines = (tmp_path / "two" / "parts" / f"rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == 2 * 2 * count  # tasks x methods x its examples
    assert (tmp_path / "two" / "report.md").read_text().count("| streaming |") == 2


def test_a_failing_rank_ends_the_run_with_its_error(checkpoint, tmp_path):
    """Rank 1 cannot open its parts file; rank 0 is not left waiting for it, and the launcher
    reports rank 1's own error."""
    (tmp_path / "out" / "parts" / "rank1.jsonl").mkdir(parents=True)
    start = time.monotonic()
    run = _evaluate(checkpoint, tmp_path / "out", 2)
    assert run.returncode != 0
    assert time.monotonic() - start < 240
    output = run.stdout + run.stderr
    assert "IsADirectoryError" in output and "rank1.jsonl" in output
    assert "rank      : 1" in output or "rank: 1" in output
    assert not (tmp_path / "out" / "report.json").exists()
