"""Tensors and the forward of parallel decoding (nano-vllm's ``ModelRunner``).

Feeds every live row's reordered window on its KV cache with logical positions (docs/method.md
§3.1): SDPA models as one packed sequence (:mod:`.packed_attention`), eager ones as padded rows,
flash-attention one row at a time. Logits are computed for mask slots only.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from functools import partial
from itertools import accumulate, chain
from typing import NamedTuple

import torch

from .lean_body import lean_body, output_layer, project
from .packed_attention import NAME as PACKED, Packing, packed_attention
from .prefix_cache import PrefixCache
from .row_cache import RowKVCache
from .state import RowState


def cache_keyword(module) -> str:
    """The keyword of the KV cache in the model class's ``forward`` (transformers renamed it,
    and an unknown keyword drops the cache silently).
    """
    params = inspect.signature(type(module).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(module).__name__}.forward takes no KV cache (neither `cache` nor `past_key_values`)")


def packs_rows(model) -> bool:
    """Whether steps go through ``model`` as one packed sequence (SDPA models)."""
    return (getattr(model.config, "_attn_implementation", "") or "") == "sdpa"


class StepShape(NamedTuple):
    """One forward's work, for benchmarks that replay it."""

    lengths: tuple[int, ...]
    cached: tuple[int, ...]
    masks: int


class ModelRunner:
    """The model, its per-row KV cache, and row windows as tensors; a context manager."""

    def __init__(self, model, mask_id: int, batch_rows: int, capacity: int, record_steps: bool = True,
                 prefix_cache: PrefixCache | None = None):
        """A cache of ``batch_rows`` rows of ``capacity`` slots.

        ``record_steps=False`` keeps no :attr:`steps`; ``prefix_cache`` serves joining rows.
        ValueError for a flash-attention model with several rows (it needs an explicit mask).
        """
        impl = getattr(model.config, "_attn_implementation", "") or ""
        if impl.startswith("flash_attention") and batch_rows > 1:
            raise ValueError("batched WeDLM decoding needs an explicit attention mask: load the model with sdpa or eager")
        self.model, self.device = model, model.device
        self.mask_id = mask_id
        self.packable = packs_rows(model)
        # packed steps of a Llama-family model skip HF's per-module Python (lean_body.py); the
        # reason it does not apply, where it does not, is kept for benchmarks and logs
        lean, self.lean_refusal = lean_body(model) if self.packable else (None, "not a packed (sdpa) model")
        self.body = lean or model.base_model
        self.cache_keyword = cache_keyword(self.body)
        head = model.get_output_embeddings()
        self.head = partial(project, output_layer(head))
        self.cache = RowKVCache(model.config.num_hidden_layers, batch_rows, capacity=capacity, device=self.device)
        self.dtype = head.weight.dtype
        self._scope = ExitStack()
        # the shape of every forward, for benchmarks that replay the same work without the decoding
        self.steps: list[StepShape] = []
        self.record_steps = record_steps
        self.prefix_cache = prefix_cache

    @classmethod
    def for_rows(cls, model, rows: list[RowState], window_size: int, batch_rows: int | None = None) -> "ModelRunner":
        """A runner sized for ``rows``; ``batch_rows`` of them (default all) live at once."""
        batch_rows = len(rows) if batch_rows is None else min(batch_rows, len(rows))
        # A padded forward writes every row up to the longest committed row plus the widest input;
        # a row joining mid-decode brings its whole prompt as input.
        joining = max(len(row.prompt) for row in rows) if batch_rows < len(rows) and not packs_rows(model) else 0
        capacity = max(row.start + row.budget for row in rows) + 2 * window_size + joining  # + the widest window
        return cls(model, rows[0].mask_id, batch_rows, capacity)

    def __enter__(self) -> "ModelRunner":
        if self.packable:
            self._scope.enter_context(packed_attention(self.model))
        return self

    def __exit__(self, *exc) -> None:
        self._scope.close()

    @torch.no_grad()
    def forward(self, rows: list[RowState]) -> tuple[torch.Tensor, list[list[int]], list[int]]:
        """One forward over every row's reordered window; changes no row.

        Returns the mask slots' logits ``[slots, vocab]`` (mask token excluded), per row their
        window indices (ascending), and per row the generated slots it fed.
        """
        ids, positions, columns, mask_slots, cached, fresh_rows, fed = [], [], [], [], [], [], []
        for b, row in enumerate(rows):
            fresh = row.forwards == 0  # its prompt is prefilled in its first forward, past what was reused
            skip = row.reused if fresh else 0
            prompt = row.prompt[skip:] if fresh else []
            cached.append(skip if fresh else row.cache_length)
            if fresh:
                fresh_rows.append(b)
            window, start, order = row.window, row.start, row.reordered()
            masks = [k for k, i in enumerate(order) if window[i] == self.mask_id]
            if row.autoregressive:  # a next-token row feeds its filled run; its last token predicts the first mask
                order = order[: masks[0]]
                columns.append([len(prompt) + len(order) - 1])
                mask_slots.append([len(order)])
                fed.append(1)  # AR's N_fwd: one generated slot per forward (result.py)
            else:
                columns.append([len(prompt) + k for k in masks])
                mask_slots.append([order[k] for k in masks])
                fed.append(len(order))
            ids.append(prompt + [window[i] for i in order])
            positions.append(list(range(skip, skip + len(prompt))) + [start + i for i in order])
        lengths = [len(t) for t in ids]
        width = max(lengths)
        if self.record_steps:
            self.steps.append(StepShape(tuple(lengths), tuple(cached), sum(map(len, columns))))

        if self.packable:  # no padding: one packed sequence, attention per row (packed_attention.py)
            packing = Packing.build(lengths, cached, self.cache, self.dtype)
            offsets = list(accumulate(lengths[:-1], initial=0))
            ids, positions = [list(chain.from_iterable(ids))], [list(chain.from_iterable(positions))]
            mask = None
        else:  # right-padded rows; padding sits after every real token, so causal attention hides it
            packing, offsets = None, [r * width for r in range(len(rows))]
            ids = [t + [max(self.mask_id, 0)] * (width - len(t)) for t in ids]  # any id: never attended to
            positions = [p + [p[-1]] * (width - len(p)) for p in positions]
            mask = self._attention_mask(len(rows), width, fresh=not any(cached))
        if packing is not None and self.model.config._attn_implementation != PACKED:
            raise RuntimeError("ModelRunner.forward runs inside `with runner:` (it switches on the packed attention)")
        self.cache.packing = packing
        hidden = self.body(
            input_ids=torch.tensor(ids, device=self.device),
            position_ids=torch.tensor(positions, device=self.device),
            attention_mask=mask,
            use_cache=True,
            **{self.cache_keyword: self.cache},
            **({"wedlm_packing": packing} if packing else {}),
        ).last_hidden_state
        self.cache.packing = None
        if self.prefix_cache is not None:  # their prompts' keys/values are exact now: keep new full blocks
            for b in fresh_rows:
                self.prefix_cache.store(rows[b].prompt, self.cache, b)
        columns = [offset + k for offset, row_columns in zip(offsets, columns) for k in row_columns]
        at_masks = hidden.reshape(-1, hidden.shape[-1]).index_select(
            0, torch.tensor(columns, dtype=torch.long, device=hidden.device)  # the last layer's (device_map)
        )
        logits = self.head(at_masks)
        if self.mask_id >= 0:  # AR rows of a model without one have none (batch.NO_MASK)
            logits[:, self.mask_id] = torch.finfo(logits.dtype).min  # the mask token is never an output
        return logits, mask_slots, fed

    def _attention_mask(self, rows: int, width: int, fresh: bool) -> torch.Tensor | None:
        if fresh:  # every row starts at cache length 0: plain causal, HF builds it
            return None
        if rows == 1 and self.device.type == "cuda" and self._flash():
            # flash-attention's causal mode aligns the queries to the *end* of the keys, which is
            # exactly our mask for a single row; never taken on CPU (eager/SDPA differ there)
            return None
        return self.cache.attention_mask(width, self.dtype)

    def _flash(self) -> bool:
        return (getattr(self.model.config, "_attn_implementation", "") or "").startswith("flash_attention")

    def advance(self, rows: list[RowState], joining: list[RowState] | tuple = ()) -> list[RowState]:
        """Keep the committed prefixes, drop finished rows, take in ``joining`` ones; returns the
        live rows in cache-row order. With all finished and none joining, the cache keeps them all.
        """
        finished = [i for i, row in enumerate(rows) if row.finished]
        taken = dict(zip(finished, joining))
        extra = list(joining[len(taken):])
        self.cache.commit([0 if i in taken else row.cache_length for i, row in enumerate(rows)])
        live = [taken.get(i, row) for i, row in enumerate(rows)]
        left = set(finished[len(taken):])
        if left and (extra or len(left) < len(live)):  # all finished and none joins: the cache keeps them
            keep = [i for i in range(len(live)) if i not in left]
            self.cache.keep_rows(keep)
            live = [live[i] for i in keep]
        elif left:
            live = []
        if extra:
            self.cache.add_rows(len(extra))
            live += extra
        if self.prefix_cache is not None and joining:
            self._reuse_prefixes(live, joining)
        return live

    def _reuse_prefixes(self, live: list[RowState], joining) -> None:
        """Copy each joining row's cached prompt prefix into its cache row and commit it."""
        new = {id(row) for row in joining}
        lengths = list(self.cache.host_lengths)
        for i, row in enumerate(live):
            if id(row) in new:
                row.reused = lengths[i] = self.prefix_cache.load(row.prompt, self.cache, i)
        if lengths != self.cache.host_lengths:
            self.cache.commit(lengths)
