"""Per-slot token choice for parallel decoding: which mask slots to fill, and with what.

All functions work on a whole batch of windows at once (``[rows, slots, vocab]``) so a decoding
step costs a handful of tensor ops, never a Python loop over slots.

Two distributions are involved, on purpose:

* the *confidence* of a slot is the entropy of the model's own distribution there
  (``softmax(logits)``, temperature 1, no top-k/top-p, mask token excluded). It measures how sure
  the model is, independently of the sampler knobs; using the sampling distribution instead
  would make greedy decoding (a one-hot distribution, entropy 0) fill every slot at once.
  This is also what the reference WeDLM engine does.
* the *token* put into a filled slot comes from the sampling distribution: argmax when
  ``temperature == 0``, else softmax(logits / T) restricted by top-k then top-p.

The mask token's logit is set to ``-inf`` before either is computed, so a mask can never be
emitted as output.
"""

from __future__ import annotations

import torch


def exclude_token(logits: torch.Tensor, token_id: int) -> torch.Tensor:
    """Return ``logits`` with ``token_id`` made impossible (logit ``-inf``), without modifying the input."""
    out = logits.clone()
    out[..., token_id] = float("-inf")
    return out


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dim; ``-inf`` logits count as probability 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)


def select_slots(
    slot_entropy: torch.Tensor,
    is_mask: torch.Tensor,
    entropy_threshold: float | None,
    distance_penalty: float,
) -> torch.Tensor:
    """Which mask slots to fill this step (bool ``[rows, slots]``), by the WeDLM entropy rule.

    ``H~_i = H_i + distance_penalty * d_i`` with ``d_i`` the distance in window slots from the
    leftmost remaining mask of the row. Every mask slot with ``H~ < entropy_threshold`` is filled;
    a row where none qualifies (or ``entropy_threshold is None``: one slot per step) fills the
    single mask slot with the smallest ``H~``. The penalty favours slots near the committed prefix,
    which is what lets the leftmost filled run (and so the cacheable prefix) grow.
    Rows without any mask slot fill nothing.
    """
    slots = torch.arange(is_mask.shape[1], device=is_mask.device)
    first_mask = torch.where(is_mask, slots, is_mask.shape[1]).min(dim=1, keepdim=True).values
    adjusted = slot_entropy + distance_penalty * (slots - first_mask).to(slot_entropy.dtype)
    adjusted = adjusted.masked_fill(~is_mask, float("inf"))
    if entropy_threshold is None:
        fill = torch.zeros_like(is_mask)
    else:
        fill = adjusted < entropy_threshold
    needs_one = ~fill.any(dim=1) & is_mask.any(dim=1)
    best = torch.nn.functional.one_hot(adjusted.argmin(dim=1), is_mask.shape[1]).bool()
    return fill | (best & needs_one[:, None])


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per position of ``logits[..., vocab]``: argmax if ``temperature == 0``, else a draw.

    Sampling order (as in HF transformers): temperature, then top-k (0 = off), then top-p (1.0 = off,
    the most likely token is always kept). Draws use ``generator``, so a seeded generator makes the
    whole decode reproducible.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Reject sampler settings that have no meaning, naming the argument."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
