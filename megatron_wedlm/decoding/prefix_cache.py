"""Automatic prefix caching: prompt keys/values kept across requests, in blocks of 16 tokens.

Blocks are keyed exactly by ``(parent serial, tokens)``, held within ``max_bytes``, evicted
least recently used, leaf first; how and why: docs/serving.md, "Prefix caching".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .row_cache import RowKVCache

BLOCK_SIZE = 16
_ROOT = -1  # the parent serial of a prompt's first block


class _Block:
    __slots__ = ("key", "serial", "parent", "keys", "values", "children", "nbytes")

    def __init__(self, key: tuple, serial: int, parent: "_Block | None", keys: torch.Tensor, values: torch.Tensor):
        self.key, self.serial, self.parent = key, serial, parent
        self.keys, self.values = keys, values  # [layers, kv_heads, block, head_dim]
        self.children = 0
        self.nbytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()


@dataclass
class PrefixCacheStats:
    """Counters for ``/metrics``, written by the engine thread only."""

    prompt_tokens: int = 0  # tokens of the prompts looked up
    hit_tokens: int = 0  # of them, copied from the cache instead of computed
    stored_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE):
        if max_bytes <= 0 or block_size < 1:
            raise ValueError(f"a prefix cache needs max_bytes > 0 and block_size >= 1, got {max_bytes}, {block_size}")
        self.max_bytes, self.block_size = int(max_bytes), block_size
        self.bytes = 0
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()  # oldest first; a block after its descendants
        self._serials = itertools.count()

    def __len__(self) -> int:
        return len(self._blocks)

    # ---- the requests' side ----------------------------------------------------------------------
    def match(self, prompt: list[int], max_blocks: int | None = None) -> list[_Block]:
        """The held blocks starting ``prompt`` (at most ``max_blocks``), now most recently used."""
        size = self.block_size
        limit = len(prompt) // size if max_blocks is None else min(max_blocks, len(prompt) // size)
        chain, parent = [], _ROOT
        for k in range(limit):
            block = self._blocks.get((parent, tuple(prompt[k * size : (k + 1) * size])))
            if block is None:
                break
            chain.append(block)
            parent = block.serial
        self._touch(chain)
        return chain

    def load(self, prompt: list[int], cache: RowKVCache, row: int) -> int:
        """Copy ``prompt``'s longest held run into ``row`` of ``cache``, leaving its last token.

        Returns the tokens copied; the caller sets the row's committed length.
        """
        self.stats.prompt_tokens += len(prompt)
        if not cache.layers or not cache.layers[0].is_initialized:  # nothing decoded yet: nothing held
            return 0
        chain = self.match(prompt, (len(prompt) - 1) // self.block_size)
        if not chain:
            return 0
        n = len(chain) * self.block_size
        keys = torch.cat([block.keys for block in chain], dim=2)  # [layers, kv_heads, n, head_dim]
        values = torch.cat([block.values for block in chain], dim=2)
        for index, layer in enumerate(cache.layers):  # one copy per layer and tensor
            layer.keys[row, :, :n].copy_(keys[index])
            layer.values[row, :, :n].copy_(values[index])
        self.stats.hit_tokens += n
        return n

    def store(self, prompt: list[int], cache: RowKVCache, row: int) -> int:
        """Keep ``prompt``'s new full blocks from ``row`` of ``cache`` (its exact keys/values).

        Evicts least recently used leaves, never the prompt's own; returns the blocks added.
        """
        size = self.block_size
        chain = self.match(prompt)
        first, last = len(chain), len(prompt) // size
        if first == last:
            return 0
        parent = chain[-1] if chain else None
        added, nbytes = 0, self._block_bytes(cache)
        # the new blocks of every layer in one tensor, [layers, kv_heads, tokens, head_dim], then one copy per block
        span = slice(first * size, last * size)
        keys = torch.stack([layer.keys[row, :, span] for layer in cache.layers])
        values = torch.stack([layer.values[row, :, span] for layer in cache.layers])
        for k in range(last - first):
            if not self._make_room(nbytes, keep=parent):
                break
            start, end = (first + k) * size, (first + k + 1) * size
            key = (_ROOT if parent is None else parent.serial, tuple(prompt[start:end]))
            block = _Block(key, next(self._serials), parent, keys[:, :, k * size : (k + 1) * size].clone(),
                           values[:, :, k * size : (k + 1) * size].clone())
            self._blocks[key] = block
            self.bytes += block.nbytes
            if parent is not None:
                parent.children += 1
            chain.append(block)
            parent = block
            added += 1
        self._touch(chain)  # the new blocks went in parent first: restore "a block after its descendants"
        self.stats.stored_blocks += added
        return added

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _block_bytes(self, cache: RowKVCache) -> int:
        per_token = sum(layer.keys[0, :, 0].numel() * layer.keys.element_size()
                        + layer.values[0, :, 0].numel() * layer.values.element_size() for layer in cache.layers)
        return per_token * self.block_size

    def _make_room(self, nbytes: int, keep: _Block | None) -> bool:
        """Evict until ``nbytes`` more fit; False when only ``keep``'s chain is left."""
        if nbytes > self.max_bytes:
            return False
        while self.bytes + nbytes > self.max_bytes:
            oldest = next(iter(self._blocks.values()))
            if oldest is keep or oldest.children:  # the chain being extended: nothing else to evict
                return False
            self._evict(oldest)
        return True

    def _evict(self, block: _Block) -> None:
        del self._blocks[block.key]
        self.bytes -= block.nbytes
        if block.parent is not None:
            block.parent.children -= 1
        self.stats.evictions += 1

    def check(self) -> None:
        """Assert the invariants (for tests)."""
        position = {block.serial: i for i, block in enumerate(self._blocks.values())}
        children: dict[int, int] = {}
        for block in self._blocks.values():
            if block.parent is not None:
                assert block.parent.serial in position, "a block is held without its parent"
                assert position[block.parent.serial] > position[block.serial], "a parent is older than its child"
                children[block.parent.serial] = children.get(block.parent.serial, 0) + 1
            assert block.key[0] == (_ROOT if block.parent is None else block.parent.serial)
        assert all(block.children == children.get(block.serial, 0) for block in self._blocks.values())
        assert self.bytes == sum(block.nbytes for block in self._blocks.values()) <= self.max_bytes
