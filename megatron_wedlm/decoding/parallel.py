"""Streaming parallel decoding (WeDLM Algorithm 1) and the block-wise baseline, for a batch of prompts.

One engine runs both schedules; they differ only in what a forward may commit:

* ``streaming``: the leftmost filled run of the window, whatever its length.
* ``blockwise``: nothing until the whole block of ``window_size`` slots is filled, then the block.

Refill order (``fused_refill``):

* ``True`` (default; the schedule of the reference engine, Tencent/WeDLM ``wedlm/engine``, which
  its published speeds come from): the window is refilled *before* the forward. The leftmost
  filled run of n slots that the next forward commits rides in that forward together with the n
  new masks appended after the window, so a forward carries W + n <= 2W slots and no forward is
  spent on committing alone (tau = infinity, W = 4: 10 forwards instead of 19).
* ``False`` (Algorithm 1 in the paper's step order, SPEC step (e)): after a forward commits its
  leftmost filled run of n slots, n new masks are appended, so every forward carries exactly
  ``window_size`` slots (the paper's fixed parallel workload). The new masks get their first
  prediction in the next forward. ``tools/bench_decode.py`` measures both.

Engine rules followed (SPEC section 3): a slot's confidence is the entropy of its raw logits at
temperature 1; a slot qualifies when ``H + lambda * d < tau`` (strict), d = its window index
minus that of the first remaining mask; if none qualifies (or tau is None) exactly the argmin
is filled (first on ties); greedy = argmax; a stop token is emitted and ends the row.
``num_forwards`` counts the forwards of a row until it finishes, the prompt's prefill being
fused into the first one, which is the engine's ``decode_forwards``. Deliberate deviations from
the engine: the window is capped by the remaining token budget (the engine decodes past it and
truncates), and the mask token is never emitted (its logit is excluded before entropy and
sampling). Whether the tokenizer's EOS is a stop token is the caller's choice
(``stop_token_ids``); the command lines stop at it by default, as the engine does.

Per step and row, the window (filled slots first, then masks, each in ascending logical
position) goes through one causal forward on top of the row's committed KV cache, with
``position_ids`` = logical positions. HF attention builds its causal structure from the
*physical* order (our explicit 4-D mask, see :class:`RowKVCache`) while RoPE uses the logical
positions, which is exactly the topological reordering of WeDLM. Because the filled slots come
first, the keys/values of the leftmost filled run depend on the committed prefix and on
themselves only, so they are exact and are kept; the rest of the window is recomputed next step.

Choices this module makes (the spec leaves them open):

* The prompt is prefilled in the same forward as the first window (they are contiguous, the
  mask is plain causal), so a generation costs one forward fewer than "prefill, then decode".
* A generation that is over needs no keys/values for its last tokens: when, after the predict
  step, the leftmost filled run already reaches a stop token or the token budget, it is emitted
  without one more forward (AR decoding does not forward its last sampled token either).
  The output is the same as committing it in a further forward.
* Rows of a batch are independent: each has its own window, cache length and budget; finished
  rows leave the batch. Greedy results equal one-at-a-time decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import (
    as_prompt_batch,
    as_token_list,
    check_fits,
    check_full_attention,
    generation_budget,
    resolve_mask_token_id,
)
from .result import (
    MAX_NEW_TOKENS,
    MAX_POSITIONS,
    STOP_STRING,
    STOP_TOKEN,
    GenerationResult,
    decode_text,
    find_stop_string,
)
from .row_cache import RowKVCache
from .sampling import entropy, exclude_token, sample_tokens, select_slots, validate_sampling

STREAMING = "streaming"
BLOCKWISE = "blockwise"


@dataclass(frozen=True)
class ParallelSettings:
    """Everything that steers a parallel decode, validated once."""

    schedule: str
    mask_token_id: int
    window_size: int
    entropy_threshold: float | None
    distance_penalty: float
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    fused_refill: bool = True

    def __post_init__(self):
        if self.schedule not in (STREAMING, BLOCKWISE):
            raise ValueError(f"schedule must be {STREAMING!r} or {BLOCKWISE!r}, got {self.schedule!r}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mask_token_id in self.stop_token_ids:
            raise ValueError("the mask token cannot be a stop token")
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def capacity(self) -> int:
        """Most slots one forward can carry per row: a run to commit plus ``window_size`` more."""
        return 2 * self.window_size


def streaming_generate(
    model,
    prompt_ids,
    *,
    mask_token_id: int | None = None,
    window_size: int = 16,
    entropy_threshold: float | None = 0.4,
    distance_penalty: float = 0.02,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    fused_refill: bool = True,
) -> GenerationResult:
    """Decode one prompt with Streaming Parallel Decoding (SPEC section 3, Algorithm 1).

    ``mask_token_id`` defaults to ``model.config.mask_token_id``. ``entropy_threshold=None`` fills
    exactly one slot per step (the mask slot with the smallest distance-penalised entropy).
    ``stop_token_ids``: generation ends at the first one (it is kept in the output); None = none.
    ``stop_strings`` (needs ``tokenizer``): generation ends once the decoded output contains one;
    ``token_ids`` keep the token that completed it and ``text`` is cut just before it.
    ``generator`` (on the model's device) makes sampling reproducible. ``fused_refill`` picks the
    refill order (module docstring; default: the reference engine's, False: the paper's). Returns a
    :class:`GenerationResult` (metrics defined in :mod:`megatron_wedlm.decoding.result`).
    """
    return parallel_generate_batch(model, [as_token_list(prompt_ids)], schedule=STREAMING, **_collect(locals()))[0]


def blockwise_generate(
    model,
    prompt_ids,
    *,
    mask_token_id: int | None = None,
    window_size: int = 16,
    entropy_threshold: float | None = 0.4,
    distance_penalty: float = 0.02,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    fused_refill: bool = True,
) -> GenerationResult:
    """Decode one prompt block by block (the baseline): blocks of ``window_size`` masks, same fill rule,
    a block is committed only once all of it is filled. Arguments as :func:`streaming_generate`."""
    return parallel_generate_batch(model, [as_token_list(prompt_ids)], schedule=BLOCKWISE, **_collect(locals()))[0]


def _collect(args: dict) -> dict:
    return {k: v for k, v in args.items() if k not in ("model", "prompt_ids")}


def parallel_generate_batch(
    model,
    prompts,
    *,
    schedule: str = STREAMING,
    mask_token_id: int | None = None,
    window_size: int = 16,
    entropy_threshold: float | None = 0.4,
    distance_penalty: float = 0.02,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    fused_refill: bool = True,
) -> list[GenerationResult]:
    """Decode several prompts (of any lengths) together, one batched forward per step.

    Arguments as :func:`streaming_generate`, plus ``schedule`` (``"streaming"`` or
    ``"blockwise"``). Returns one result per prompt, in order.
    """
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (pass tokenizer=...)")
    settings = ParallelSettings(
        schedule=schedule,
        mask_token_id=resolve_mask_token_id(model, mask_token_id),
        window_size=window_size,
        entropy_threshold=entropy_threshold,
        distance_penalty=distance_penalty,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=tuple(int(t) for t in (stop_token_ids or ())),
        stop_strings=tuple(stop_strings or ()),
        fused_refill=fused_refill,
    )
    results, _ = decode(model, as_prompt_batch(prompts), settings, tokenizer=tokenizer, generator=generator)
    return results


def _uses_mask_free_attention(model, rows: int) -> bool:
    """GPU fast path: flash-attention's causal mode aligns the query block to the *end* of the keys,
    which is exactly our mask when there is a single row, so no mask tensor needs to be built.
    Never taken on CPU (eager/SDPA treat a missing mask differently)."""
    impl = getattr(model.config, "_attn_implementation", "") or ""
    return rows == 1 and model.device.type == "cuda" and impl.startswith("flash_attention")


@torch.inference_mode()
def decode(
    model,
    prompts: list[list[int]],
    settings: ParallelSettings,
    *,
    tokenizer=None,
    generator: torch.Generator | None = None,
) -> tuple[list[GenerationResult], RowKVCache]:
    """The decoding loop. Also returns the KV cache (rows still in it: those that finished in the
    last step), which tests compare against a plain causal forward."""
    check_full_attention(model)
    impl = getattr(model.config, "_attn_implementation", "") or ""
    if impl.startswith("flash_attention") and len(prompts) > 1:
        raise ValueError("batched WeDLM decoding needs an explicit attention mask: load the model with sdpa or eager")
    start = time.perf_counter()
    device = model.device
    mask_id = settings.mask_token_id
    W, C = settings.window_size, settings.capacity
    budgets = [generation_budget(model, len(p), settings.max_new_tokens) for p in prompts]
    for prompt in prompts:
        check_fits(model, len(prompt), min(W, settings.max_new_tokens))
    n_rows = len(prompts)

    body, head = model.base_model, model.get_output_embeddings()
    cache = RowKVCache(
        model.config.num_hidden_layers,
        n_rows,
        capacity=max(len(p) + b for p, b in zip(prompts, budgets)) + C,
        device=device,
    )
    slot = torch.arange(C, device=device)
    stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
    budget = torch.tensor(budgets, device=device)
    window = torch.full((n_rows, C), mask_id, dtype=torch.long, device=device)
    window_len = torch.minimum(budget, torch.tensor(W, device=device))
    block_len = window_len.clone()  # size of the block being filled (block-wise only)
    emitted = torch.zeros(n_rows, dtype=torch.long, device=device)
    base = torch.tensor([len(p) for p in prompts], device=device)  # logical position of window slot 0

    rows = list(range(n_rows))  # original index of each live row
    outputs: list[list[int]] = [[] for _ in prompts]
    forwards, slots, reasons = [0] * n_rows, [0] * n_rows, [MAX_NEW_TOKENS] * n_rows
    stop_found: list[str | None] = [None] * n_rows
    first = True

    def accept(n: torch.Tensor) -> torch.Tensor:
        """Emit the first ``n[row]`` window tokens of each row (cut at a stop token); return finished rows."""
        nonlocal emitted
        stop_hit = torch.isin(window, stop_ids) & (slot < n[:, None])
        has_stop = stop_hit.any(dim=1)
        n = torch.where(has_stop, stop_hit.int().argmax(dim=1) + 1, n)
        emitted = emitted + n
        finished = has_stop | (emitted >= budget)
        n_host, done_host, stop_host = torch.stack([n, finished.long(), has_stop.long()]).tolist()
        if max(n_host) > 0:
            tokens = window[:, : max(n_host)].tolist()
        for i, row in enumerate(rows):
            if n_host[i] == 0:
                continue
            outputs[row].extend(tokens[i][: n_host[i]])
            if stop_host[i]:
                reasons[row] = STOP_TOKEN
            elif done_host[i]:
                reasons[row] = MAX_NEW_TOKENS if budgets[row] == settings.max_new_tokens else MAX_POSITIONS
            if settings.stop_strings:
                hit = find_stop_string(tokenizer, outputs[row], settings.stop_strings)
                if hit is not None:
                    del outputs[row][hit[0] :]
                    reasons[row], stop_found[row] = STOP_STRING, hit[1]
                    done_host[i] = True
        return torch.tensor(done_host, dtype=torch.bool, device=device)

    def commit_count(lead: torch.Tensor) -> torch.Tensor:
        if settings.schedule == STREAMING:
            return lead
        return torch.where(lead >= block_len, block_len, 0)

    while rows:
        # a. reorder: filled slots first, then masks, each in ascending logical position
        valid = slot < window_len[:, None]
        is_mask = (window == mask_id) & valid
        perm = (slot + C * is_mask + 2 * C * ~valid).argsort(dim=1)
        window_len_host, masks_host = torch.stack([window_len, is_mask.sum(dim=1)]).tolist()
        width = max(window_len_host)
        order = perm[:, :width]
        input_ids = window.gather(1, order)
        positions = torch.where(slot[:width] < window_len[:, None], base[:, None] + order, base[:, None])

        # b. one causal forward over the window on top of the committed cache
        if first:  # the prompt goes through in the same forward as the first window
            input_ids, positions, offsets = _prepend_prompts(prompts, input_ids, positions, mask_id)
            attention_mask = None  # all rows start at cache length 0: plain causal
        else:
            offsets = None
            attention_mask = None if _uses_mask_free_attention(model, len(rows)) else cache.attention_mask(
                width, head.weight.dtype
            )
        hidden = body(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        for i, row in enumerate(rows):
            forwards[row] += 1
            slots[row] += window_len_host[i]
        first = False

        # c. commit the leftmost filled run (block-wise: only a whole finished block)
        filled = valid & ~is_mask
        n = commit_count(filled.int().cumprod(dim=1).sum(dim=1))
        finished = accept(n)

        # d. predict the masks of this forward; only they need logits (filled slots were fed for their KV)
        n_masks = max(masks_host)
        if n_masks:
            n_filled = filled.sum(dim=1, keepdim=True)
            rank = slot[:n_masks]
            column = (n_filled + rank).clamp(max=width - 1)  # physical column of each row's rank-th mask
            candidate = (rank < (window_len[:, None] - n_filled)) & ~finished[:, None]
            logical = order.gather(1, column)
            if offsets is not None:
                column = column + offsets[:, None]
            mask_hidden = hidden.gather(1, column[..., None].expand(-1, -1, hidden.shape[-1]))
            scores = exclude_token(head(mask_hidden), mask_id)
            distance = logical - logical[:, :1]  # in window slots, from the leftmost remaining mask
            fill = select_slots(
                entropy(scores), candidate, distance, settings.entropy_threshold, settings.distance_penalty
            )
            tokens = sample_tokens(scores, settings.temperature, settings.top_k, settings.top_p, generator)
            mask_rank = (perm.argsort(dim=1) - n_filled).clamp(0, n_masks - 1)  # rank of each logical mask slot
            window = torch.where(is_mask & fill.gather(1, mask_rank), tokens.gather(1, mask_rank), window)

        # slide the window past the committed run; the cache keeps exactly that run
        source = slot + n[:, None]
        window = torch.where(source < C, window.gather(1, source.clamp(max=C - 1)), mask_id)
        window_len = window_len - n
        base = base + n
        block_len = torch.where(n > 0, window_len, block_len)

        # a finished generation needs no KV for its last run: emit it without another forward
        valid = slot < window_len[:, None]
        lead = commit_count((valid & (window != mask_id)).int().cumprod(dim=1).sum(dim=1))
        ends = (torch.isin(window, stop_ids) & (slot < lead[:, None])).any(dim=1) | (emitted + lead >= budget)
        finished |= accept(torch.where(ends & ~finished, lead, 0))

        # e. refill
        if settings.fused_refill:  # the run the next forward commits makes room for masks in it
            window_len = torch.where(lead > 0, torch.minimum(lead + W, budget - emitted), window_len)
        else:  # the n committed slots are replaced: the next forward carries W slots again
            window_len = torch.minimum(torch.full_like(window_len, W), budget - emitted)
            block_len = torch.where(n > 0, window_len, block_len)

        cache.commit(base, max(base.tolist()))
        finished_host = finished.tolist()
        if any(finished_host):
            if all(finished_host):
                break
            keep = torch.tensor([i for i, done in enumerate(finished_host) if not done], device=device)
            rows = [rows[i] for i in keep.tolist()]
            window, window_len, block_len = window[keep], window_len[keep], block_len[keep]
            emitted, budget, base = emitted[keep], budget[keep], base[keep]
            cache.keep_rows(keep, int(base.max()))

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    results = []
    for row in range(n_rows):
        results.append(
            GenerationResult(
                token_ids=outputs[row],
                num_forwards=forwards[row],
                num_slots=slots[row],
                seconds=seconds,
                method=settings.schedule,
                stop_reason=reasons[row],
                text=decode_text(tokenizer, outputs[row], stop_found[row]) if tokenizer is not None else None,
                stop_string=stop_found[row],
            )
        )
    return results, cache


def _prepend_prompts(prompts, window_ids, window_positions, pad_id):
    """First-step input per row: ``[prompt ; window]``, right-padded to a common width.

    Padding sits after every real token, so causal attention keeps it invisible; its keys are
    overwritten by the next step. Returns ids, positions and the window offset of each row.
    """
    rows, width = window_ids.shape
    lengths = [len(p) for p in prompts]
    total = max(lengths) + width
    device = window_ids.device
    ids = torch.full((rows, total), pad_id, dtype=torch.long, device=device)
    pos = torch.zeros((rows, total), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        n = lengths[i]
        ids[i, :n] = torch.tensor(prompt, device=device)
        pos[i, :n] = torch.arange(n, device=device)
        ids[i, n : n + width] = window_ids[i]
        pos[i, n : n + width] = window_positions[i]
    return ids, pos, torch.tensor(lengths, device=device)
