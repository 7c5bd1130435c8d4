"""The WeDLM Megatron model on one rank: the AR path, the attention rule end to end, backends, losses.

One spawned process (Megatron needs its parallel state) runs every check and returns raw
numbers; the tests below assert on them. fp32 throughout; 1e-5 absolute on logits of
magnitude ~1 allows kernel rounding (SDPA vs Megatron's baddbmm softmax, different row
lengths) and catches any mask or position error, which moves logits by >1e-2.
"""

from __future__ import annotations

import pytest
import torch

from megatron_wedlm.testing import gpt_equivalence as ge
from megatron_wedlm.testing import wedlm_equivalence as we
from megatron_wedlm.runtime.multiprocess import run_distributed

ATOL = 1e-5


def _spec() -> we.TinyWeDLMSpec:
    # 48-slot rows in tiles of 8: the dense backend skips empty key tiles; the brute-force
    # sequences (other lengths) take the untiled path, so the two paths check each other.
    return we.TinyWeDLMSpec(num_layers=2, row_length=48, dense_tile_size=8)


def _causal_logits(model, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Plain causal forward of one sequence with explicit positions -> logits [n, V]."""
    return model(tokens.unsqueeze(0), positions.unsqueeze(0))[0]


def _permute_within_blocks(batch, generator):
    """Shuffle the prediction-stream slots of every block (any order obeys the rule)."""
    from megatron_wedlm.data import DualStreamBatch

    order = torch.arange(batch.seq_len)
    pred = (~batch.is_memory) & (batch.doc_ids >= 0)
    keys = batch.doc_ids * 10_000 + batch.block_ids
    for key in keys[pred].unique():
        slots = torch.nonzero(pred & (keys == key)).flatten()
        order[slots] = slots[torch.randperm(len(slots), generator=generator)]
    fields = {name: getattr(batch, name)[order] for name in DualStreamBatch.tensor_field_names()}
    return DualStreamBatch(**fields, block_size=batch.block_size, mask_token_id=batch.mask_token_id,
                           pad_token_id=batch.pad_token_id)


def _brute_force_row_logits(model, row) -> torch.Tensor:
    """Logits of every real slot of a dual-stream row by the rule's meaning, one causal pass each.

    Memory slot at position p: causal LM over the document. Prediction slot in block b: causal
    LM over [document tokens of blocks < b ; block b's slots in physical order], positions kept.
    """
    out = torch.full((row.seq_len, model.vocab_size), float("nan"))
    for doc in row.doc_ids[row.doc_ids >= 0].unique():
        mem = torch.nonzero((row.doc_ids == doc) & row.is_memory).flatten()
        out[mem] = _causal_logits(model, row.input_ids[mem], row.position_ids[mem])
        pred_doc = (row.doc_ids == doc) & ~row.is_memory
        for block in row.block_ids[pred_doc].unique():
            slots = torch.nonzero(pred_doc & (row.block_ids == block)).flatten()
            prefix = mem[row.position_ids[mem] < block * row.block_size]
            seq = torch.cat([prefix, slots])
            logits = _causal_logits(model, row.input_ids[seq], row.position_ids[seq])
            out[slots] = logits[len(prefix):]
    return out


def model_packed(rows):
    from megatron_wedlm.data import pack_attention_metadata

    return pack_attention_metadata(rows.attention_metadata())


def model_checks(spec_dict: dict) -> dict:
    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches
    from megatron_wedlm.model import wedlm_labels, wedlm_loss

    spec = we.TinyWeDLMSpec(**spec_dict)
    we.init_layout(1, 1, spec.seed)
    (model,) = we.build_model(spec)
    model.eval()
    results: dict = {}

    # 1. Same module tree as Megatron's local GPT spec: conversions map 1:1.
    gpt = ge.build_gpt(spec.model_args(), spec.build_settings()).eval()
    results["wedlm_params"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    results["gpt_params"] = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
    gpt.load_state_dict(model.state_dict(), strict=True)

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        # 2. Memory stream only: WeDLM == standard causal GPT (positions 0..S-1, causal mask).
        tokens = torch.randint(0, spec.mask_token_id, (2, spec.row_length), generator=g)
        positions = torch.arange(spec.row_length).expand(2, -1)
        results["ar_wedlm"] = model(tokens, positions)
        results["ar_gpt"] = gpt(tokens, positions, attention_mask=None)

        # 3. Full dual-stream rows: memory slots still equal the standard GPT on the document.
        doc = torch.randint(0, spec.mask_token_id, (spec.row_length // 2,), generator=g)
        row = build_dual_stream_batch([doc], RowFormat(spec.block_size, spec.mask_token_id), g)
        dual = model(row.input_ids[None], row.position_ids[None], row.attention_metadata())[0]
        results["dual_memory"] = dual[row.is_memory]
        results["gpt_on_doc"] = gpt(doc[None], torch.arange(len(doc))[None], attention_mask=None)[0]

        # 4. Every slot of packed rows (two documents, an SFT prompt, padding), in the canonical
        #    order and with slots shuffled inside each block, equals the rule's brute force.
        docs = [torch.randint(0, spec.mask_token_id, (n,), generator=g) for n in (11, 9)]
        canonical = build_dual_stream_batch(docs, RowFormat(spec.block_size, spec.mask_token_id), g,
                                            prompt_lengths=[2, 0], pad_to=spec.row_length)
        results["rule"] = []
        for row in (canonical, _permute_within_blocks(canonical, g), _permute_within_blocks(canonical, g)):
            got = model(row.input_ids[None], row.position_ids[None], attention_metadata=row.attention_metadata())[0]
            real = row.doc_ids >= 0
            # sort real slots by their logical identity (doc, stream, position) to compare orders
            identity = row.doc_ids * 100_000 + row.is_memory.long() * 10_000 + row.position_ids
            by_identity = torch.argsort(torch.where(real, identity, identity.max() + 1))[: int(real.sum())]
            memory = row.is_memory[by_identity]
            results["rule"].append((got[by_identity], _brute_force_row_logits(model, row)[by_identity], memory))
        # Sensitivity: a prediction slot given the *whole* document as prefix predicts differently.
        row = canonical
        got_canonical = model(row.input_ids[None], row.position_ids[None], attention_metadata=row.attention_metadata())[0]
        slot = int(torch.nonzero(~row.is_memory & (row.block_ids == 1) & (row.doc_ids == 0))[0])
        mem0 = torch.nonzero(row.is_memory & (row.doc_ids == 0)).flatten()
        leaky = _causal_logits(model, torch.cat([row.input_ids[mem0], row.input_ids[slot:slot + 1]]),
                               torch.cat([row.position_ids[mem0], row.position_ids[slot:slot + 1]]))[-1]
        results["leaky_vs_rule"] = (leaky - got_canonical[slot]).abs().max().item()

        # 5. FlexAttention backend (eager on CPU) == dense backend on the same weights.
        flex_spec = we.TinyWeDLMSpec(**{**spec_dict, "attention_backend": "flex"})
        flex = we.build_model(flex_spec)[0].eval()
        flex.load_state_dict(model.state_dict())
        for layer in flex.decoder.layers:
            layer.self_attention.core_attention.tile_size = 16
        rows = stack_dual_stream_batches([canonical, _permute_within_blocks(canonical, g)])
        meta = rows.attention_metadata()
        results["flex"] = flex(rows.input_ids, rows.position_ids, attention_metadata=meta)
        results["dense"] = model(rows.input_ids, rows.position_ids, attention_metadata=meta)

        # 5b. Dense backend with empty-tile skipping == one SDPA call over the full mask.
        untiled = we.build_model(we.TinyWeDLMSpec(**{**spec_dict, "dense_tile_size": 0}))[0].eval()
        untiled.load_state_dict(model.state_dict())
        results["untiled"] = untiled(rows.input_ids, rows.position_ids, attention_metadata=meta)
        from megatron_wedlm.model.attention import _dense_mask_and_plan, layer_mask

        query = torch.zeros(rows.seq_len, 2, 1, 1)
        _, plan = _dense_mask_and_plan(layer_mask(model_packed(rows), query), query, spec.dense_tile_size)
        results["plan_keys"] = [t.allowed.shape[-1] for t in plan]

        # 6. Loss vs a brute-force computation from full logits with torch's cross entropy.
        labels = wedlm_labels(rows.is_masked, rows.target_ids, rows.ar_labels)
        ce = model(rows.input_ids, rows.position_ids, attention_metadata=meta, labels=labels)
        results["losses"] = {}
        for weighting in ("inverse_ratio", "uniform"):
            for ar_weight in (1.0, 0.5, 0.0):
                loss = wedlm_loss(ce, rows.is_masked, rows.mlm_weights, rows.ar_labels,
                                  ar_weight=ar_weight, mlm_weighting=weighting)
                results["losses"][(weighting, ar_weight)] = {
                    k: float(getattr(loss, k)) for k in ("total", "mlm", "ar", "mlm_tokens", "ar_tokens")
                }
        results["loss_inputs"] = {
            "logits": results["dense"], "target_ids": rows.target_ids, "is_masked": rows.is_masked,
            "mlm_weights": rows.mlm_weights, "ar_labels": rows.ar_labels, "mask_ratio": rows.mask_ratio,
        }

    # 7. Pruned rows: the same documents and draws without the prediction blocks that hold no mask
    #    (long SFT prompts, random block offsets) give the same loss and the same gradients.
    docs = [torch.randint(0, spec.mask_token_id, (n,), generator=g) for n in (14, 9)]
    results["prune"] = []
    for prune in (False, True):
        row_format = RowFormat(spec.block_size, spec.mask_token_id, random_block_offset=True,
                               prune_unmasked_blocks=prune)
        row = build_dual_stream_batch(docs, row_format, torch.Generator().manual_seed(5), prompt_lengths=[10, 6],
                                      pad_to=spec.row_length)
        model.zero_grad()
        ce = model(row.input_ids[None], row.position_ids[None], attention_metadata=row.attention_metadata(),
                   labels=wedlm_labels(row.is_masked, row.target_ids, row.ar_labels)[None])
        loss = wedlm_loss(ce, row.is_masked[None], row.mlm_weights[None], row.ar_labels[None], ar_weight=0.5)
        loss.total.backward()
        results["prune"].append({"total": float(loss.total), "real_slots": int((row.doc_ids >= 0).sum()),
                                 "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})

    # 8. Logits at the labelled slots only (the default) == stock GPTModel's logits at every slot:
    #    per-slot loss and gradients, under a random weighting of the slots; and a micro-batch
    #    with no labelled slot at all still runs forward and backward.
    labels = wedlm_labels(rows.is_masked, rows.target_ids, rows.ar_labels)
    weights = torch.rand(labels.shape, generator=g)
    results["slot_logits"] = {}
    for name, all_slots, row_labels in (("all", True, labels), ("labelled", False, labels),
                                        ("none", False, torch.full_like(labels, -100))):
        model.all_slot_logits = all_slots
        model.zero_grad()
        ce = model(rows.input_ids, rows.position_ids, attention_metadata=meta, labels=row_labels)
        (ce * weights).sum().backward()
        results["slot_logits"][name] = {
            "ce": ce.detach(), "labelled": int((row_labels >= 0).sum()), "slots": row_labels.numel(),
            "grads": {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()},
        }
    model.all_slot_logits = False
    return results


@pytest.fixture(scope="module")
def checks():
    return run_distributed(model_checks, 1, _spec().to_dict(), timeout_s=300)[0]


def test_parameter_names_match_megatron_local_gpt_spec(checks):
    assert checks["wedlm_params"] == checks["gpt_params"]
    names = checks["wedlm_params"]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names  # Qwen3 QK-norm
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names  # Qwen2 QKV bias
    q, kv, head = 4, 2, 16
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"] == ((q + 2 * kv) * head, 64)  # GQA


def test_memory_stream_only_equals_standard_causal_gpt(checks):
    torch.testing.assert_close(checks["ar_wedlm"], checks["ar_gpt"], atol=ATOL, rtol=0)


def test_memory_stream_of_a_dual_stream_row_ignores_the_prediction_stream(checks):
    torch.testing.assert_close(checks["dual_memory"], checks["gpt_on_doc"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("order", [0, 1, 2], ids=["canonical", "shuffled-a", "shuffled-b"])
def test_every_slot_follows_the_attention_rule(checks, order):
    got, brute, _ = checks["rule"][order]
    assert not torch.isnan(brute).any()
    torch.testing.assert_close(got, brute, atol=ATOL, rtol=0)


def test_rule_check_is_sensitive_to_leaking_later_memory(checks):
    assert checks["leaky_vs_rule"] > 1e-3


def test_shuffling_a_block_changes_only_its_prediction_slots(checks):
    # Slots compared by logical identity (document, stream, position) across orderings.
    (a, _, memory), (b, _, memory_b) = checks["rule"][0], checks["rule"][1]
    assert torch.equal(memory, memory_b)
    torch.testing.assert_close(a[memory], b[memory], atol=ATOL, rtol=0)  # memory stream untouched
    # a prediction slot sees a different causal prefix once its block is shuffled
    assert (a[~memory] - b[~memory]).abs().amax(-1).max() > 1e-3


def test_flex_backend_matches_dense_backend(checks):
    torch.testing.assert_close(checks["flex"], checks["dense"], atol=ATOL, rtol=0)


def test_dense_tile_skipping_matches_full_mask_sdpa(checks):
    torch.testing.assert_close(checks["dense"], checks["untiled"], atol=ATOL, rtol=0)
    keys = checks["plan_keys"]
    assert len(keys) == 48 // 8 and min(keys) < 48 // 2  # tiles really skip keys


@pytest.mark.parametrize("weighting", ["inverse_ratio", "uniform"])
@pytest.mark.parametrize("ar_weight", [1.0, 0.5, 0.0])
def test_loss_matches_brute_force(checks, weighting, ar_weight):
    inp = checks["loss_inputs"]
    logits = inp["logits"].double()
    masked = inp["is_masked"]
    mlm_ce = torch.nn.functional.cross_entropy(logits[masked], inp["target_ids"][masked], reduction="none")
    gamma = inp["mask_ratio"][masked].double()
    w = 1.0 / gamma if weighting == "inverse_ratio" else torch.ones_like(gamma)
    mlm = float((w * mlm_ce).sum() / w.sum())
    has_ar = inp["ar_labels"] >= 0
    ar = float(torch.nn.functional.cross_entropy(logits[has_ar], inp["ar_labels"][has_ar]))
    got = checks["losses"][(weighting, ar_weight)]
    assert got["mlm"] == pytest.approx(mlm, rel=1e-5)
    assert got["ar"] == pytest.approx(ar, rel=1e-5)
    assert got["total"] == pytest.approx((mlm + ar_weight * ar) / (1 + ar_weight), rel=1e-5)
    assert got["mlm_tokens"] == int(masked.sum()) and got["ar_tokens"] == int(has_ar.sum())


def test_pruned_rows_give_the_same_loss_and_gradients(checks):
    full, pruned = checks["prune"]
    assert pruned["real_slots"] < full["real_slots"]  # the prompts' prediction blocks are gone
    assert pruned["total"] == pytest.approx(full["total"], rel=1e-5)
    for name, grad in full["grads"].items():
        assert torch.allclose(pruned["grads"][name], grad, atol=ATOL, rtol=1e-4), name


def test_logits_at_labelled_slots_only_give_stock_gpt_loss_and_gradients(checks):
    runs = checks["slot_logits"]
    full, labelled = runs["all"], runs["labelled"]
    assert 0 < labelled["labelled"] < labelled["slots"]  # some slots really are skipped
    torch.testing.assert_close(labelled["ce"], full["ce"], atol=ATOL, rtol=0)
    assert (full["ce"] > 0).sum() == labelled["labelled"]  # stock: zero exactly where unlabelled
    for name, grad in full["grads"].items():
        torch.testing.assert_close(labelled["grads"][name], grad, atol=ATOL, rtol=1e-4, msg=name)
    empty = runs["none"]
    assert empty["labelled"] == 0 and not empty["ce"].any()
    assert all(g is None or not g.any() for g in empty["grads"].values())


def test_mask_token_must_have_an_embedding_row_and_build_settings_name_real_choices():
    from megatron_wedlm.model import BuildSettings, ModelArgs

    described = we.TinyWeDLMSpec().model_args().to_dict()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ModelArgs(**{**described, "mask_token_id": described["vocab_size"]})
    with pytest.raises(ValueError, match="xformers"):
        BuildSettings(attention_backend="xformers")
    with pytest.raises(ValueError, match="no option block_size"):
        BuildSettings(attention_backend="dense", backend_options={"block_size": 8})
    with pytest.raises(ValueError, match="recompute"):
        BuildSettings(recompute="everything")


def test_training_builds_with_the_settings_its_config_names():
    from megatron_wedlm.config import load_config
    from megatron_wedlm.model import BuildSettings
    from megatron_wedlm.training.model_setup import build_settings

    cfg = load_config(None, ["data.path=unused", "model.init_from=unused", "model.attention_backend=auto",
                             "model.init_method_std=0.01",
                             "parallelism.tp=2", "parallelism.sequence_parallel=true", "parallelism.recompute=full",
                             "parallelism.recompute_num_layers=2"])
    got = build_settings(cfg, torch.device("cpu"), torch.bfloat16)
    assert got == BuildSettings(params_dtype=torch.bfloat16, device=torch.device("cpu"), sequence_parallel=True,
                                recompute="full", recompute_num_layers=2, init_method_std=0.01,
                                attention_backend="dense")


def test_logical_rope_equals_megatron_table_on_positions_0_to_s():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_wedlm.model import LogicalRotaryEmbedding

    for kwargs in ({"rotary_base": 1e6}, {"rotary_base": 5e5, "rope_scaling": True}, {"rotary_percent": 0.5}):
        table = RotaryEmbedding(kv_channels=32, rotary_percent=kwargs.get("rotary_percent", 1.0),
                                rotary_base=kwargs.get("rotary_base", 10000), rope_scaling=kwargs.get("rope_scaling", False),
                                use_cpu_initialization=True)
        ours = LogicalRotaryEmbedding(kv_channels=32, **kwargs)
        freqs = table.get_freqs_non_repeated(20)  # what Megatron's table holds for positions 0..19
        expected = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        got = ours(torch.arange(20).expand(3, -1))  # [S, B, 1, D]
        assert got.shape == (20, 3, 1, expected.shape[-1])
        torch.testing.assert_close(got, expected.expand(-1, 3, -1, -1), atol=0, rtol=0)
    # per-slot: a row's frequencies follow its own (reordered) positions
    pos = torch.tensor([[3, 0, 2, 1]])
    got = ours(pos)
    torch.testing.assert_close(got[:, 0], ours(torch.arange(4)[None])[pos[0], 0], atol=0, rtol=0)


@pytest.mark.parametrize("weighting", ["inverse_ratio", "uniform"])
def test_microbatch_contributions_add_up_to_the_global_batch_loss(weighting):
    from megatron_wedlm.model import global_loss_normalizer, reduce_loss_reports, wedlm_loss

    batches = we.make_global_batch(we.TinyWeDLMSpec(global_microbatches=3, micro_batch_size=2))
    g = torch.Generator().manual_seed(3)
    ces = [torch.rand(b.input_ids.shape, generator=g) * 5 for b in batches]
    normalizer = global_loss_normalizer(batches, weighting, group=None)
    parts = [
        wedlm_loss(ce, b.is_masked, b.mlm_weights, b.ar_labels, ar_weight=0.5, mlm_weighting=weighting,
                   normalizer=normalizer)
        for ce, b in zip(ces, batches)
    ]
    cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
    whole = wedlm_loss(torch.cat(ces), cat("is_masked"), cat("mlm_weights"), cat("ar_labels"),
                       ar_weight=0.5, mlm_weighting=weighting)
    assert float(sum(p.total for p in parts)) == pytest.approx(float(whole.total), rel=1e-6)
    summary = reduce_loss_reports([p.report() for p in parts], ar_weight=0.5, group=None)
    assert summary.total == pytest.approx(float(whole.total), rel=1e-6)
    assert summary.mlm == pytest.approx(float(whole.mlm), rel=1e-6)
    assert summary.ar == pytest.approx(float(whole.ar), rel=1e-6)
    assert (summary.mlm_tokens, summary.ar_tokens) == (int(whole.mlm_tokens), int(whole.ar_tokens))
    # per-micro-batch normalisation would give a different (biased) loss
    local = [wedlm_loss(ce, b.is_masked, b.mlm_weights, b.ar_labels, ar_weight=0.5, mlm_weighting=weighting)
             for ce, b in zip(ces, batches)]
    assert abs(float(sum(p.total for p in local)) / 3 - float(whole.total)) > 1e-4
