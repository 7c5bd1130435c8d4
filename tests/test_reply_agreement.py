"""Teacher-forced agreement with recorded replies (megatron_wedlm/eval/reply_agreement.py), on the
real SmolLM2-135M-Instruct and its chat template:

* the model that recorded its greedy replies predicts every one of their tokens, given as the
  generated token ids or as text (the measure's own check: one forward per reply scores the same
  positions greedy decoding produced);
* a perturbed model's count equals a brute-force count that re-runs the model on each prefix of the
  reply and compares its last-position argmax, and the first difference of each reply is where that
  brute force first disagrees.
"""

from __future__ import annotations

import pytest
import torch

from megatron_wedlm.decoding.api import generate_batch
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids, load_checkpoint
from megatron_wedlm.eval.reply_agreement import reply_agreement
from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "Explain what a vaccine is."]
TOKENS = 16


@pytest.fixture(scope="module")
def recorded():
    model, tokenizer = load_checkpoint(smollm2_hf_dir(), device="cpu", dtype="float32", require_mask_token=False)
    ids = [encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]
    stops = eos_token_ids(model, tokenizer)
    replies = generate_batch(model, ids, method="ar", max_new_tokens=TOKENS, batch_size=len(PROMPTS),
                             stop_token_ids=stops, tokenizer=tokenizer)
    as_ids = [(p, [t for t in r.token_ids if t not in stops]) for p, r in zip(PROMPTS, replies)]
    return model, tokenizer, [(p, r.text.strip()) for p, r in zip(PROMPTS, replies)], as_ids


@pytest.mark.parametrize("form", ["token ids", "text"])
def test_the_model_that_recorded_the_replies_predicts_all_their_tokens(recorded, form):
    model, tokenizer, as_text, as_ids = recorded
    pairs = as_ids if form == "token ids" else as_text
    result = reply_agreement(model, tokenizer, pairs)
    assert result.tokens >= 2 * len(PROMPTS) and result.same_tokens == result.tokens
    assert len(result.first_difference) == len(pairs) and result.first_difference == result.reply_lengths
    if form == "token ids":  # exactly the generated tokens are scored
        assert result.reply_lengths == [len(ids) for _, ids in as_ids]


@torch.no_grad()
def test_a_perturbed_model_agrees_where_a_prefix_by_prefix_brute_force_does(recorded):
    model, tokenizer, _, pairs = recorded
    perturbed = type(model)(model.config).eval()
    perturbed.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    for p in perturbed.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.std())
    result = reply_agreement(perturbed, tokenizer, pairs)
    same, first = 0, []
    for prompt, reply_ids in pairs:
        prompt_ids = encode_prompt(tokenizer, prompt, chat=True)
        hits = [int(perturbed(torch.tensor([prompt_ids + reply_ids[:j]])).logits[0, -1].argmax()) == reply_ids[j]
                for j in range(len(reply_ids))]
        same += sum(hits)
        first.append(hits.index(False) if False in hits else len(hits))
    assert (result.same_tokens, result.first_difference) == (same, first)
    assert 0 < result.same_tokens < result.tokens  # the perturbation changed some predictions, not all
