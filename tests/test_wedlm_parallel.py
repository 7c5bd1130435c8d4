"""The WeDLM model trains (and evaluates, forward only) identically under TP, PP, interleaved PP, CP, their
products, SP, recompute and DP + distributed optimizer; a MoE model under EP alone and with TP (SP,
expert TP 1 and 2), PP and CP, its router losses included.

Real gloo processes on CPU, Megatron's pipeline schedule, DDP and finalize_model_grads, the
same weights and the same dual-stream global batch (packed documents, SFT prompt, padding).
The spec switches on GQA, QK-norm, QKV bias; a second spec ties the embeddings.

Tolerance: fp32; TP changes reduction order in row-parallel matmuls and the vocab-parallel
cross entropy, so results agree to rounding (~1e-7 on gradients of magnitude ~1e-1). 1e-5
catches any real layout error (a missing TP reduction of norm gradients moves them by ~1e-2).

Context parallelism (CP) splits every row over the ranks by the mask-balanced split and
gathers keys/values in attention; the interleaved schedule (VPP) runs two model chunks per
stage, each reading the micro-batch's mask metadata; both must match one process as closely.

Launches (to stay fast on two cores): one reference rank; one 2-rank launch running several
layouts and the distributed-optimizer run; one 4-rank launch for TP x CP and PP x CP; and
``tools/verify_parallel.py`` as a subprocess for the 4-rank TP x PP (which also tests the tool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.testing import wedlm_equivalence as we
from megatron_wedlm.runtime.multiprocess import run_distributed

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5
OPTIMIZER_STEPS = 4

SPECS = {
    "main": we.TinyWeDLMSpec().to_dict(),
    "tied": we.TinyWeDLMSpec(tied_embeddings=True, qk_layernorm=False, add_qkv_bias=False).to_dict(),
    # 4 micro-batches: the interleaved schedule's steady state (1F1B across chunks) is reached
    "microbatches4": we.TinyWeDLMSpec(global_microbatches=4).to_dict(),
    # a Qwen3-MoE (8 experts, top-2): the balancing loss in every layout, the z-loss where Megatron
    # computes it exactly (EP, PP; under SP/CP it averages per shard, uneven with padding)
    "moe": we.TinyWeDLMSpec(num_experts=8).to_dict(),
    "moe-z": we.TinyWeDLMSpec(num_experts=8, moe_z_loss_coeff=1e-3).to_dict(),
}
LAYOUTS = [
    {"name": "tp2", "spec": "main", "tp": 2},
    {"name": "pp2", "spec": "main", "pp": 2},
    {"name": "tp2-sp", "spec": "main", "tp": 2, "sp": True},
    {"name": "tp2-sp-recompute-full", "spec": "main", "tp": 2, "sp": True, "recompute": "full"},
    {"name": "tp2-recompute-selective", "spec": "main", "tp": 2, "recompute": "selective"},
    {"name": "pp2-tied", "spec": "tied", "pp": 2},
    {"name": "cp2", "spec": "main", "cp": 2},
    {"name": "cp2-recompute-selective", "spec": "main", "cp": 2, "recompute": "selective"},
    {"name": "pp2-vpp2", "spec": "microbatches4", "pp": 2, "vpp": 2},
    {"name": "pp2-vpp2-tied", "spec": "tied", "pp": 2, "vpp": 2},
    {"name": "moe-ep2", "spec": "moe-z", "ep": 2},
    {"name": "moe-ep2-tp2-sp", "spec": "moe", "ep": 2, "tp": 2, "sp": True, "etp": 1},
    {"name": "moe-ep2-cp2", "spec": "moe", "ep": 2, "cp": 2},
]

# the 4-rank layouts checked in one launch (TP x PP runs through tools/verify_parallel.py below)
FOUR_RANK_LAYOUTS = [
    {"name": "tp2-cp2", "spec": "main", "tp": 2, "cp": 2},
    {"name": "pp2-cp2", "spec": "main", "pp": 2, "cp": 2},
    {"name": "moe-ep2-pp2", "spec": "moe-z", "ep": 2, "pp": 2},
    {"name": "moe-ep2-tp2-sp-etp2", "spec": "moe", "ep": 2, "tp": 2, "sp": True},  # experts split over TP too
]


def reference_launch(root: str) -> dict:
    out = we.reference_worker(SPECS, root)
    weights = os.path.join(root, "main", "weights")
    out["optimizer"] = we.optimizer_worker(SPECS["main"], weights, False, OPTIMIZER_STEPS)
    return out


def layouts_launch(root: str) -> dict:
    out = we.layouts_worker(SPECS, root, LAYOUTS)
    weights = os.path.join(root, "main", "weights")
    out["optimizer"] = we.optimizer_worker(SPECS["main"], weights, True, OPTIMIZER_STEPS)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """The reference's weights (``<spec>/weights``), which every layout launch loads."""
    return str(tmp_path_factory.mktemp("wedlm-parallel"))


@pytest.fixture(scope="module")
def runs(root):
    reference = run_distributed(reference_launch, 1, root, timeout_s=300)[0]
    layouts = run_distributed(layouts_launch, 2, root, timeout_s=600)
    return reference, layouts


@pytest.fixture(scope="module")
def four_ranks(runs, root):
    """The 4-rank layouts, from the reference's weights (so after ``runs``)."""
    return run_distributed(we.layouts_worker, 4, SPECS, root, FOUR_RANK_LAYOUTS, timeout_s=600)


def _assert_layout_matches(reference: dict, ranks: list[dict], layout: dict) -> None:
    ref = reference[layout["spec"]]
    for part in ("summary", "eval"):  # the training step; the forward-only evaluation of another batch
        summaries = [r[layout["name"]][part] for r in ranks if r[layout["name"]][part] is not None]
        # every TP and CP rank of the last stage reports
        assert len(summaries) == len(ranks) // layout.get("pp", 1)
        for summary in summaries:
            router = sorted(k for k in ref[part] if k.startswith("moe_"))  # moe_aux_loss, moe_z_loss
            for key in ("total", "mlm", "ar", *router):
                assert summary[key] == pytest.approx(ref[part][key], abs=ATOL), (part, key)
            for key in ("mlm_tokens", "ar_tokens"):
                assert summary[key] == ref[part][key]
    assert ref["eval"]["total"] != ref["summary"]["total"]  # another batch indeed
    assert all(r[layout["name"]]["eval_kept_grads"] for r in ranks)  # evaluating left the step's gradients
    grads = ranks[0][layout["name"]]["grads"]
    assert grads.keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert grad.abs().max() > 0, f"{name} got no gradient in the reference"
        torch.testing.assert_close(grads[name], grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout["name"] for layout in LAYOUTS])
def test_layout_matches_single_process(runs, layout):
    _assert_layout_matches(runs[0], runs[1], layout)


@pytest.mark.parametrize("layout", FOUR_RANK_LAYOUTS, ids=[layout["name"] for layout in FOUR_RANK_LAYOUTS])
def test_four_rank_layout_matches_single_process(runs, four_ranks, layout):
    _assert_layout_matches(runs[0], four_ranks, layout)


def test_reference_loss_has_both_parts(runs):
    summary = runs[0]["main"]["summary"]
    assert summary["mlm_tokens"] > 0 and summary["ar_tokens"] > 0
    assert summary["total"] == pytest.approx((summary["mlm"] + summary["ar"]) / 2, rel=1e-9)


def test_distributed_optimizer_on_two_ranks_matches_single_process_optimizer(runs):
    single = runs[0]["optimizer"]
    distributed = [r["optimizer"] for r in runs[1]]
    assert distributed[0] == distributed[1]  # both data-parallel ranks saw the global loss
    for step, (a, b) in enumerate(zip(single, distributed[0])):
        for key in ("total", "mlm", "ar", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (step, key)
    # steps alternate between two global batches: each is learned
    assert single[2]["total"] < single[0]["total"] and single[3]["total"] < single[1]["total"]


@pytest.mark.parametrize("tp,pp,cp", [(2, 2, 1)], ids=["tp2-pp2"])
def test_verify_parallel_tool_four_rank_layouts(tp, pp, cp):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "verify_parallel.py"), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    layout = report["layout"]
    assert (layout["tp"], layout["pp"], layout["cp"], report["world_size"]) == (tp, pp, cp, 4)
    assert max(report["max_loss_abs_diff"].values()) <= ATOL
    assert max(report["max_eval_loss_abs_diff"].values()) <= ATOL  # the forward-only evaluation too
    assert report["max_grad_abs_diff"] <= ATOL
    assert report["max_grad_abs"] > 1e-3  # the comparison is over real, non-zero gradients
