"""A KV cache in which every batch row has its own committed length (HF's ``DynamicCache`` has one).

Buffers are allocated once; a forward writes row ``b`` from slot ``lengths[b]`` on, and
:meth:`RowKVCache.commit` advances ``lengths``. Invariant: new query ``i`` of row ``b`` sees key
``j`` iff ``j <= lengths[b] + i``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _RowLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: "RowKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads = self.owner.buffer_rows, key_states.shape[1]
        shape_k = (rows, heads, self.owner.capacity, key_states.shape[-1])
        shape_v = (rows, heads, self.owner.capacity, value_states.shape[-1])
        self.keys = torch.zeros(shape_k, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape_v, dtype=value_states.dtype, device=value_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        packing, rows = self.owner.packing, len(self.owner.host_lengths)
        if packing is not None:  # one packed row [1, kv_heads, T, dim]: token t goes to its row and slot
            end = self._check(packing.end)
            if packing.uniform:  # every row writes the same slots: a slice copy
                start = packing.cached
                self.keys[:rows, :, start:end] = key_states[0].unflatten(1, (rows, -1)).transpose(0, 1)
                self.values[:rows, :, start:end] = value_states[0].unflatten(1, (rows, -1)).transpose(0, 1)
            else:
                # the index tensors live on the first layer's device; a model placed over several
                # devices (device_map) holds this layer elsewhere (``.to`` is free on the same device)
                row_of, slot_of = packing.row_of.to(self.keys.device), packing.slot_of.to(self.keys.device)
                self.keys[row_of, :, slot_of] = key_states[0].transpose(0, 1)
                self.values[row_of, :, slot_of] = value_states[0].transpose(0, 1)
        elif self.owner.uniform:  # padded rows [rows, kv_heads, width, dim], all at the same length
            start = self.owner.max_length
            end = self._check(start + key_states.shape[-2])
            self.keys[:rows, :, start:end] = key_states
            self.values[:rows, :, start:end] = value_states
        else:
            end = self._check(self.owner.max_length + key_states.shape[-2])
            lengths = self.owner.lengths.to(key_states.device)  # see above: device_map
            slots = lengths[:, None] + torch.arange(key_states.shape[-2], device=key_states.device)
            self.keys[:rows].scatter_(2, slots[:, None, :, None].expand_as(key_states), key_states)
            self.values[:rows].scatter_(2, slots[:, None, :, None].expand_as(value_states), value_states)
        return self.keys[:rows, :, :end], self.values[:rows, :, :end]

    def _check(self, end: int) -> int:
        if end > self.owner.capacity:
            raise RuntimeError(f"RowKVCache capacity {self.owner.capacity} exceeded (needs {end})")
        return end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.max_length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def move_row(self, source: int, target: int, length: int) -> None:
        if self.is_initialized:
            self.keys[target, :, :length] = self.keys[source, :, :length]
            self.values[target, :, :length] = self.values[source, :, :length]


class RowKVCache(Cache):
    """HF ``Cache`` with per-row committed lengths.

    ``capacity`` covers the longest committed prefix plus the widest input of one forward; rows
    leave and join without reallocating.
    """

    def __init__(self, num_layers: int, num_rows: int, capacity: int, device: torch.device | str):
        self.capacity = capacity
        self.buffer_rows = num_rows
        self.lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * num_rows  # host copy of lengths, so no step needs a device sync
        self.max_length = 0  # max(host_lengths)
        self.uniform = True  # all rows at max_length (host-side), so writes need no per-row index
        self.packing = None  # set for a packed forward (see packed_attention.py)
        self._bands: dict[torch.dtype, torch.Tensor] = {}  # see causal_mask
        super().__init__(layers=[_RowLayer(self) for _ in range(num_layers)])

    def commit(self, lengths: list[int]) -> None:
        """Set each row's committed length; later slots go unseen."""
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.lengths.device)
        self.host_lengths = list(lengths)
        self.max_length = max(lengths, default=0)
        self.uniform = min(lengths, default=0) == self.max_length

    def keep_rows(self, rows: list[int]) -> None:
        """Keep ``rows`` (ascending), moved to the front; the others leave."""
        for target, source in enumerate(rows):
            if source != target:
                for layer in self.layers:
                    layer.move_row(source, target, self.host_lengths[source])
        self.commit([self.host_lengths[i] for i in rows])

    def add_rows(self, count: int) -> None:
        """Take ``count`` more rows into use, at length 0."""
        if len(self.host_lengths) + count > self.buffer_rows:
            raise ValueError(f"{len(self.host_lengths)} + {count} rows exceed the cache's {self.buffer_rows} rows")
        self.commit(self.host_lengths + [0] * count)

    def attention_mask(self, query_length: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[rows, 1, queries, keys]`` mask of right-padded rows (eager and SDPA)."""
        mask = torch.full((len(self.host_lengths), query_length, self.max_length + query_length),
                          torch.finfo(dtype).min, dtype=dtype, device=self.lengths.device)
        for b, cached in enumerate(self.host_lengths):
            mask[b, :, : cached + query_length] = self.causal_mask(cached, query_length, dtype)
        return mask[:, None]

    def causal_mask(self, cached: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[length, cached + length]`` mask of one row, a view of a cached band."""
        band = self._bands.get(dtype)
        if band is None or band.shape[0] < length:
            width = max(length, 64)
            queries = torch.arange(width, device=self.lengths.device)[:, None]
            columns = torch.arange(self.capacity + width, device=self.lengths.device)
            band = torch.zeros(width, self.capacity + width, dtype=dtype, device=self.lengths.device)
            band.masked_fill_(columns > self.capacity + queries, torch.finfo(dtype).min)
            self._bands[dtype] = band
        return band[:length, self.capacity - cached : self.capacity + length]

    def committed_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = int(self.lengths[row])
        return [(layer.keys[row, :, :n], layer.values[row, :, :n]) for layer in self.layers]
