"""Weighted blends of data sources (``data.blend``): which source each row comes from, resumably.
The design and why: docs/training.md §4, "Data blends". What the code relies on:

* A round of ``num_streams`` consecutive global rows comes whole from one source, one row of each
  of its streams, so each rank reads only its own streams of every source and a row depends on
  its global index alone, not on ``dp`` or the worker count.
* Round ``n`` goes to the source with the largest ``w_s * max(n, 1) - c_s`` (Megatron-Core's
  ``build_blending_indices``), the first on ties: no randomness.
* The rounds each source had, ``rows_s // num_streams``, are the rule's whole state, so a resume
  under any ``dp x workers`` dividing ``num_streams`` continues the same sequence; a changed blend
  is refused, and sources must share task, mask id and tokenizer (:func:`check_compatible_sources`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .dual_stream import DualStreamBatch, stack_dual_stream_batches
from .manifest import tokenization_difference, tokenization_of
from .webdataset_loader import LoaderSpec, RowItem, TrainDataIterator

__all__ = [
    "BlendSource",
    "BlendedDataIterator",
    "blend_names",
    "check_compatible_sources",
    "next_source",
    "normalised_weights",
]


@dataclass(frozen=True)
class BlendSource:
    """One source of a blend: its name (for logs and the state), loader spec and raw weight."""

    name: str
    spec: LoaderSpec
    weight: float


def normalised_weights(weights: Sequence[float]) -> list[float]:
    """Weights summing to 1; every weight must be finite and > 0."""
    for i, w in enumerate(weights):
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"blend weight {i} is {w}; every weight must be a finite number > 0")
    total = sum(weights)
    return [w / total for w in weights]


def next_source(weights: Sequence[float], counts: Sequence[int]) -> int:
    """The source of the next round: the largest ``w_s * max(n, 1) - c_s`` (Megatron-Core's
    ``build_blending_indices``), the first on ties; ``n`` is the number of rounds so far."""
    n = max(sum(counts), 1)
    best, best_error = 0, weights[0] * n - counts[0]
    for s in range(1, len(weights)):
        error = weights[s] * n - counts[s]
        if error > best_error:
            best, best_error = s, error
    return best


def blend_names(paths: Sequence[str], names: Sequence[str | None]) -> list[str]:
    """Each source's name: the given one, else the directory's basename, made unique with
    ``-2``, ``-3``, ... Given names must be unique."""
    given = [n for n in names if n]
    duplicates = sorted({n for n in given if given.count(n) > 1})
    if duplicates:
        raise ValueError(f"data.blend names {duplicates} are given to more than one source; give each a unique name")
    taken = set(given)
    out = []
    for path, name in zip(paths, names):
        if not name:
            base = Path(path).resolve().name or "source"
            name, k = base, 2
            while name in taken:
                name, k = f"{base}-{k}", k + 1
            taken.add(name)
        out.append(name)
    return out


# --------------------------------------------------------------------------------------------
# Same format: task, ids, tokenizer
# --------------------------------------------------------------------------------------------


def check_compatible_sources(sources: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
    """Every source (name, directory, manifest) has the first one's task, mask id and tokenizer:
    rows of one model must mean the same ids. Raises ValueError naming both sources."""
    first_name, first_dir, first_manifest = sources[0]
    reference = tokenization_of(first_dir, first_manifest)
    for name, data_dir, manifest in sources[1:]:
        difference = tokenization_difference(reference, tokenization_of(data_dir, manifest))
        if difference:
            raise ValueError(
                f"data.blend sources '{first_name}' ({first_dir}) and '{name}' ({data_dir}) differ in their "
                f"{difference}; every source must be prepared by tools/prepare_data.py for the same task with the "
                "same tokenizer (re-prepare one of them; a Megatron indexed dataset is read with data.tokenizer)"
            )


# --------------------------------------------------------------------------------------------
# A rank's blended micro-batches
# --------------------------------------------------------------------------------------------


class BlendedDataIterator:
    """Micro-batches for one rank from a blend (a :class:`~.webdataset_loader.DataIterator`): one
    :class:`TrainDataIterator` per source, asked for this rank's next row of the current round."""

    def __init__(
        self,
        sources: Sequence[BlendSource],
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_workers: int = 1,
        prefetch_factor: int = 4,
        state: dict[str, Any] | None = None,
        allow_data_change: bool = False,
    ) -> None:
        if len({s.spec.num_streams for s in sources}) != 1:
            raise ValueError("every blend source must use the same num_streams")
        self.names = [s.name for s in sources]
        self.weights = normalised_weights([s.weight for s in sources])
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch_size = micro_batch_size
        self.round_rows = sources[0].spec.num_streams
        saved: list[dict[str, Any] | None] = [None] * len(sources)
        rows_consumed = 0
        if state is not None:
            _check_blend_state(state, self.names, self.weights)
            saved = list(state["sources"])
            rows_consumed = int(state["rows_consumed"])
        self.sources = [
            TrainDataIterator(s.spec, dp_rank, dp_size, 1, num_workers=num_workers, prefetch_factor=prefetch_factor,
                              state=st, allow_data_change=allow_data_change)
            for s, st in zip(sources, saved)
        ]
        self.rows_consumed = rows_consumed  # global rows, all ranks
        self._counts = [it.rows_consumed // self.round_rows for it in self.sources]  # whole rounds before this one
        self._round = rows_consumed // self.round_rows
        self._source = next_source(self.weights, self._counts)
        self._check_consistent()
        self._step_tokens = [0] * len(sources)

    def _check_consistent(self) -> None:
        """The sources' rows add up to the blend's, and a round in progress is the rule's."""
        rows = [it.rows_consumed for it in self.sources]
        partial = [s for s, n in enumerate(rows) if n % self.round_rows]
        if sum(rows) != self.rows_consumed or partial not in ([], [self._source]) \
                or bool(partial) != bool(self.rows_consumed % self.round_rows):
            raise ValueError(
                f"the checkpoint's blend state is inconsistent (rows per source {rows}, {self.rows_consumed} rows "
                "in all); set checkpointing.load_data_state=false to restart the data"
            )

    def next_row(self) -> tuple[int, RowItem]:
        """(source index, row) of this rank's next row."""
        round_ = (self.rows_consumed + self.dp_rank) // self.round_rows
        while self._round < round_:
            self._counts[self._source] += 1
            self._round += 1
            self._source = next_source(self.weights, self._counts)
        source = self._source
        self.rows_consumed += self.dp_size  # every rank consumes in lockstep
        return source, self.sources[source].next_row()

    def next_microbatch(self) -> tuple[DualStreamBatch, int]:
        """(stacked micro-batch, real tokens in it); per-source tokens go to :meth:`take_source_tokens`."""
        rows = [self.next_row() for _ in range(self.micro_batch_size)]
        for source, item in rows:
            self._step_tokens[source] += item.num_tokens
        return stack_dual_stream_batches([i.batch for _, i in rows]), sum(i.num_tokens for _, i in rows)

    def take_source_tokens(self) -> dict[str, int]:
        """Real tokens per source name since the last call (the loop calls it once a step)."""
        out = dict(zip(self.names, self._step_tokens))
        self._step_tokens = [0] * len(self.names)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "blend": [{"name": n, "weight": w} for n, w in zip(self.names, self.weights)],
            "rows_consumed": self.rows_consumed,
            "sources": [it.state_dict() for it in self.sources],
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
        }

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Every rank's :meth:`state_dict` merged source by source."""
        if not states:
            raise ValueError("no data states to merge")
        first = states[0]
        if any(state["rows_consumed"] != first["rows_consumed"] for state in states):
            raise ValueError("data-parallel ranks consumed different numbers of rows")
        sources = [TrainDataIterator.merge_states([state["sources"][i] for state in states])
                   for i in range(len(first["sources"]))]
        return {"blend": first["blend"], "rows_consumed": first["rows_consumed"], "sources": sources}

    def close(self) -> None:
        for source in self.sources:
            source.close()


def _check_blend_state(state: dict[str, Any], names: list[str], weights: list[float]) -> None:
    """A saved blend position only means something for the same sources in the same order and weights."""
    restart = "or set checkpointing.load_data_state=false to restart the data from the beginning"
    if "blend" not in state:
        raise ValueError(
            f"the checkpoint's data position is of one source (data.path) but this run blends {len(names)} "
            f"sources (data.blend); resume with the same data.path, {restart}"
        )
    saved = [(e["name"], float(e["weight"])) for e in state["blend"]]
    current = list(zip(names, weights))
    same = len(saved) == len(current) and all(
        sn == cn and math.isclose(sw, cw, rel_tol=1e-9) for (sn, sw), (cn, cw) in zip(saved, current)
    )
    if not same:
        def show(entries: list[tuple[str, float]]) -> str:
            return ", ".join(f"{n}={w:.6g}" for n, w in entries)
        raise ValueError(
            f"the checkpoint's data position was saved with the blend [{show(saved)}] but this run's data.blend is "
            f"[{show(current)}] (names, order and normalised weights); resume with the same data.blend, {restart}"
        )
