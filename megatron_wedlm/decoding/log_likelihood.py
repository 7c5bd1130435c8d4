"""Causal log-likelihoods of given tokens: one teacher-forced forward, as lm-eval's ``hf`` model scores them.

The one scoring primitive of the product: lm-eval's ``loglikelihood`` through the adapter
(:mod:`megatron_wedlm.eval.lm_eval_adapter`), the in-process multiple-choice evaluation
(:mod:`megatron_wedlm.eval.multiple_choice`) and the server's ``logprobs``/``echo``
(:mod:`megatron_wedlm.serving.scoring`). Plain forwards without a KV cache, right-padded rows with
their attention mask (none when no row is padded: HF's own causal mask), logits only where a
scored token is predicted, the log-softmax in fp32 (for a bf16 model, bf16's rounding of a 49k-way
log-softmax moves a continuation's log-likelihood by up to 2 nats). Sequences whose inputs (all
tokens but the last) are equal share one row: a question's one-token choices (MMLU's letters)
cost one row, not four. Inside the decoder's packed-attention block it runs with plain SDPA.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packed_attention import plain_attention


@dataclass(frozen=True)
class Scored:
    """``logprobs[k]``: the log-probability of ``tokens[first + k]`` given the tokens before it;
    ``greedy``: each of them was the most likely token; ``top[k]``: the ``(token id, logprob)``
    pairs of the ``top_n`` most likely tokens there, most likely first."""

    logprobs: list[float]
    greedy: bool
    top: list[list[tuple[int, float]]]

    @property
    def total(self) -> float:
        return sum(self.logprobs)


def causal_log_likelihoods(
    model,
    sequences: Sequence[Sequence[int]],
    first: Sequence[int],
    *,
    top_n: int = 0,
    exclude_token_id: int | None = None,
    batch_rows: int | None = None,
    batch_tokens: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Scored]:
    """:class:`Scored` of ``sequences[i][first[i]:]`` (``1 <= first[i] < len``) under ``model``, an HF causal LM.

    A forward holds at most ``batch_rows`` rows and ``batch_tokens`` padded tokens (a longer row
    goes alone); longest rows first. ``exclude_token_id`` (a WeDLM mask token) gets no probability,
    as the decoders never emit it. ``on_progress(done, total)`` after each forward.
    """
    for seq, start in zip(sequences, first):
        if not 1 <= start < len(seq):
            raise ValueError(f"first={start} must score at least one of the sequence's {len(seq)} tokens after its first")
    rows: dict[tuple[int, ...], list[int]] = {}  # a forward row's input -> the sequences it scores
    for i, seq in enumerate(sequences):
        rows.setdefault(tuple(seq[:-1]), []).append(i)
    order = sorted(rows, key=lambda key: (-len(key), rows[key][0]))
    keep = _takes_logits_to_keep(model)
    device = next(model.parameters()).device
    results: list[Scored | None] = [None] * len(sequences)
    done = 0
    with torch.inference_mode(), plain_attention(model):
        for batch in _batches([len(key) for key in order], batch_rows, batch_tokens):
            keys = [order[b] for b in batch]
            width = len(keys[0])
            ids = torch.zeros(len(keys), width, dtype=torch.long)
            mask = torch.zeros(len(keys), width, dtype=torch.long)
            for r, key in enumerate(keys):
                ids[r, : len(key)] = torch.tensor(key, dtype=torch.long)
                mask[r, : len(key)] = 1
            # only positions that predict a scored token need logits (a vocabulary-wide row each)
            lowest = min(first[i] - 1 for key in keys for i in rows[key])
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device) if not mask.all() else None,
                           use_cache=False, **({"logits_to_keep": width - lowest} if keep else {})).logits
            offset = width - logits.shape[1]  # input position of logits[:, 0]
            for r, key in enumerate(keys):
                for i in rows[key]:
                    results[i] = _scored(logits[r, first[i] - 1 - offset : len(key) - offset],
                                         sequences[i][first[i]:], top_n, exclude_token_id)
                done += len(rows[key])
            if on_progress is not None:
                on_progress(done, len(sequences))
    return results  # type: ignore[return-value]


def _takes_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _scored(logits: torch.Tensor, target: Sequence[int], top_n: int, exclude_token_id: int | None) -> Scored:
    logits = logits.float()
    if exclude_token_id is not None:
        logits[:, exclude_token_id] = float("-inf")
    logp = F.log_softmax(logits, dim=-1)
    tokens = torch.tensor(list(target), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    greedy = bool((logp.argmax(dim=-1) == tokens).all())
    top: list[list[tuple[int, float]]] = [[] for _ in target]
    if top_n:
        values, indices = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
        top = [list(zip(ix, vs)) for ix, vs in zip(indices.tolist(), values.tolist())]
    return Scored(chosen.tolist(), greedy, top)


def _batches(widths: list[int], rows: int | None, tokens: int | None) -> list[list[int]]:
    """Consecutive indices of rows (``widths`` longest first) in forwards of at most ``rows`` rows and
    ``tokens`` padded tokens (rows x the first row's width)."""
    batches: list[list[int]] = []
    for i, width in enumerate(widths):
        if batches and (rows is None or len(batches[-1]) < rows) \
                and (tokens is None or (len(batches[-1]) + 1) * widths[batches[-1][0]] <= tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
