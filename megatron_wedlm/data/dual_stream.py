"""Dual-stream WeDLM training rows (docs/method.md §2.1), built with tensor ops only.

A row packs documents as ``[xo_0 ; xt_0 ; xo_1 ; xt_1 ; ...]``: the memory stream in order, then
the prediction stream cut into blocks, masked and reordered (observed first, then masked). Each
field of :class:`.row_format.RowFormat` switches one rule, given with its reason in method.md
(``random_block_offset``: §2.2; ``prune_unmasked_blocks``: §2.3; ``mask_after_masked_end``: §2.1).
What a caller relies on:

* Draws from ``generator``, in this order: one offset per document (only with
  ``random_block_offset``, so default rows are unchanged), the gammas (per block or per document),
  one key per token, then one float per block when ``0 < mask_after_masked_end < 1``. Same state
  and inputs -> same row; :mod:`.seeding` gives each rank and step its own stream.
* Masked count per block: ``floor(gamma * maskable + 0.5)`` in float64; never above the
  maskable count, possibly 0.
* SFT: the first ``prompt_lengths[i]`` tokens of document i are never masked nor a target.
* Padding slots: ``doc_ids = -1``, ``position_ids = block_ids = 0``, the pad token, no loss.
* ``mlm_weights`` (``1/gamma`` on masked slots) are unnormalised: the loss normalises over the
  global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
from torch import Tensor

from .attention_rule import AttentionMetadata, build_block_mask, dense_attention_mask
from .row_format import RowFormat

__all__ = [
    "DualStreamBatch",
    "build_dual_stream_batch",
    "build_memory_only_row",
    "pad_dual_stream_batch",
    "stack_dual_stream_batches",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100
_KEY_BITS = 31  # random selection keys live in [0, 2^31); prompt tokens get keys >= 2^31


@dataclass
class DualStreamBatch:
    """One packed row (tensors ``[S]``) or a stack of rows (``[B, S]``), all tensors one shape.

    ``position_ids`` are logical (RoPE), ``target_ids`` the original token of every slot,
    ``doc_ids`` -1 on padding, ``mask_ratio`` gamma on prediction slots (0 elsewhere),
    ``ar_labels`` the next token on memory slots (-100 where none or a prompt token).
    """

    input_ids: Tensor
    position_ids: Tensor
    is_memory: Tensor
    is_masked: Tensor
    target_ids: Tensor
    doc_ids: Tensor
    block_ids: Tensor
    mask_ratio: Tensor
    mlm_weights: Tensor
    ar_labels: Tensor
    is_padding: Tensor
    block_size: int
    mask_token_id: int
    pad_token_id: int

    @classmethod
    def tensor_field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.type in ("Tensor", Tensor))

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[-1]

    def attention_metadata(self) -> AttentionMetadata:
        """Per-slot metadata for the attention backends (see :mod:`.attention_rule`)."""
        return AttentionMetadata(doc_ids=self.doc_ids, is_memory=self.is_memory, block_ids=self.block_ids)

    def dense_attention_mask(self, padding_attends_self: bool = False) -> Tensor:
        """Bool ``[S, S]`` (``[B, S, S]`` stacked), True = may attend; ``padding_attends_self``
        keeps softmax backends from NaN on padding rows (docs/method.md §2.3)."""
        return dense_attention_mask(self.attention_metadata(), padding_attends_self)

    def block_mask(self, tile_size: int = 128, padding_attends_self: bool = False):
        """FlexAttention BlockMask for this batch (metadata must be on the kernel's device)."""
        return build_block_mask(self.attention_metadata(), tile_size, padding_attends_self)

    def to(self, device: torch.device | str) -> "DualStreamBatch":
        return self._with_tensors(lambda t: t.to(device))

    def select_slots(self, slots: Tensor) -> "DualStreamBatch":
        """The rows restricted to physical slots ``slots`` (context parallelism). The slots lose
        their physical index, so build a selection's mask from the full row's metadata."""
        return self._with_tensors(lambda t: t.index_select(-1, slots.to(t.device)))

    def _with_tensors(self, change) -> "DualStreamBatch":
        changed = {name: change(getattr(self, name)) for name in self.tensor_field_names()}
        return DualStreamBatch(
            **changed, block_size=self.block_size, mask_token_id=self.mask_token_id, pad_token_id=self.pad_token_id
        )


def _as_token_tensor(doc: object, index: int) -> Tensor:
    if not isinstance(doc, Tensor):
        raise ValueError(f"document {index} is a {type(doc).__name__}; expected a 1-D integer torch tensor")
    if doc.dim() != 1:
        raise ValueError(f"document {index} has shape {tuple(doc.shape)}; expected a 1-D tensor of token ids")
    if doc.dtype.is_floating_point or doc.dtype.is_complex or doc.dtype == torch.bool:
        raise ValueError(f"document {index} has dtype {doc.dtype}; expected integer token ids")
    if doc.numel() == 0:
        raise ValueError(f"document {index} is empty (length 0); remove empty documents before packing")
    return doc


def _validate_padding(pad_to: int | None, pad_to_multiple_of: int | None) -> None:
    if pad_to is not None and pad_to_multiple_of is not None:
        raise ValueError("give either pad_to or pad_to_multiple_of, not both")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of!r}")


def _prompt_tensor(prompt_lengths: Sequence[int] | Tensor | None, lengths: Tensor) -> Tensor:
    num_docs = lengths.numel()
    if prompt_lengths is None:
        return torch.zeros(num_docs, dtype=torch.long)
    prompts = torch.as_tensor(prompt_lengths, dtype=torch.long).reshape(-1)
    if prompts.numel() != num_docs:
        raise ValueError(f"prompt_lengths has {prompts.numel()} entries for {num_docs} documents")
    bad = (prompts < 0).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"prompt_lengths[{i}] = {int(prompts[i])} is negative")
    bad = (prompts >= lengths).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"prompt_lengths[{i}] = {int(prompts[i])} >= length {int(lengths[i])} of document {i}: "
            "no token left to learn; drop the document or shorten its prompt"
        )
    return prompts


def _padded_length(length: int, pad_to: int | None, pad_to_multiple_of: int | None, max_length: int | None) -> int:
    if max_length is not None and length > max_length:
        raise ValueError(
            f"row length {length} (memory + prediction streams) exceeds "
            f"max_length {max_length}; split documents with pack_documents_into_rows"
        )
    target = length
    if pad_to is not None:
        if pad_to < length:
            raise ValueError(f"pad_to {pad_to} is shorter than the row length {length}")
        target = pad_to
    elif pad_to_multiple_of is not None:
        target = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    if max_length is not None and target > max_length:
        raise ValueError(f"padded row length {target} exceeds max_length {max_length}")
    return target


#: What a padding slot holds in each tensor field (``input_ids`` and ``target_ids``: the pad token).
_PAD_VALUES = {
    "position_ids": 0,
    "is_memory": False,
    "is_masked": False,
    "doc_ids": -1,
    "block_ids": 0,
    "mask_ratio": 0.0,
    "mlm_weights": 0.0,
    "ar_labels": IGNORE_INDEX,
    "is_padding": True,
}
_FIELD_DTYPES = {
    "input_ids": torch.long,
    "position_ids": torch.long,
    "is_memory": torch.bool,
    "is_masked": torch.bool,
    "target_ids": torch.long,
    "doc_ids": torch.long,
    "block_ids": torch.long,
    "mask_ratio": torch.float32,
    "mlm_weights": torch.float32,
    "ar_labels": torch.long,
    "is_padding": torch.bool,
}


def _padding_slots(length: int, pad_token_id: int) -> dict[str, Tensor]:
    """The tensor fields of a row of ``length`` padding slots, for a builder to write its tokens into."""
    return {
        name: torch.full((length,), _PAD_VALUES.get(name, pad_token_id), dtype=dtype)
        for name, dtype in _FIELD_DTYPES.items()
    }


@dataclass
class _DocumentTokens:
    """Documents concatenated into one token tensor (global token index t), and what each token
    takes from its document."""

    tokens: Tensor  # [T]
    lengths: Tensor  # [D] tokens per document
    doc: Tensor  # [T] document of each token
    start: Tensor  # [T] index t of its document's first token
    position: Tensor  # [T] logical position in its document
    prompt_length: Tensor  # [T] prompt length of its document
    ar_labels: Tensor  # [T] the next token of its document; IGNORE_INDEX after the last one or on a prompt token

    @property
    def is_prompt(self) -> Tensor:
        return self.position < self.prompt_length


def _document_tokens(tokens: Tensor, lengths: Tensor, prompts: Tensor) -> _DocumentTokens:
    """What each token of ``tokens`` takes from its document: the documents (``lengths`` tokens each,
    the first ``prompts`` of them a prompt) concatenated. Both row builders derive it here."""
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    start = (lengths.cumsum(0) - lengths)[doc]
    position = torch.arange(tokens.numel()) - start
    prompt_length = prompts[doc]
    next_position = position + 1
    has_next = (next_position < lengths[doc]) & (next_position >= prompt_length)
    next_token = torch.cat([tokens[1:], tokens.new_full((1,), IGNORE_INDEX)])
    ar_labels = torch.where(has_next, next_token, torch.full_like(tokens, IGNORE_INDEX))
    return _DocumentTokens(tokens, lengths, doc, start, position, prompt_length, ar_labels)


@dataclass
class _BlockGrid:
    """The blocks of the prediction streams, numbered across documents (a block never spans two)."""

    of_token: Tensor  # [T] global block of each token
    in_document: Tensor  # [T] block of each token within its document
    per_document: Tensor  # [D] blocks per document
    length: Tensor  # [K] tokens per block
    start: Tensor  # [K] index t of each block's first token
    maskable: Tensor  # [K] non-prompt tokens per block (float64)


def _concatenate(documents: Sequence[Tensor], mask_token_id: int) -> tuple[Tensor, Tensor]:
    """``(tokens, lengths)``: the checked documents as one CPU long tensor, and their lengths."""
    docs = [_as_token_tensor(d, i) for i, d in enumerate(documents)]
    tokens = torch.cat([d.to(device="cpu", dtype=torch.long) for d in docs])
    lengths = torch.tensor([d.numel() for d in docs], dtype=torch.long)
    hits = (tokens == mask_token_id).nonzero()
    if hits.numel():
        doc = int(torch.searchsorted(lengths.cumsum(0), hits[0], right=True))
        raise ValueError(
            f"mask_token_id {mask_token_id} occurs inside document {doc}; the mask token must not "
            "appear in training text (filter or remap it)"
        )
    return tokens, lengths


def _draw_offsets(
    num_docs: int, block_size: int, random_block_offset: bool, generator: torch.Generator | None
) -> Tensor:
    """How many positions before its first token each document's block grid starts."""
    if random_block_offset:
        return torch.randint(0, block_size, (num_docs,), generator=generator)
    return torch.zeros(num_docs, dtype=torch.long)


def _block_grid(docs: _DocumentTokens, block_size: int, offset: Tensor) -> _BlockGrid:
    offset_of_token = offset[docs.doc]
    per_document = (docs.lengths + offset + block_size - 1) // block_size
    first_block_of_doc = per_document.cumsum(0) - per_document
    in_document = (docs.position + offset_of_token) // block_size
    of_token = first_block_of_doc[docs.doc] + in_document
    num_blocks = int(per_document.sum())
    length = torch.bincount(of_token, minlength=num_blocks)
    maskable = torch.bincount(of_token, weights=(~docs.is_prompt).double(), minlength=num_blocks)
    return _BlockGrid(of_token, in_document, per_document, length, length.cumsum(0) - length, maskable)


def _draw_gammas(blocks: _BlockGrid, ratio_mode: str, eps: float, generator: torch.Generator | None) -> Tensor:
    """The mask ratio of each block, ``1 - U[0, 1)`` clamped to ``>= eps`` (float64, ``[K]``)."""
    if ratio_mode == "block":
        gamma = 1.0 - torch.rand(blocks.length.numel(), generator=generator, dtype=torch.float64)
    else:
        per_doc = 1.0 - torch.rand(blocks.per_document.numel(), generator=generator, dtype=torch.float64)
        gamma = torch.repeat_interleave(per_doc, blocks.per_document)
    return gamma.clamp(min=eps)


def _choose_masked(
    docs: _DocumentTokens, blocks: _BlockGrid, gamma: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """``(is_masked [T], masked per block [K])``: in each block the ``round(gamma * maskable)``
    maskable tokens with the smallest random keys (prompt tokens get keys above every drawn one)."""
    num_tokens = docs.tokens.numel()
    num_masked = torch.floor(gamma * blocks.maskable + 0.5).long()
    keys = torch.randint(0, 2**_KEY_BITS, (num_tokens,), generator=generator, dtype=torch.long)
    keys = torch.where(docs.is_prompt, torch.full_like(keys, 2**_KEY_BITS), keys)
    order = torch.argsort((blocks.of_token << (_KEY_BITS + 1)) | keys, stable=True)
    rank_in_block = torch.arange(num_tokens) - blocks.start[blocks.of_token[order]]
    is_masked = torch.empty(num_tokens, dtype=torch.bool)
    is_masked[order] = rank_in_block < num_masked[blocks.of_token[order]]
    return is_masked, num_masked


def _mask_after_masked_end(
    docs: _DocumentTokens,
    blocks: _BlockGrid,
    is_masked: Tensor,
    end_token_id: int,
    probability: float,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """``(is_masked, masked per block)``: in each block drawn with ``probability``, every
    non-prompt token after a masked ``end_token_id`` is masked too."""
    masked_end = (is_masked & (docs.tokens == end_token_id) & ~docs.is_prompt).long()
    seen = torch.cumsum(masked_end, 0) - masked_end  # masked ends strictly before each token
    seen = seen - seen[blocks.start[blocks.of_token]]  # ... within its block
    added = (seen > 0) & ~docs.is_prompt
    if probability < 1.0:  # nothing drawn at 1: every block, the same rows as the rule without a share
        chosen = torch.rand(blocks.length.numel(), generator=generator, dtype=torch.float64) < probability
        added &= chosen[blocks.of_token]
    is_masked = is_masked | added
    num_masked = torch.bincount(blocks.of_token, weights=is_masked.double(), minlength=blocks.length.numel())
    return is_masked, num_masked.long()


def _reordered_places(blocks: _BlockGrid, is_masked: Tensor, num_masked: Tensor) -> Tensor:
    """Index t of each token's place once every block is reordered (observed, then masked);
    exclusive cumsums rank each token in its group without sorting."""
    observed = ~is_masked
    obs_before = torch.cumsum(observed.long(), 0) - observed.long()
    msk_before = torch.cumsum(is_masked.long(), 0) - is_masked.long()
    first = blocks.start[blocks.of_token]
    obs_rank = obs_before - obs_before[first]
    msk_rank = msk_before - msk_before[first]
    observed_in_block = blocks.length - num_masked
    return first + torch.where(is_masked, observed_in_block[blocks.of_token] + msk_rank, obs_rank)


def _write_streams(
    row: dict[str, Tensor],
    docs: _DocumentTokens,
    blocks: _BlockGrid,
    gamma: Tensor,
    is_masked: Tensor,
    place: Tensor,
    mask_token_id: int,
) -> Tensor:
    """Write every token into its memory and prediction slot (document d occupies slots
    ``[2*start_d, 2*start_d + 2*L_d)``, memory first); returns each token's prediction slot."""
    tokens = docs.tokens
    memory_slot = docs.start + torch.arange(tokens.numel())
    prediction_slot = docs.start + docs.lengths[docs.doc] + place
    for slot in (memory_slot, prediction_slot):
        row["target_ids"][slot] = tokens
        row["position_ids"][slot] = docs.position
        row["doc_ids"][slot] = docs.doc
        row["block_ids"][slot] = blocks.in_document
        row["is_padding"][slot] = False
    row["input_ids"][memory_slot] = tokens
    row["input_ids"][prediction_slot] = torch.where(is_masked, torch.full_like(tokens, mask_token_id), tokens)
    row["is_memory"][memory_slot] = True
    row["is_masked"][prediction_slot] = is_masked
    token_gamma = gamma[blocks.of_token]
    row["mask_ratio"][prediction_slot] = token_gamma.float()
    row["mlm_weights"][prediction_slot] = torch.where(
        is_masked, 1.0 / token_gamma, torch.zeros_like(token_gamma)
    ).float()
    row["ar_labels"][memory_slot] = docs.ar_labels
    return prediction_slot


def build_dual_stream_batch(
    documents: Sequence[Tensor],
    row_format: RowFormat,
    generator: torch.Generator | None = None,
    prompt_lengths: Sequence[int] | Tensor | None = None,
    *,
    pad_to: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
) -> DualStreamBatch:
    """Pack ``documents`` into one dual-stream row in ``row_format`` (rules: module docstring).

    ``generator=None`` uses torch's global RNG; a row over ``max_length`` is a ValueError
    (split with :func:`.packing.pack_documents_into_rows`). Outputs are on the CPU.
    """
    if len(documents) == 0:
        raise ValueError("documents is empty; need at least one document to build a row")
    fmt = row_format
    _validate_padding(pad_to, pad_to_multiple_of)
    tokens, lengths = _concatenate(documents, fmt.mask_token_id)
    prompts = _prompt_tensor(prompt_lengths, lengths)

    docs = _document_tokens(tokens, lengths, prompts)
    # The random draws, in the order the module docstring gives: offsets, gammas, selection keys.
    offset = _draw_offsets(lengths.numel(), fmt.block_size, fmt.random_block_offset, generator)
    blocks = _block_grid(docs, fmt.block_size, offset)
    gamma = _draw_gammas(blocks, fmt.ratio_mode, fmt.mask_eps, generator)
    is_masked, num_masked = _choose_masked(docs, blocks, gamma, generator)
    if fmt.masked_end_token_id is not None:
        is_masked, num_masked = _mask_after_masked_end(
            docs, blocks, is_masked, fmt.masked_end_token_id, fmt.mask_after_masked_end, generator
        )

    place = _reordered_places(blocks, is_masked, num_masked)
    pad_id = int(fmt.pad_token_id)  # type: ignore[arg-type]
    row = _padding_slots(2 * tokens.numel(), pad_id)
    prediction_slot = _write_streams(row, docs, blocks, gamma, is_masked, place, fmt.mask_token_id)
    if fmt.prune_unmasked_blocks:
        kept = torch.ones(row["input_ids"].numel(), dtype=torch.bool)  # every memory slot stays
        kept[prediction_slot] = num_masked[blocks.of_token] > 0
        row = {name: tensor[kept] for name, tensor in row.items()}
    length = row["input_ids"].numel()
    total = _padded_length(length, pad_to, pad_to_multiple_of, max_length)
    if total > length:
        row = {name: torch.cat([tensor, pad[: total - length]])
               for (name, tensor), pad in zip(row.items(), _padding_slots(total - length, pad_id).values())}
    return DualStreamBatch(**row, block_size=fmt.block_size, mask_token_id=fmt.mask_token_id, pad_token_id=pad_id)


def build_memory_only_row(
    documents: Sequence[Tensor], prompt_lengths: Sequence[int], row_format: RowFormat
) -> DualStreamBatch:
    """An AR training row: the documents' memory streams only, nothing masked. Same fields as a
    dual-stream row, so one model and one loss serve both modes."""
    tokens = torch.cat([d.to(torch.long) for d in documents])
    lengths = torch.tensor([d.numel() for d in documents])
    docs = _document_tokens(tokens, lengths, torch.as_tensor(list(prompt_lengths), dtype=torch.long))
    zeros = torch.zeros(tokens.numel())
    return DualStreamBatch(
        input_ids=tokens,
        position_ids=docs.position,
        is_memory=torch.ones_like(tokens, dtype=torch.bool),
        is_masked=torch.zeros_like(tokens, dtype=torch.bool),
        target_ids=tokens.clone(),
        doc_ids=docs.doc,
        block_ids=docs.position // row_format.block_size,
        mask_ratio=zeros.clone(),
        mlm_weights=zeros.clone(),
        ar_labels=docs.ar_labels,
        is_padding=torch.zeros_like(tokens, dtype=torch.bool),
        block_size=row_format.block_size,
        mask_token_id=row_format.mask_token_id,
        pad_token_id=int(row_format.pad_token_id),  # type: ignore[arg-type]
    )


def pad_dual_stream_batch(batch: DualStreamBatch, length: int) -> DualStreamBatch:
    """Append padding slots (attend nothing, no loss) up to ``length`` along the last dim."""
    extra = length - batch.seq_len
    if extra < 0:
        raise ValueError(f"cannot pad a row of length {batch.seq_len} down to {length}")
    if extra == 0:
        return batch
    padded = {}
    for name in DualStreamBatch.tensor_field_names():
        tensor = getattr(batch, name)
        fill = _PAD_VALUES.get(name, batch.pad_token_id)
        tail = torch.full((*tensor.shape[:-1], extra), fill, dtype=tensor.dtype, device=tensor.device)
        padded[name] = torch.cat([tensor, tail], dim=-1)
    return DualStreamBatch(
        **padded, block_size=batch.block_size, mask_token_id=batch.mask_token_id, pad_token_id=batch.pad_token_id
    )


def stack_dual_stream_batches(batches: Sequence[DualStreamBatch], pad_to: int | None = None) -> DualStreamBatch:
    """Collate single rows into one ``[B, S]`` batch, padding each to the longest (or ``pad_to``)."""
    if len(batches) == 0:
        raise ValueError("no batches to stack")
    for i, b in enumerate(batches):
        if b.input_ids.dim() != 1:
            raise ValueError(f"batch {i} is already stacked (shape {tuple(b.input_ids.shape)}); stack single rows")
        for attr in ("block_size", "mask_token_id", "pad_token_id"):
            if getattr(b, attr) != getattr(batches[0], attr):
                raise ValueError(f"batch {i} has {attr}={getattr(b, attr)} but batch 0 has {getattr(batches[0], attr)}")
    longest = max(b.seq_len for b in batches)
    length = longest if pad_to is None else pad_to
    if length < longest:
        raise ValueError(f"pad_to {pad_to} is shorter than the longest row ({longest})")
    padded = [pad_dual_stream_batch(b, length) for b in batches]
    first = batches[0]
    return DualStreamBatch(
        **{name: torch.stack([getattr(p, name) for p in padded]) for name in DualStreamBatch.tensor_field_names()},
        block_size=first.block_size,
        mask_token_id=first.mask_token_id,
        pad_token_id=first.pad_token_id,
    )
