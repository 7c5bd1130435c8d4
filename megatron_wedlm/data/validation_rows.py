"""The validation rows of a run: the first rows of a held-out prepared directory, fixed for the run.

Every evaluation, of this run or another, scores the same rows with the same masks: they are the
rows of one stream seeded by :data:`VALIDATION_SEED` (:func:`~.webdataset_loader.stream_rows`,
masks from ``rank_seed(VALIDATION_SEED, 0, row)``), independent of ``data.seed``,
``data.num_streams`` and the parallel layout. An evaluation takes the first ``rows``, dealt to
ranks as training rows are; a smaller directory wraps around (:attr:`ValidationRows.passes`).
The rows are built once, at the start, and kept (this rank's share only).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dual_stream import DualStreamBatch, stack_dual_stream_batches
from .webdataset_loader import LoaderSpec, StreamPosition, stream_rows

__all__ = ["VALIDATION_SEED", "ValidationRows", "validation_rows"]

#: Seeds the validation stream's order and masks; fixed so that every run scores the same rows.
VALIDATION_SEED = 20_250_101


@dataclass
class ValidationRows:
    """This rank's share of an evaluation's rows."""

    batches: list[DualStreamBatch]  # this rank's micro-batches, [micro_batch_size, seq_length] each
    tokens: list[int]  # real (non-padding) tokens per micro-batch
    rows: int  # rows of the whole evaluation (all ranks)
    passes: int  # times the directory's documents were read to fill them (> 1: wrapped)


def _passes(after: StreamPosition) -> int:
    """How many passes over the stream's data a reader stopped at ``after`` has started."""
    started_next = (after.shard_cursor, after.sample_cursor, after.token_offset) != (0, 0, 0)
    return after.epoch + (1 if started_next else 0)


def validation_rows(spec: LoaderSpec, rows: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> ValidationRows:
    """The first ``rows`` rows of ``spec``'s single stream, this rank's share stacked into
    micro-batches (see the module docstring). ``spec`` must describe one stream."""
    if spec.num_streams != 1:
        raise ValueError(f"validation rows come from one stream, got num_streams={spec.num_streams}")
    if rows % (dp_size * micro_batch_size):
        raise ValueError(
            f"{rows} validation rows do not split into micro-batches of {micro_batch_size} on {dp_size} ranks"
        )
    mine, tokens = [], []
    reader = stream_rows(spec, 0, StreamPosition())
    after = StreamPosition()
    for row in range(rows):
        item = next(reader)
        after = item.position
        if row % dp_size == dp_rank:
            mine.append(item.batch)
            tokens.append(item.num_tokens)
    batches = [stack_dual_stream_batches(mine[i:i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]
    counts = [sum(tokens[i:i + micro_batch_size]) for i in range(0, len(tokens), micro_batch_size)]
    return ValidationRows(batches, counts, rows, max(_passes(after), 1))
