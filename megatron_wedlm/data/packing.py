"""Split long documents and pack them into dual-stream rows of bounded length.

A dual-stream row spends 2 slots per token (memory + prediction), so a row capped at
``max_length`` slots holds at most ``max_length // 2`` tokens.

How documents are split (the choice, and why):

* A document longer than ``chunk = (max_length // 2) // block_size * block_size`` tokens is cut
  into consecutive block-aligned chunks of ``chunk`` tokens (the last one shorter). Block
  alignment keeps the chunk's masking blocks identical to the blocks the whole document
  would have had.
* Each chunk becomes a standalone document with positions from 0: a chunk cannot see the
  earlier chunk's memory (it lives in another row), so giving it the original positions would
  train the model on contexts that never occur at inference. This is the usual
  truncate-and-continue treatment of over-long pretraining documents.
* SFT prompts are a prefix, so only the first chunk(s) can hold prompt tokens: a chunk's
  prompt length is the part of the prompt inside it. A prompt that fills a whole chunk
  leaves that chunk nothing to learn and is rejected (ValueError) rather than silently
  dropped; later chunks of a split SFT answer are trained without the prompt in view.
* Chunks are packed in order (next-fit): a chunk goes into the current row if it fits, else
  a new row starts. Every token of every document appears exactly once.

The only loop is over documents/chunks (O(number of chunks)); no per-token work in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

__all__ = ["PackedRow", "pack_documents_into_rows"]


@dataclass
class PackedRow:
    """Documents (chunks) for one row, ready for ``build_dual_stream_batch``.

    ``sources[i] = (document index, start token)`` says where chunk i came from.
    """

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
) -> list[PackedRow]:
    """Split documents into block-aligned chunks of at most ``max_length // 2`` tokens, pack rows.

    Returns rows whose ``row_length <= max_length``; build each with
    ``build_dual_stream_batch(row.documents, prompt_lengths=row.prompt_lengths, ...)``.
    """
    if len(documents) == 0:
        raise ValueError("documents is empty; need at least one document to pack")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    chunk = (max_length // 2) // block_size * block_size
    if chunk < 1:
        raise ValueError(
            f"max_length {max_length} cannot hold one block of {block_size} tokens in both streams "
            f"(needs >= {2 * block_size}); raise max_length or lower block_size"
        )
    if prompt_lengths is not None and len(prompt_lengths) != len(documents):
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries for {len(documents)} documents")

    rows: list[PackedRow] = [PackedRow()]
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
        if prompt >= chunk:
            raise ValueError(
                f"prompt of document {index} ({prompt} tokens) fills a whole row chunk of {chunk} tokens "
                f"(max_length {max_length}); shorten the prompt or raise max_length"
            )
        for start in range(0, length, chunk):
            piece = doc[start : start + chunk]
            if rows[-1].num_tokens + piece.numel() > chunk:
                rows.append(PackedRow())
            rows[-1].documents.append(piece)
            rows[-1].prompt_lengths.append(min(max(prompt - start, 0), piece.numel()))
            rows[-1].sources.append((index, start))
    return rows
