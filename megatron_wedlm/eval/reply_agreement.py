"""Teacher-forced agreement of a model with recorded replies: how close is it to their writer?

Exact match of free-running replies is all or nothing: one early token changes the rest, and on
open-ended prompts even bf16 rounding flips some. Feeding the recorded reply and counting the
positions where the greedy next token is the recorded one judges each position on the same
prefix. For the writer itself it is 100% up to near-ties, when the replies are the generated ids
(text can tokenize back differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_wedlm.decoding.inputs import encode_prompt


@dataclass
class ReplyAgreement:
    """Over all replies: reply tokens whose greedy prediction is the recorded token, of all reply tokens."""

    same_tokens: int = 0
    tokens: int = 0
    # per reply: index of the first reply token predicted differently (its length when none is)
    first_difference: list[int] = field(default_factory=list)
    reply_lengths: list[int] = field(default_factory=list)
    empty_replies: int = 0  # recorded replies with no token to score (not in the lists above)


@torch.no_grad()
def reply_agreement(model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str | Sequence[int]]],
                    chat: bool = True) -> ReplyAgreement:
    """Teacher-forced agreement of ``model`` with the recorded ``(prompt, reply)`` pairs.

    A reply is its writer's token ids, or its text tokenized as it would follow the prompt. Its
    end-of-turn token is not scored (a reply cut at the budget has none), so an empty reply counts
    in ``empty_replies`` only."""
    out = ReplyAgreement()
    device = next(model.parameters()).device
    for prompt, reply in pairs:
        prompt_ids = encode_prompt(tokenizer, prompt, chat=chat)
        reply_ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"] if isinstance(reply, str) else reply)
        if not reply_ids:
            out.empty_replies += 1
            continue
        ids = torch.tensor([prompt_ids + reply_ids], device=device)
        logits = model(ids).logits[0]
        # the logits at position i predict token i + 1: those of the last prompt token onwards
        predicted = logits[len(prompt_ids) - 1: -1].argmax(-1).tolist()
        same = [p == r for p, r in zip(predicted, reply_ids)]
        out.same_tokens += sum(same)
        out.tokens += len(reply_ids)
        out.first_difference.append(same.index(False) if False in same else len(same))
        out.reply_lengths.append(len(reply_ids))
    return out
