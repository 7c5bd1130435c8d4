"""Where a model's parallel predictions go wrong: first predictions of mask slots, by distance.

Streaming decoding commits a slot on confidence alone (``H + lambda * d < tau``) and never revises
it, so a model decodes well in parallel exactly when its confident predictions are right. This
probe measures that without the decoder: for every cut ``c`` of a reference answer the model sees
``prompt + answer[:c]`` and ``W`` masks, and per distance ``d`` we count states, correct argmaxes,
and per ``tau`` the slots the fill rule would take and how many are wrong. A wrong argmax equal to
the answer's token one place before or after is *slipped* (the model lost its place); with
``end_token_ids``, wrong commits split into *early ends* and *late ends*.

The cuts of one example share a forward as right-padded rows (causal attention: the padding
changes no row's logits); the mask token is never a prediction, as in the decoder.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from megatron_wedlm.decoding.sampling import entropy


@dataclass
class DistanceStats:
    """First predictions of the mask slot ``distance`` slots after the committed prefix."""

    distance: int
    states: int = 0
    correct: int = 0
    slipped: int = 0  # wrong argmaxes equal to the answer's token one place before or after
    commits: dict[float, int] = field(default_factory=dict)  # tau -> slots filled on confidence alone
    wrong: dict[float, int] = field(default_factory=dict)  # tau -> of those, wrong tokens
    early_end: dict[float, int] = field(default_factory=dict)  # tau -> wrong commits of an end token
    late_end: dict[float, int] = field(default_factory=dict)  # tau -> wrong commits where an end token was due

    @property
    def accuracy(self) -> float:
        return self.correct / self.states if self.states else float("nan")


@torch.inference_mode()
def probe_masked_slots(
    model,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    mask_token_id: int,
    window_size: int,
    distance_penalty: float,
    taus: Sequence[float],
    rows_per_forward: int = 32,
    end_token_ids: Collection[int] = (),
) -> list[DistanceStats]:
    """Per distance ``0 .. window_size - 1``, the first predictions over every cut of every
    ``(prompt_ids, answer_ids)`` example. As in the decoder the output layer runs on the mask slots
    only, and at most ``rows_per_forward`` cuts share a forward, so memory stays bounded."""
    if window_size < 1 or rows_per_forward < 1:
        raise ValueError(f"window_size and rows_per_forward must be >= 1, got {window_size}, {rows_per_forward}")
    ends = set(end_token_ids)
    stats = [DistanceStats(d, commits={t: 0 for t in taus}, wrong={t: 0 for t in taus},
                           early_end={t: 0 for t in taus}, late_end={t: 0 for t in taus}) for d in range(window_size)]
    penalty = distance_penalty * torch.arange(window_size, dtype=torch.float32)
    body, head, device = model.base_model, model.get_output_embeddings(), model.device
    for prompt, answer in examples:
        prompt, answer = list(prompt), list(answer)
        for first in range(0, len(answer), rows_per_forward):
            cuts = range(first, min(first + rows_per_forward, len(answer)))
            rows = [prompt + answer[:c] + [mask_token_id] * window_size for c in cuts]
            width = len(rows[-1])
            ids = torch.tensor([r + [mask_token_id] * (width - len(r)) for r in rows], device=device)
            hidden = body(input_ids=ids).last_hidden_state
            # cut c's masks start at column len(prompt) + c
            columns = torch.tensor([[len(prompt) + c + d for d in range(window_size)] for c in cuts], device=device)
            logits = head(hidden[torch.arange(len(rows), device=device).unsqueeze(1), columns]).float().cpu()
            logits[..., mask_token_id] = torch.finfo(logits.dtype).min
            adjusted = entropy(logits) + penalty  # [cuts, W]: H + lambda * d
            predicted = logits.argmax(dim=-1)
            for row, c in enumerate(cuts):
                for d in range(min(window_size, len(answer) - c)):
                    token, reference = int(predicted[row, d]), answer[c + d]
                    right = token == reference
                    s = stats[d]
                    s.states += 1
                    s.correct += right
                    s.slipped += not right and token in answer[max(c + d - 1, 0):c + d + 2]
                    for tau in taus:
                        if adjusted[row, d] < tau:
                            s.commits[tau] += 1
                            s.wrong[tau] += not right
                            s.early_end[tau] += not right and token in ends and reference not in ends
                            s.late_end[tau] += not right and reference in ends and token not in ends
    return stats


def format_probe(
    stats: Sequence[DistanceStats], taus: Sequence[float], max_distance: int | None = None, ends: bool = False
) -> str:
    """A table: one column per distance, rows for accuracy, slipped argmaxes and ``wrong/committed`` per tau (and,
    with ``ends``, the early and late ends among the wrong commits per tau)."""
    shown = [s for s in stats if s.states and (max_distance is None or s.distance <= max_distance)]
    cell = 11
    lines = ["distance d".ljust(16) + "".join(f"{s.distance:>{cell}}" for s in shown),
             "states".ljust(16) + "".join(f"{s.states:>{cell}}" for s in shown),
             "argmax correct".ljust(16) + "".join(f"{s.accuracy:>{cell}.1%}" for s in shown),
             "argmax slipped".ljust(16) + "".join(f"{s.slipped:>{cell}}" for s in shown)]
    for tau in taus:
        lines.append(f"wrong/commit {tau:g}".ljust(16)
                     + "".join(f"{s.wrong[tau]:>{cell - 6}}/{s.commits[tau]:<5}" for s in shown))
    for tau in taus if ends else ():
        lines.append(f"early end {tau:g}".ljust(16) + "".join(f"{s.early_end[tau]:>{cell}}" for s in shown))
        lines.append(f"late end {tau:g}".ljust(16) + "".join(f"{s.late_end[tau]:>{cell}}" for s in shown))
    return "\n".join(lines)
