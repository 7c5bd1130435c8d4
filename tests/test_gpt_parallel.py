"""A standard Megatron-Core GPT computes the same loss and gradients under TP x PP.

One four-rank layout runs both the tensor- and the pipeline-parallel paths; the two-rank TP and PP
layouts are checked on the WeDLM model (tests/test_wedlm_parallel.py).

Tolerance: fp32 throughout. Tensor parallelism changes the order of the reductions in the
row-parallel matmuls and in the vocab-parallel cross entropy, so results agree to rounding
(observed ~2e-8 on gradients of magnitude ~1e-2); 1e-5 absolute leaves room for other BLAS
builds while still catching any real layout or communication error, which shows up at 1e-2.
"""

import pytest
import torch

from megatron_wedlm.testing import gpt_equivalence as ge
from megatron_wedlm.runtime.multiprocess import run_distributed

LAYOUTS = [(2, 2)]
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    spec = ge.spec_to_dict(ge.TinyGPTSpec())
    root = tmp_path_factory.mktemp("gpt-equivalence")
    ref = run_distributed(ge.save_reference, 1, spec, str(root / "weights"), timeout_s=180)[0]
    return spec, root, ref


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_layout_matches_single_process(reference, tp, pp):
    spec, root, ref = reference
    grads_dir = root / f"grads-tp{tp}-pp{pp}"
    results = run_distributed(
        ge.run_layout, tp * pp, spec, str(root / "weights"), str(grads_dir), tp, pp, timeout_s=300
    )
    last_stage_losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(last_stage_losses) == tp  # every TP rank of the last stage reports the loss
    for loss in last_stage_losses:
        assert loss == pytest.approx(ref["loss"], abs=ATOL)

    gathered = run_distributed(ge.gather_checkpoint, 1, spec, str(grads_dir), timeout_s=180)[0]
    assert gathered.keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert grad.abs().max() > 0, f"{name} got no gradient in the reference"
        torch.testing.assert_close(gathered[name], grad, atol=ATOL, rtol=0, msg=name)
