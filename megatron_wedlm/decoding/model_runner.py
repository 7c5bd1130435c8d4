"""Tensors and the forward of parallel decoding (nano-vllm's ``ModelRunner``).

Per step the live rows' windows go through one causal forward on top of their committed KV
cache: each row's window in reordered form (filled slots first, then masks, each in ascending
logical position) with ``position_ids`` = logical positions. HF attention builds its causal
structure from the *physical* order (the explicit 4-D mask of :class:`RowKVCache`) while RoPE
uses the logical positions, which is exactly WeDLM's topological reordering. Because the filled
slots come first, the keys/values of the leftmost filled run depend on the committed prefix and
on themselves only, so they are exact; the cache keeps them (:meth:`ModelRunner.advance`) and the
rest of the window is recomputed next step.

Only mask slots need logits (filled slots are fed for their keys/values), so the output layer
runs on the mask slots of all rows concatenated, without padding. The prompt is prefilled in
the same forward as the first window (they are contiguous, the mask is plain causal), so a
generation costs one forward fewer than "prefill, then decode".
"""

from __future__ import annotations

import torch

from .row_cache import RowKVCache
from .state import RowState


class ModelRunner:
    """Owns the model, its per-row KV cache, and the conversion of row windows to tensors."""

    def __init__(self, model, rows: list[RowState], window_size: int):
        impl = getattr(model.config, "_attn_implementation", "") or ""
        if impl.startswith("flash_attention") and len(rows) > 1:
            raise ValueError("batched WeDLM decoding needs an explicit attention mask: load the model with sdpa or eager")
        self.model, self.device = model, model.device
        self.body, self.head = model.base_model, model.get_output_embeddings()
        self.mask_id = rows[0].mask_id
        self.cache = RowKVCache(
            model.config.num_hidden_layers,
            len(rows),
            capacity=max(row.start + row.budget for row in rows) + 2 * window_size,  # + the widest window
            device=self.device,
        )
        self.prefilled = False
        # per forward: (rows, width, real slots, mask slots, sum of the rows' cache lengths); for
        # benchmarks, which compare a step with a padding-free forward of the same work
        self.steps: list[tuple[int, int, int, int, int]] = []

    @torch.no_grad()
    def forward(self, rows: list[RowState]) -> tuple[torch.Tensor, list[list[int]]]:
        """One forward over every row's reordered window (SPEC steps a, b).

        Returns the logits of all rows' mask slots, concatenated ``[slots, vocab]`` with the mask
        token excluded, and per row the window indices of those slots (ascending).
        """
        prefix = [row.prompt for row in rows] if not self.prefilled else [[] for _ in rows]
        orders = [row.reordered() for row in rows]
        width = max(len(p) + len(o) for p, o in zip(prefix, orders))
        ids, positions, columns, mask_slots = [], [], [], []
        for r, (row, order, prompt) in enumerate(zip(rows, orders, prefix)):
            window, start, pad = row.window, row.start, width - len(prompt) - len(order)
            ids.append(prompt + [window[i] for i in order] + [self.mask_id] * pad)
            positions.append(list(range(len(prompt))) + [start + i for i in order] + [start] * pad)
            masks = [k for k, i in enumerate(order) if window[i] == self.mask_id]
            columns += [r * width + len(prompt) + k for k in masks]
            mask_slots.append([order[k] for k in masks])
            row.forwards += 1
            row.slots += len(order)

        self.steps.append((len(rows), width, sum(len(p) + len(o) for p, o in zip(prefix, orders)), len(columns),
                           sum(row.cache_length for row in rows) if self.prefilled else 0))
        hidden = self.body(
            input_ids=torch.tensor(ids, device=self.device),
            position_ids=torch.tensor(positions, device=self.device),
            attention_mask=self._attention_mask(len(rows), width),
            past_key_values=self.cache,
            use_cache=True,
        ).last_hidden_state
        self.prefilled = True
        at_masks = hidden.reshape(-1, hidden.shape[-1]).index_select(
            0, torch.tensor(columns, dtype=torch.long, device=self.device)
        )
        logits = self.head(at_masks)
        logits[:, self.mask_id] = torch.finfo(logits.dtype).min  # the mask token is never an output
        return logits, mask_slots

    def _attention_mask(self, rows: int, width: int) -> torch.Tensor | None:
        if not self.prefilled:  # every row starts at cache length 0: plain causal, HF builds it
            return None
        if rows == 1 and self.device.type == "cuda" and self._flash():
            # flash-attention's causal mode aligns the queries to the *end* of the keys, which is
            # exactly our mask for a single row; never taken on CPU (eager/SDPA differ there)
            return None
        return self.cache.attention_mask(width, self.head.weight.dtype)

    def _flash(self) -> bool:
        return (getattr(self.model.config, "_attn_implementation", "") or "").startswith("flash_attention")

    def advance(self, rows: list[RowState]) -> list[RowState]:
        """Keep each row's committed prefix in the cache and drop finished rows; returns the live rows.

        When every row finished, the cache keeps them all (tests compare it with a plain forward).
        """
        self.cache.commit([row.cache_length for row in rows])
        live = [i for i, row in enumerate(rows) if not row.finished]
        if live and len(live) < len(rows):
            self.cache.keep_rows(live)
        return [rows[i] for i in live]
