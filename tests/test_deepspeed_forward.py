"""The DeepSpeed backend's model side, without DeepSpeed processes: dual-stream forward of a HF
model, mask-token row, weight-decay groups, and the loss against the Megatron path's.

The forward is checked against brute force: every labelled slot's cross entropy must equal that
of a *plain causal* HF forward over exactly the slots the WeDLM rule lets it see (in physical
order, with their logical positions). That needs no mask at all, so a wrong mask form, a wrong
position or a leak through padding would show.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches
from megatron_wedlm.deepspeed_backend.forward import DualStreamCausalLM, dual_stream_cross_entropy, pad_rows
from megatron_wedlm.deepspeed_backend.hf_model import (
    apply_mask_token,
    plan_mask_token,
    weight_decay_param_groups,
)
from megatron_wedlm.model.losses import wedlm_labels
from megatron_wedlm.testing.tiny_models import TinyShape, build_tiny_ar_tokenizer, build_tiny_causal_lm
from megatron_wedlm.training.objective import Objective

MASK = 400  # the AR tokenizer has 400 tokens; prepare_data appends the mask token after them


def _model(arch: str = "qwen3", tied: bool = False, vocab_size: int = 512, seed: int = 0):
    shape = TinyShape(num_kv_heads=2, head_dim=16 if arch == "qwen3" else None, tie_word_embeddings=tied)
    model = build_tiny_causal_lm(arch, shape, vocab_size=vocab_size, seed=seed)
    model.set_attn_implementation("sdpa")
    return model


def _batch(seed: int = 0, block_size: int = 4):
    """Two rows: two SFT documents packed in one row, a shorter single document (padded) in the other."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 400, (n,), generator=gen) for n in (13, 9, 7)]
    rows = [
        build_dual_stream_batch(docs[:2], RowFormat(block_size, MASK), gen, prompt_lengths=[3, 2]),
        build_dual_stream_batch(docs[2:], RowFormat(block_size, MASK), gen),
    ]
    return stack_dual_stream_batches(rows)


def _visible_slots(batch, row: int, q: int) -> list[int]:
    """The WeDLM rule (docs/method.md §2.3), spelled out per slot."""
    doc, mem, blk = batch.doc_ids[row], batch.is_memory[row], batch.block_ids[row]
    seen = []
    for k in range(q + 1):
        if doc[k] != doc[q] or doc[q] < 0:
            continue
        if mem[q] and mem[k]:
            seen.append(k)
        elif not mem[q] and mem[k] and blk[k] < blk[q]:
            seen.append(k)
        elif not mem[q] and not mem[k] and blk[k] == blk[q]:
            seen.append(k)
    return seen


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama", True)])
def test_every_labelled_slot_equals_a_plain_causal_forward_over_what_it_may_see(arch, tied):
    model = _model(arch, tied)
    batch = _batch()
    with torch.no_grad():
        ce = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
    labels = wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels)
    checked = 0
    for row in range(batch.input_ids.shape[0]):
        for q in range(batch.seq_len):
            if labels[row, q] < 0:
                assert ce[row, q] == 0
                continue
            seen = _visible_slots(batch, row, q)
            with torch.no_grad():
                logits = model(input_ids=batch.input_ids[row, seen][None],
                               position_ids=batch.position_ids[row, seen][None]).logits[0, -1]
            reference = F.cross_entropy(logits[None], labels[row, q][None])
            torch.testing.assert_close(ce[row, q], reference, rtol=0, atol=2e-5)
            checked += 1
    assert checked == int((labels >= 0).sum()) > 20


def test_float_mask_means_the_same_to_eager_and_sdpa():
    """Why the mask is additive float: eager adds it to the scores, SDPA accepts it as is."""
    model, batch = _model(), _batch(seed=1)
    with torch.no_grad():
        sdpa = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
        model.set_attn_implementation("eager")
        eager = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=2e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="compiled FlexAttention on CPU needs a C++ compiler")
def test_flex_block_mask_through_transformers_equals_dense():
    """The GPU path (FlexAttention BlockMask via attn_implementation='flex_attention'), run on CPU.

    FlexAttention has no CPU backward, so only the forward is checked here (~30 s: one compile).
    Dynamo is reset first: compiled-flex state left by earlier tests in the same process (other
    shapes, automatic dynamic shapes) made inductor's CPU flex template emit invalid C++.
    """
    torch._dynamo.reset()
    model = _model()
    batch = pad_rows(_batch(seed=2, block_size=8), "flex")
    with torch.no_grad():
        dense = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
        model.set_attn_implementation("flex_attention")
        flex = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "flex")
    assert batch.seq_len == 128
    torch.testing.assert_close(flex, dense, rtol=0, atol=2e-5)


def test_objective_on_hf_output_is_the_wedlm_loss_and_ar_mode_is_next_token_only():
    model, batch = _model(), _batch(seed=3)
    ce = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
    total, loss = Objective(ar_weight=0.5).contribution(ce, batch, None)
    labels_masked = batch.is_masked
    w = torch.where(labels_masked, batch.mlm_weights, torch.zeros_like(batch.mlm_weights))
    mlm = (ce * w).sum() / w.sum()
    ar_mask = batch.ar_labels >= 0
    ar = ce[ar_mask].sum() / ar_mask.sum()
    torch.testing.assert_close(total, (mlm + 0.5 * ar) / 1.5)
    ar_only, _ = Objective(wedlm=False).contribution(ce, batch, None)
    torch.testing.assert_close(ar_only, ar)
    total.backward()
    assert all(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Mask token and optimizer groups
# --------------------------------------------------------------------------------------------


def _hf_dir(tmp_path, vocab_size: int, tokenizer=None, tied: bool = False, mask_token_id: int | None = None):
    tokenizer = tokenizer or build_tiny_ar_tokenizer()
    model = build_tiny_causal_lm("qwen2", TinyShape(tie_word_embeddings=tied),
                                 vocab_size=vocab_size, mask_token_id=mask_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_new_mask_token_grows_the_vocabulary_with_a_mean_row_and_zero_padding(tmp_path, tied):
    model = _hf_dir(tmp_path, 400, tied=tied)
    before = [w.detach().clone() for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)]
    plan = plan_mask_token(tmp_path, MASK, vocab_rows=400)
    assert (plan.initialise_row, plan.mean_over_rows, plan.min_rows) == (True, 400, 401)
    apply_mask_token(model, plan, pad_rows_to_multiple_of=128)
    after = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert model.config.mask_token_id == MASK and model.config.vocab_size == 512
    for old, new in zip(before, after):
        assert new.shape == (512, 32)
        assert torch.equal(new[:400], old)
        torch.testing.assert_close(new[MASK], old.mean(0), rtol=0, atol=1e-7)
        assert not new[401:].any()
    assert (after[0] is after[1]) == tied


def test_mask_token_in_a_spare_row_keeps_the_other_rows(tmp_path):
    model = _hf_dir(tmp_path, 512)
    embed = model.get_input_embeddings().weight.detach().clone()
    apply_mask_token(model, plan_mask_token(tmp_path, MASK, vocab_rows=512), pad_rows_to_multiple_of=128)
    new = model.get_input_embeddings().weight
    torch.testing.assert_close(new[MASK], embed[:400].mean(0), rtol=0, atol=1e-7)
    keep = torch.ones(512, dtype=torch.bool)
    keep[MASK] = False
    assert torch.equal(new[keep], embed[keep])


def test_a_checkpoint_that_knows_its_mask_token_is_left_alone_and_must_agree(tmp_path):
    model = _hf_dir(tmp_path, 512, mask_token_id=7)
    weights = model.get_input_embeddings().weight.detach().clone()
    plan = plan_mask_token(tmp_path, 7, vocab_rows=512)
    assert not plan.initialise_row
    apply_mask_token(model, plan)
    assert torch.equal(model.get_input_embeddings().weight, weights)
    with pytest.raises(ValueError, match="mask token id 7 .* prepared with mask token id 400"):
        plan_mask_token(tmp_path, MASK, vocab_rows=512)


def test_weight_decay_groups_exclude_biases_and_norms():
    model = build_tiny_causal_lm("qwen2", vocab_size=64)
    decay, no_decay = weight_decay_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["wd_mult"] == 1.0 and no_decay["wd_mult"] == 0.0 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]} == {"bias", "weight"}
    assert any(names[id(p)].endswith("q_proj.bias") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# --------------------------------------------------------------------------------------------
# Same weights, same batch: the Megatron path's loss
# --------------------------------------------------------------------------------------------


def test_loss_on_a_fixed_batch_equals_the_megatron_models_on_converted_weights(tmp_path):
    """HF checkpoint without a mask token -> (a) this backend's model, (b) the HF -> Megatron
    conversion loaded into the Megatron path's model. Same dual-stream batch, same loss."""
    from megatron_wedlm.config import load_config
    from megatron_wedlm.conversion import convert_hf_to_megatron, megatron_process_group
    from megatron_wedlm.deepspeed_backend.hf_model import load_hf_causal_lm
    from megatron_wedlm.data import pack_attention_metadata
    from megatron_wedlm.model.wedlm_model import build_model_chunks
    from megatron_wedlm.training.model_setup import build_settings, load_init_weights, resolve_model_args

    tokenizer = build_tiny_ar_tokenizer()
    source = build_tiny_causal_lm("qwen3", TinyShape(num_kv_heads=2, head_dim=16), vocab_size=400, seed=3)
    source.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    batch = _batch(seed=4)
    labels = wedlm_labels(batch.is_masked, batch.target_ids, batch.ar_labels)

    hf = load_hf_causal_lm(tmp_path / "hf", torch.float32, "sdpa")
    apply_mask_token(hf, plan_mask_token(tmp_path / "hf", MASK, 400), pad_rows_to_multiple_of=128)
    with torch.no_grad():
        hf_ce = dual_stream_cross_entropy(DualStreamCausalLM(hf), batch, "dense")

    cfg = load_config(None, [f"model.init_from={tmp_path / 'megatron'}", "data.path=unused", "trainer.device=cpu",
                             "model.attention_backend=dense", "data.seq_length=64"])
    with megatron_process_group():
        args = resolve_model_args(cfg, {"mask_token_id": MASK, "tokenizer_length": 401}, "float32")
        (megatron,) = build_model_chunks(args, build_settings(cfg, torch.device("cpu"), torch.float32))
        megatron.eval()
        load_init_weights(megatron, tmp_path / "megatron")
        with torch.no_grad():
            mcore_ce = megatron(batch.input_ids, batch.position_ids,
                                attention_mask=pack_attention_metadata(batch.attention_metadata()), labels=labels)

    torch.testing.assert_close(hf_ce, mcore_ce, rtol=0, atol=3e-5)
    for ar_weight in (1.0, 0.0):
        objective = Objective(ar_weight=ar_weight)
        hf_total, hf_loss = objective.contribution(hf_ce, batch, None)
        mc_total, mc_loss = objective.contribution(mcore_ce, batch, None)
        torch.testing.assert_close(hf_total, mc_total, rtol=1e-6, atol=0)
        torch.testing.assert_close(hf_loss.mlm, mc_loss.mlm, rtol=1e-6, atol=0)
        torch.testing.assert_close(hf_loss.ar, mc_loss.ar, rtol=1e-6, atol=0)


def test_official_wedlm_checkpoint_loads_as_its_ar_family_and_keeps_its_mask_token(tmp_path):
    """``model_type: "wedlm"`` (qk_norm, no biases: WeDLM-8B style) trains as Qwen3, no remote code."""
    import json

    from megatron_wedlm.deepspeed_backend.hf_model import load_hf_causal_lm

    source = build_tiny_causal_lm("qwen3", TinyShape(num_kv_heads=2, head_dim=16), vocab_size=512, mask_token_id=MASK)
    source.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="wedlm", architectures=["WeDLMForCausalLM"], qk_norm=True, attention_bias=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_hf_causal_lm(tmp_path, torch.float32, "sdpa")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.training
    plan = plan_mask_token(tmp_path, MASK, vocab_rows=512)
    assert not plan.initialise_row and plan.min_rows == 512
    batch = _batch(seed=5)
    with torch.no_grad():
        loaded = dual_stream_cross_entropy(DualStreamCausalLM(model), batch, "dense")
        torch.testing.assert_close(loaded, dual_stream_cross_entropy(DualStreamCausalLM(source.train()), batch, "dense"),
                                   rtol=0, atol=0)
