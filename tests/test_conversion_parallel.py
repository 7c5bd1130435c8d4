"""Converted checkpoints under tensor and pipeline parallelism (real gloo processes).

* A checkpoint written at TP=1 loads at TP=2 and at PP=2, into Megatron's GPT and into the WeDLM
  model, and the logits (vocab-parallel shards gathered, last pipeline stage) equal the HF
  model's: causal input for the GPT, a packed dual-stream batch for WeDLM (HF run with the
  batch's logical position ids and the WeDLM mask as a 4-D float mask).
* A checkpoint *written* at TP=2 x PP=2 (``--tp 2 --pp 2``: four writer processes, each
  filling only its shard) exports back to the original HF tensors bit for bit.
* Qwen3-MoE, in one launch of four ranks: written at EP2, TP2, EP2xTP2 and PP2xEP2 (the
  converter's rank function; ranks beyond the layout are data-parallel replicas), each export
  equals the original; the one-process conversion loaded at each layout gives HF's logits.

Tolerance as in test_conversion.py (fp32, 1e-5; TP changes reduction order only).
"""

from __future__ import annotations

import pytest
import torch

from megatron_wedlm.conversion import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_wedlm.runtime.multiprocess import run_distributed

from test_conversion import (
    CASES,
    CASE_IDS,
    build_megatron_model,
    causal_input,
    hf_wedlm_logits,
    make_hf_dir,
    make_moe_hf_dir,
    safetensors_of,
    wedlm_rows,
)

ATOL = 1e-5
LAYOUTS = [(2, 1), (1, 2)]
PARALLEL_CASES = ("qwen2-untied", "qwen3-tied", "llama-untied")  # every family once, tied and untied both


def _pipeline_forward(model, inputs: dict) -> torch.Tensor | None:
    """Megatron's forward-only schedule over one micro-batch; full logits on the last stage."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_wedlm.training.megatron_engine import run_schedule

    def step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["input_ids"], batch["position_ids"], None, **batch["extra"]), None

    batch_size, seq = inputs["input_ids"].shape
    with torch.no_grad():
        outputs = run_schedule([model], step, [inputs], seq, batch_size, forward_only=True)
        if outputs is None:  # not the last pipeline stage
            return None
        return gather_from_tensor_model_parallel_region(outputs[0])


def layouts_worker(cases: dict[str, dict], layouts: list[tuple[int, int]]) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_wedlm.conversion import load_megatron_weights, megatron_process_group
    from megatron_wedlm.data import AttentionMetadata
    from megatron_wedlm.model.hf_config import ModelArgs
    from megatron_wedlm.runtime.parallel import init_distributed

    init_distributed(torch.device("cpu"))  # one world for all layouts; Megatron's groups change
    results = {}
    for tp, pp in layouts:
        with megatron_process_group(tp, pp):
            for name, case in cases.items():
                args = ModelArgs.from_dict(case["args"])
                for kind in ("gpt", "wedlm"):
                    model = build_megatron_model(kind, args).eval()
                    load_megatron_weights(model, case["ckpt"])
                    extra = {}
                    if kind == "gpt":
                        ids = case["causal_ids"]
                        positions = torch.arange(ids.shape[1]).expand_as(ids)
                    else:
                        ids, positions = case["rows"]["input_ids"], case["rows"]["position_ids"]
                        extra["attention_metadata"] = AttentionMetadata(**case["rows"]["metadata"])
                    logits = _pipeline_forward(
                        model, {"input_ids": ids, "position_ids": positions, "extra": extra}
                    )
                    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                        results[(tp, pp, name, kind)] = logits[..., : args.vocab_size].clone()
    return results


@pytest.fixture(scope="module")
def parallel_logits(tmp_path_factory):
    cases, references = {}, {}
    for (arch, tied), case_id in zip(CASES, CASE_IDS):
        if case_id not in PARALLEL_CASES:
            continue
        root = tmp_path_factory.mktemp(case_id)
        model, _ = make_hf_dir(root / "hf", arch, tied)
        args = convert_hf_to_megatron(root / "hf", root / "megatron")
        ids = causal_input(args.vocab_size)
        rows = wedlm_rows(args.mask_token_id, args.vocab_size)
        with torch.no_grad():
            references[case_id] = {"gpt": model(ids).logits, "wedlm": hf_wedlm_logits(model, rows), "rows": rows}
        cases[case_id] = {
            "args": args.to_dict(), "ckpt": str(root / "megatron"), "causal_ids": ids,
            "rows": {"input_ids": rows.input_ids, "position_ids": rows.position_ids,
                     "metadata": rows.attention_metadata().as_dict()},
        }
    merged = {}
    for rank_result in run_distributed(layouts_worker, 2, cases, LAYOUTS, timeout_s=300):
        merged.update(rank_result)
    return merged, references


CHECKED = [(tp, pp, case_id, kind) for tp, pp in LAYOUTS for case_id in PARALLEL_CASES for kind in ("gpt", "wedlm")]


@pytest.mark.parametrize("tp,pp,case_id,kind", CHECKED, ids=[f"tp{t}-pp{p}-{c}-{k}" for t, p, c, k in CHECKED])
def test_logits_under_parallel_layouts_equal_hf(parallel_logits, tp, pp, case_id, kind):
    got, references = parallel_logits
    reference = references[case_id][kind]
    logits = got[(tp, pp, case_id, kind)]
    if kind == "wedlm":
        real = ~references[case_id]["rows"].is_padding  # padding slots compute nothing meaningful
        logits, reference = logits[real], reference[real]
    assert reference.abs().max() > 1.0
    assert (logits - reference).abs().max().item() < ATOL


def test_checkpoint_written_at_tp2_pp2_exports_the_original_tensors(tmp_path):
    """Tied embeddings: the last stage's output layer is filled from the embedding but not saved."""
    make_hf_dir(tmp_path / "hf", "qwen2", tied=True, seed=3)
    args = convert_hf_to_megatron(
        tmp_path / "hf", tmp_path / "megatron", tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    assert args.padded_vocab_size == 512  # 400 padded to a multiple of 128 x TP
    convert_megatron_to_hf(tmp_path / "megatron", tmp_path / "export")
    original, exported = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "export")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


# --------------------------------------------------------------------------------------------
# Qwen3-MoE under expert, tensor and pipeline parallelism (one launch of four ranks)
# --------------------------------------------------------------------------------------------

MOE_LAYOUTS = [(1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2)]  # (TP, PP, EP)
MOE_IDS = [f"tp{t}-pp{p}-ep{e}" for t, p, e in MOE_LAYOUTS]


def moe_layouts_worker(args_dict: dict, hf_dir: str, reference: str, out_root: str, ids: torch.Tensor) -> dict:
    """Per layout: write the HF model with the converter's rank function, then load the
    one-process checkpoint (a different layout) into the WeDLM model and Megatron's GPT and run
    a causal row (eval mode: MoE under TP needs SP only when training)."""
    from megatron.core import parallel_state as ps

    from megatron_wedlm.conversion import load_megatron_weights, megatron_process_group
    from megatron_wedlm.conversion.hf_to_megatron import write_rank
    from megatron_wedlm.model.hf_config import ModelArgs
    from megatron_wedlm.runtime.parallel import init_distributed

    init_distributed(torch.device("cpu"))
    args = ModelArgs.from_dict(args_dict)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    results = {}
    for (tp, pp, ep), layout_id in zip(MOE_LAYOUTS, MOE_IDS):
        write_rank(args_dict, hf_dir, f"{out_root}/{layout_id}", tp, pp, ep)
        with megatron_process_group(tp, pp, ep):
            for kind in ("gpt", "wedlm"):
                model = build_megatron_model(kind, args).eval()
                load_megatron_weights(model, reference)
                logits = _pipeline_forward(model, {"input_ids": ids, "position_ids": positions, "extra": {}})
                if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                    results[(layout_id, kind)] = logits[..., : args.vocab_size].clone()
    return results


@pytest.fixture(scope="module")
def moe_layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model, _ = make_moe_hf_dir(root / "hf")
    args = convert_hf_to_megatron(root / "hf", root / "megatron")
    ids = causal_input(args.vocab_size)
    with torch.no_grad():
        reference = model(ids).logits
    logits = {}
    for rank_result in run_distributed(moe_layouts_worker, 4, args.to_dict(), str(root / "hf"),
                                       str(root / "megatron"), str(root / "written"), ids, timeout_s=300):
        logits.update(rank_result)
    return root, reference, logits


@pytest.mark.parametrize("layout_id", MOE_IDS)
def test_moe_checkpoint_written_under_a_parallel_layout_exports_the_original_tensors(moe_layouts, layout_id):
    """Each rank fills only its experts (global index = EP rank x experts per rank + local index)
    and its expert-TP rows; torch_dist stores them by global expert."""
    root, _, _ = moe_layouts
    convert_megatron_to_hf(root / "written" / layout_id, root / f"export-{layout_id}", model_args=root / "megatron")
    original, exported = safetensors_of(root / "hf"), safetensors_of(root / f"export-{layout_id}")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", ["gpt", "wedlm"])
@pytest.mark.parametrize("layout_id", MOE_IDS)
def test_moe_logits_under_parallel_layouts_equal_hf(moe_layouts, layout_id, kind):
    _, reference, logits = moe_layouts
    assert reference.abs().max() > 1.0
    assert (logits[(layout_id, kind)] - reference).abs().max().item() < ATOL
