"""Cut documents at block-aligned points and pack the pieces into rows of bounded length.

One rule, :func:`next_piece_length`, serves this packer and the streaming loader: pretraining
rows are filled, SFT rows next-fit so a prompt stays with its response (docs/training.md §4).
Invariants a caller relies on:

* A row of ``max_length`` slots holds at most ``max_length // 2`` tokens (two streams), in whole
  blocks, and every cut lies at a multiple of ``block_size`` from the document's start, so a
  piece's blocks are those the whole document would have had.
* Every piece is a standalone document with positions from 0: it cannot see the earlier piece's
  memory, which lives in another row.
* With ``prune_unmasked_blocks`` (docs/method.md §2.3) a piece of ``n`` tokens with ``s``
  :func:`pruned_prompt_tokens` takes ``2n - s`` slots whatever grid is drawn later, so a row never
  outgrows its slots; only a piece that ends its document is counted so.
* A piece's prompt length is the part of the prompt inside it; a prompt filling a whole row is a
  ValueError. Every token appears exactly once, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

__all__ = ["PackedRow", "next_piece_length", "pack_documents_into_rows", "piece_prompt_length",
           "pruned_prompt_tokens", "spared_places"]


def next_piece_length(
    remaining: int, space: int, capacity: int, block_size: int, *, fill: bool, spared: int = 0
) -> int:
    """Tokens of a document's ``remaining`` that go into a row with ``space`` of ``capacity`` free;
    0 means "close this row and ask again". ``fill``: pretraining (cut where the row ends), else
    next-fit. ``spared``: places the remainder saves if it goes in whole (:func:`spared_places`).
    An empty row always takes something, so the caller cannot loop.
    """
    if remaining - spared <= space and remaining <= capacity:
        return remaining
    if fill:
        return space // block_size * block_size
    return capacity if space == capacity else 0


def piece_prompt_length(prompt_length: int, start: int, piece_length: int) -> int:
    """The part of a document's prompt inside its piece ``[start, start + piece_length)``."""
    return min(max(prompt_length - start, 0), piece_length)


def pruned_prompt_tokens(prompt_length: int, block_size: int) -> int:
    """Prompt tokens whose prediction slots a pruned row leaves out, wherever the block grid
    starts: a block edge lies within ``block_size - 1`` tokens before the prompt's end, and every
    block before it holds prompt only (never masked)."""
    return max(0, prompt_length - block_size + 1)


def spared_places(prompt_length: int, block_size: int, prune: bool) -> int:
    """Token places a piece with ``prompt_length`` prompt tokens leaves free in a pruned row (two
    pruned slots are one token's place); 0 without pruning."""
    return pruned_prompt_tokens(prompt_length, block_size) // 2 if prune else 0


@dataclass
class PackedRow:
    """Pieces for one row, ready for ``build_dual_stream_batch``; ``sources[i]`` is piece i's
    (document index, start token)."""

    documents: list[Tensor] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    sources: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(d.numel() for d in self.documents)

    @property
    def row_length(self) -> int:
        """Slots the row occupies (memory + prediction streams), before padding."""
        return 2 * self.num_tokens


def pack_documents_into_rows(
    documents: Sequence[Tensor],
    max_length: int,
    block_size: int,
    prompt_lengths: Sequence[int] | None = None,
    *,
    fill: bool = False,
    prune_unmasked_blocks: bool = False,
) -> list[PackedRow]:
    """Pack ``documents``, in order, into rows that fit ``max_length`` slots, as the loader does
    (``fill=True``: pretraining; ``prune_unmasked_blocks``: the rows will be built pruned)."""
    if len(documents) == 0:
        raise ValueError("documents is empty; need at least one document to pack")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    capacity = (max_length // 2) // block_size * block_size
    if capacity < 1:
        raise ValueError(
            f"max_length {max_length} cannot hold one block of {block_size} tokens in both streams "
            f"(needs >= {2 * block_size}); raise max_length or lower block_size"
        )
    if prompt_lengths is not None and len(prompt_lengths) != len(documents):
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries for {len(documents)} documents")
    if fill and prompt_lengths is not None:
        raise ValueError(
            "fill=True cuts documents wherever a row ends and would separate prompts from their responses; "
            "pack SFT documents (prompt_lengths) with fill=False"
        )

    rows: list[PackedRow] = [PackedRow()]
    used = 0
    for index, doc in enumerate(documents):
        if not isinstance(doc, Tensor) or doc.dim() != 1:
            raise ValueError(f"document {index} must be a 1-D tensor of token ids")
        length = doc.numel()
        if length == 0:
            raise ValueError(f"document {index} is empty (length 0); remove empty documents before packing")
        prompt = 0 if prompt_lengths is None else int(prompt_lengths[index])
        if not 0 <= prompt < length:
            raise ValueError(
                f"prompt_lengths[{index}] = {prompt} must be in [0, {length}) for document {index} "
                f"of length {length}: a document needs at least one token to learn"
            )
        if prompt >= capacity:
            raise ValueError(
                f"prompt of document {index} ({prompt} tokens) fills a whole row chunk of {capacity} tokens "
                f"(max_length {max_length}); shorten the prompt or raise max_length"
            )
        start = 0
        while start < length:
            spared = spared_places(max(prompt - start, 0), block_size, prune_unmasked_blocks)
            n = next_piece_length(length - start, capacity - used, capacity, block_size, fill=fill, spared=spared)
            if n == 0:
                rows.append(PackedRow())
                used = 0
                continue
            rows[-1].documents.append(doc[start : start + n])
            rows[-1].prompt_lengths.append(piece_prompt_length(prompt, start, n))
            rows[-1].sources.append((index, start))
            start += n
            used += n - (spared if start == length else 0)  # a cut piece fills its row
    return rows
