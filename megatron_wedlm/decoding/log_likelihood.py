"""Causal log-likelihoods of given tokens, one teacher-forced forward, as lm-eval's ``hf`` scores.

The one scoring primitive (lm-eval adapter, multiple choice, the server's ``logprobs``):
right-padded rows without a KV cache, log-softmax in fp32, equal inputs in one row.
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
    """Per scored token: its ``logprobs``, whether it was ``greedy``, and the ``top`` pairs."""

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
    """:class:`Scored` of each ``sequences[i][first[i]:]`` (``1 <= first[i] < len``).

    Forwards hold at most ``batch_rows`` rows and ``batch_tokens`` padded tokens;
    ``exclude_token_id`` (a mask token) gets no probability.
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
    """Row indices (longest first) in forwards of at most ``rows`` rows and ``tokens`` tokens."""
    batches: list[list[int]] = []
    for i, width in enumerate(widths):
        if batches and (rows is None or len(batches[-1]) < rows) \
                and (tokens is None or (len(batches[-1]) + 1) * widths[batches[-1][0]] <= tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
