"""Stream prepared webdataset shards into packed training rows, resumable at the exact sample.

The design and its reasons: docs/training.md §4 (streams, global row order, exact resume, shard
fingerprint) and §7 (learnable end tokens). What the code relies on:

* Shards are dealt once, seeded, to ``num_streams`` streams; a row is a pure function of (seed,
  stream, row number), never of the number of ranks or workers.
* Global row ``g`` is row ``g // num_streams`` of stream ``g % num_streams``; rank ``d`` of ``dp``
  trains on rows ``j * dp + d``, and its loader workers split its streams again.
* Each row carries its stream's position *after* it; a resume under any ``dp x workers`` dividing
  ``num_streams`` continues at the first token not trained on (prefetched rows do not count).
* Packing is :func:`.packing.next_piece_length`, applied piece by piece so a row may end inside a
  sample; SFT samples whose prompt fills a row are skipped and counted.
* WeDLM SFT samples get ``appended_end_tokens`` end tokens before packing (nothing truncated).
* A Megatron ``.bin``/``.idx`` pair is read as virtual shards of documents (:mod:`.indexed`).
* Masks use a generator seeded by ``rank_seed(seed, stream, row number)``.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
import random
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .dual_stream import (
    DualStreamBatch,
    build_dual_stream_batch,
    build_memory_only_row,
    pad_dual_stream_batch,
    stack_dual_stream_batches,
)
from .indexed import indexed_file_sizes, shard_documents, shard_range
from .packing import next_piece_length, piece_prompt_length, spared_places
from .manifest import read_manifest
from .row_format import RowFormat
from .seeding import rank_seed

__all__ = [
    "DataIterator",
    "LoaderSpec",
    "StreamPosition",
    "RowItem",
    "StreamingRowDataset",
    "TrainDataIterator",
    "loader_spec_from_manifest",
    "manifest_row_format",
    "row_capacity",
    "shards_fingerprint",
    "stream_rows",
]


@dataclass
class StreamPosition:
    """Where a stream continues: the first token it has not yet put into an emitted row."""

    epoch: int = 0
    shard_cursor: int = 0  # index into this epoch's shard order of the stream
    sample_cursor: int = 0  # index into the shuffled sample order of that shard
    token_offset: int = 0  # first token of that sample not yet emitted (a multiple of block_size)
    rows: int = 0  # rows emitted so far (numbers the next row; seeds its masks)
    skipped: int = 0  # samples skipped because their prompt fills a whole row

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> "StreamPosition":
        return cls(**{k: int(v) for k, v in data.items()})


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a worker needs to rebuild rows (picklable; no open files)."""

    data_dir: str
    shard_paths: tuple[str, ...]
    task: str  # pretrain | sft (sft uses prompt lengths)
    num_streams: int
    seq_length: int
    wedlm: bool  # dual-stream rows; False: memory-only (AR) rows
    row_format: RowFormat
    seed: int = 1234
    shuffle: bool = True
    shards_fingerprint: str = ""  # see shards_fingerprint(); empty: not known (no check)
    # a Megatron indexed dataset read with data.append_eod: this EOS id is appended to every
    # document that does not end with it (-1: nothing appended)
    append_eod_id: int = -1

    def __post_init__(self) -> None:
        fmt = self.row_format
        if fmt.appended_end_tokens and self.task != "sft":
            raise ValueError("appended_end_tokens needs SFT data and the reply's end_token_id")
        _refuse_masked_end_outside_sft(self.data_dir, self.task, fmt.mask_after_masked_end)
        if fmt.mask_after_masked_end and not self.wedlm:
            raise ValueError("mask_after_masked_end needs WeDLM rows of SFT data and the reply's end_token_id")
        if self.num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {self.num_streams}")
        if len(self.shard_paths) < self.num_streams:
            raise ValueError(
                f"{len(self.shard_paths)} shards cannot feed data.num_streams={self.num_streams} streams; "
                "lower data.num_streams or re-run tools/prepare_data.py with a smaller --samples-per-shard "
                "(a Megatron indexed dataset: lower data.indexed_documents_per_shard)"
            )
        row_capacity(self)  # validates seq_length against block_size

    def stream_shards(self, stream: int) -> list[int]:
        """Shard indices dealt to ``stream`` (fixed for the whole run, independent of layout)."""
        order = list(range(len(self.shard_paths)))
        if self.shuffle:
            random.Random(f"wedlm-shards:{self.seed}").shuffle(order)
        return order[stream :: self.num_streams]


def _refuse_masked_end_outside_sft(data_dir: str | Path, task: str, mask_after_masked_end: float) -> None:
    if mask_after_masked_end and task != "sft":
        raise ValueError(f"{data_dir} holds {task} data: wedlm.mask_after_masked_end is for SFT "
                         "replies, whose end token it masks after; set it to 0")


def row_capacity(spec: LoaderSpec) -> int:
    """Tokens per row, whole blocks only (cuts stay block-aligned): half the row for WeDLM (two
    streams), all of it for AR."""
    tokens = spec.seq_length // 2 if spec.wedlm else spec.seq_length
    block = spec.row_format.block_size
    capacity = tokens // block * block
    if capacity < 1:
        streams = "in both streams " if spec.wedlm else ""
        raise ValueError(
            f"seq_length {spec.seq_length} cannot hold one block of {block} tokens {streams}"
            f"(needs >= {(2 if spec.wedlm else 1) * block}); raise data.seq_length or lower "
            "wedlm.block_size"
        )
    return capacity


def shards_fingerprint(data_dir: str | Path, shards: Sequence[dict[str, Any]]) -> str:
    """A hash of the shard set a stream position refers to: each shard's name, sample and token
    count and file size (a virtual shard: its ``.bin`` and ``.idx``), in manifest order; reads no shard."""
    entries = []
    for shard in shards:
        file = Path(data_dir) / shard["path"]
        if shard_range(shard["path"]) is not None:
            size = indexed_file_sizes(data_dir)
        else:
            size = file.stat().st_size if file.is_file() else None
        entries.append([shard["path"], size, shard.get("samples"), shard.get("tokens")])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def manifest_row_format(
    data_dir: str | Path, manifest: dict[str, Any] | None = None, *, num_learnable_end_tokens: int = 0, **fields: Any
) -> RowFormat:
    """The :class:`RowFormat` of ``fields`` for the data in ``data_dir`` (or ``manifest``): the
    manifest's mask and pad ids, and for SFT the reply's end token, appended
    ``num_learnable_end_tokens - 1`` times."""
    if manifest is None:
        manifest = read_manifest(data_dir)
    mask = int(manifest["mask_token_id"])
    pad = manifest.get("pad_token_id")
    if pad is None:
        pad = manifest.get("eos_token_id")
    _refuse_masked_end_outside_sft(data_dir, manifest["task"], fields.get("mask_after_masked_end", 0.0))
    appended = max(0, num_learnable_end_tokens - 1) if manifest["task"] == "sft" else 0
    wants_end = appended or fields.get("mask_after_masked_end")
    end = _end_token_id(data_dir, manifest) if wants_end else None
    return RowFormat(mask_token_id=mask, pad_token_id=mask if pad is None else int(pad), end_token_id=end,
                     appended_end_tokens=appended, **fields)


def loader_spec_from_manifest(
    data_dir: str | Path,
    row_format: RowFormat,
    *,
    num_streams: int,
    seq_length: int,
    wedlm: bool,
    seed: int = 1234,
    shuffle: bool = True,
    task: str | None = None,
    manifest: dict[str, Any] | None = None,
) -> LoaderSpec:
    """A :class:`LoaderSpec` for a prepared directory, or any source whose ``manifest`` is given
    (:mod:`.indexed`); ValueError unless the manifest shares ``row_format``'s token ids."""
    if manifest is None:
        manifest = read_manifest(data_dir)
    if task is not None and manifest["task"] != task:
        raise ValueError(
            f"{data_dir} was prepared for task '{manifest['task']}' but this run is '{task}'; "
            f"prepare the data with --task {task}"
        )
    if int(manifest["mask_token_id"]) != row_format.mask_token_id:
        raise ValueError(f"the mask token id {manifest['mask_token_id']} of the data in {data_dir} differs from the "
                         f"run's {row_format.mask_token_id}")
    end = manifest.get("end_token_id")
    if row_format.end_token_id is not None and manifest["task"] == "sft" and end is not None:
        if int(end) != row_format.end_token_id:
            raise ValueError(f"the replies of the data in {data_dir} end with token {end}, not the run's "
                             f"{row_format.end_token_id}: prepare every source with the same chat template")
    append_eod = manifest.get("indexed", {}).get("append_eod", False)
    return LoaderSpec(
        data_dir=str(data_dir),
        shard_paths=tuple(s["path"] for s in manifest["shards"]),
        task=manifest["task"],
        num_streams=num_streams,
        seq_length=seq_length,
        wedlm=wedlm,
        row_format=row_format,
        seed=seed,
        shuffle=shuffle,
        shards_fingerprint=shards_fingerprint(data_dir, manifest["shards"]),
        append_eod_id=int(manifest["eos_token_id"]) if append_eod else -1,
    )


def _end_token_id(data_dir: str | Path, manifest: dict[str, Any]) -> int:
    """The token that ends a reply: the manifest's ``end_token_id``, else ``eos_token_id`` with a
    warning (right for ``--raw-sft`` data only)."""
    if manifest.get("end_token_id") is not None:
        return int(manifest["end_token_id"])
    eos = manifest.get("eos_token_id")
    if eos is None:
        raise ValueError(
            f"{data_dir}/manifest.json records neither end_token_id nor eos_token_id: re-prepare the data with "
            "tools/prepare_data.py, or set wedlm.num_learnable_end_tokens=1 to append no end tokens"
        )
    warnings.warn(
        f"{data_dir}/manifest.json has no end_token_id (prepared by an older tools/prepare_data.py): the "
        f"learnable end tokens appended to each reply are eos_token_id={eos}. Right for --raw-sft data; for "
        "chat-template data re-prepare it, so the template's end-of-turn token is recorded",
        stacklevel=2,
    )
    return int(eos)


# --------------------------------------------------------------------------------------------
# Reading one stream
# --------------------------------------------------------------------------------------------


#: Decoded shards a process keeps, in bytes of tokens. A stream re-reads its shards every epoch, so
#: a small dataset is decoded once instead of once per epoch; a larger shard is never kept.
SHARD_CACHE_BYTES = 64 << 20

#: (path, inode, size, mtime) -> (samples, their token bytes), least recently used first
_shard_cache: OrderedDict[tuple[str, int, int, int], tuple[list[tuple[np.ndarray, int]], int]] = OrderedDict()


def _decode_shard(path: Path) -> list[tuple[np.ndarray, int]]:
    from webdataset.tariterators import tarfile_samples

    samples = []
    for sample in tarfile_samples([{"url": str(path)}]):
        tokens = np.load(io.BytesIO(sample["tokens.npy"]))
        tokens.flags.writeable = False  # shared by every later read of the shard
        meta = json.loads(sample["json"])
        samples.append((tokens, int(meta.get("prompt_length", 0))))
    return samples


def _read_shard(path: Path) -> list[tuple[np.ndarray, int]]:
    """All samples of a shard, in file order: (read-only int32 tokens, prompt length), cached
    (:data:`SHARD_CACHE_BYTES`) while the file's inode, size and mtime are unchanged."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _shard_cache:
        _shard_cache.move_to_end(key)
        return _shard_cache[key][0]
    samples = _decode_shard(path)
    size = sum(tokens.nbytes for tokens, _ in samples)
    if size <= SHARD_CACHE_BYTES:
        _shard_cache[key] = (samples, size)
        while sum(nbytes for _, nbytes in _shard_cache.values()) > SHARD_CACHE_BYTES:
            _shard_cache.popitem(last=False)
    return samples


def _shard_samples(spec: LoaderSpec, shard: int) -> Sequence[tuple[np.ndarray, int]]:
    """The samples of shard ``shard``: a prepared file's, or a virtual shard's documents."""
    path = spec.shard_paths[shard]
    if shard_range(path) is not None:
        return shard_documents(spec.data_dir, path, spec.append_eod_id)
    return _read_shard(Path(spec.data_dir) / path)


def _sample_order(spec: LoaderSpec, shard: int, epoch: int, count: int) -> list[int]:
    order = list(range(count))
    if spec.shuffle:
        random.Random(f"wedlm-samples:{spec.seed}:{shard}:{epoch}").shuffle(order)
    return order


def _shard_order(spec: LoaderSpec, stream: int, epoch: int) -> list[int]:
    shards = spec.stream_shards(stream)
    if spec.shuffle:
        random.Random(f"wedlm-epoch:{spec.seed}:{stream}:{epoch}").shuffle(shards)
    return shards


@dataclass
class _Sample:
    tokens: torch.Tensor
    prompt_length: int
    position: StreamPosition  # the stream position at this sample (token_offset: where to go on)


def _samples(spec: LoaderSpec, stream: int, start: StreamPosition) -> Iterator[_Sample | StreamPosition]:
    """The stream's samples from ``start`` on, forever (epochs wrap), the first possibly partly
    consumed; a skipped sample yields a bare position so the caller can count it."""
    capacity = row_capacity(spec)
    pos = StreamPosition(**asdict(start))
    while True:
        shards = _shard_order(spec, stream, pos.epoch)
        while pos.shard_cursor < len(shards):
            shard = shards[pos.shard_cursor]
            samples = _shard_samples(spec, shard)
            order = _sample_order(spec, shard, pos.epoch, len(samples))
            while pos.sample_cursor < len(order):
                tokens, prompt = samples[order[pos.sample_cursor]]
                prompt = prompt if spec.task == "sft" else 0
                appended = spec.row_format.appended_end_tokens
                if appended:
                    tokens = np.concatenate([tokens, np.full(appended, spec.row_format.end_token_id, tokens.dtype)])
                if prompt >= min(capacity, len(tokens)):
                    pos.skipped += 1
                    pos.sample_cursor += 1
                    pos.token_offset = 0
                    yield StreamPosition(**asdict(pos))
                    continue
                yield _Sample(torch.from_numpy(tokens.astype(np.int64)), prompt, StreamPosition(**asdict(pos)))
                pos.sample_cursor += 1
                pos.token_offset = 0
            pos.shard_cursor += 1
            pos.sample_cursor = 0
        pos.epoch += 1
        pos.shard_cursor = 0


@dataclass
class RowItem:
    """One packed row as produced by a worker."""

    batch: DualStreamBatch  # [seq_length] tensors
    stream: int
    row_index: int  # row number within the stream
    position: StreamPosition  # stream position after this row
    num_tokens: int  # real (non-padding) tokens in the row


def stream_rows(spec: LoaderSpec, stream: int, start: StreamPosition) -> Iterator[RowItem]:
    """Rows of one stream from ``start`` on, deterministic; a row ending inside a sample has an
    "after" position naming that sample and the token where the next row goes on."""
    capacity = row_capacity(spec)
    fill = spec.task == "pretrain"
    block_size = spec.row_format.block_size
    prune = spec.wedlm and spec.row_format.prune_unmasked_blocks
    docs: list[torch.Tensor] = []
    prompts: list[int] = []
    used = tokens = 0  # token places taken (fewer than tokens where a pruned row spares them), tokens
    rows = start.rows
    skipped = start.skipped
    for item in _samples(spec, stream, start):
        if isinstance(item, StreamPosition):
            skipped = item.skipped
            continue
        offset = item.position.token_offset
        length = item.tokens.numel()
        while offset < length:
            spared = spared_places(max(item.prompt_length - offset, 0), block_size, prune)
            n = next_piece_length(length - offset, capacity - used, capacity, block_size, fill=fill,
                                  spared=spared)
            if n == 0:
                after = StreamPosition(
                    **{**asdict(item.position), "token_offset": offset, "rows": rows + 1, "skipped": skipped}
                )
                yield RowItem(_build_row(spec, stream, rows, docs, prompts), stream, rows, after, tokens)
                rows += 1
                docs, prompts, used, tokens = [], [], 0, 0
                continue
            docs.append(item.tokens[offset : offset + n])
            prompts.append(piece_prompt_length(item.prompt_length, offset, n))
            offset += n
            used += n - (spared if offset == length else 0)  # a cut piece fills its row (packing.py)
            tokens += n


def _build_row(spec: LoaderSpec, stream: int, row: int, docs: list[torch.Tensor], prompts: list[int]) -> DualStreamBatch:
    if spec.wedlm:
        generator = torch.Generator().manual_seed(rank_seed(spec.seed, stream, row))
        return build_dual_stream_batch(docs, spec.row_format, generator, prompts, pad_to=spec.seq_length)
    return pad_dual_stream_batch(build_memory_only_row(docs, prompts, spec.row_format), spec.seq_length)


# --------------------------------------------------------------------------------------------
# A rank's view: workers, round-robin, state
# --------------------------------------------------------------------------------------------


class StreamingRowDataset(IterableDataset):
    """The rows of one data-parallel rank, in its global order, split over loader workers, from
    its row ``start_row`` and the saved ``positions`` (a missing stream starts at its beginning)."""

    def __init__(
        self,
        spec: LoaderSpec,
        dp_rank: int,
        dp_size: int,
        num_workers: int,
        start_row: int = 0,
        positions: dict[int, StreamPosition] | None = None,
    ) -> None:
        super().__init__()
        workers = max(num_workers, 1)
        if spec.num_streams % (dp_size * workers):
            raise ValueError(
                f"num_streams={spec.num_streams} is not a multiple of dp x workers = {dp_size} x {workers}"
            )
        self.spec = spec
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_workers = workers
        self.start_row = start_row
        self.positions = dict(positions or {})

    @property
    def local_streams(self) -> int:
        return self.spec.num_streams // self.dp_size

    def stream_of_row(self, j: int) -> int:
        """Global stream id of this rank's ``j``-th row."""
        return (j % self.local_streams) * self.dp_size + self.dp_rank

    def __iter__(self) -> Iterator[RowItem]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        workers = info.num_workers if info is not None else 1
        if workers != self.num_workers:
            raise RuntimeError(f"dataset built for {self.num_workers} workers runs under {workers}")
        # This worker serves rows j = start_row + worker, + workers, ... (PyTorch takes items
        # from workers in turn); the streams of those rows cycle with period local/workers.
        first = self.start_row + worker
        period = self.local_streams // workers
        streams = [self.stream_of_row(first + k * workers) for k in range(period)]
        iterators = [stream_rows(self.spec, v, self.positions.get(v, StreamPosition())) for v in streams]
        while True:
            for it in iterators:
                yield next(it) if info is None else _as_arrays(next(it))


def _as_arrays(item: RowItem) -> RowItem:
    """A worker's row with numpy arrays for tensors: they cross to the trainer in one message,
    where each tensor would take a shared-memory file of its own."""
    names = DualStreamBatch.tensor_field_names()
    return replace(item, batch=replace(item.batch, **{n: getattr(item.batch, n).numpy() for n in names}))


def _as_tensors(item: RowItem) -> RowItem:
    """The row back with tensors (sharing the arrays' memory)."""
    names = DualStreamBatch.tensor_field_names()
    if not isinstance(item.batch.input_ids, np.ndarray):
        return item
    return replace(item, batch=replace(item.batch, **{n: torch.from_numpy(getattr(item.batch, n)) for n in names}))


class DataIterator(Protocol):
    """What the training loop reads a rank's data through (one source, or a blend of several)."""

    def next_microbatch(self) -> tuple[DualStreamBatch, int]:
        """The next stacked micro-batch and the real (non-padding) tokens in it."""

    def take_source_tokens(self) -> dict[str, int]:
        """Real tokens per named source since the last call; empty for unnamed single-source data."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's data position."""

    def merge_states(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The global data position from every rank's :meth:`state_dict` (any order)."""

    def close(self) -> None:
        """Stop the loader workers."""


class TrainDataIterator:
    """Micro-batches for one rank (:class:`DataIterator`), with the stream positions a checkpoint
    needs (merged across ranks by :meth:`merge_states` before saving)."""

    def __init__(
        self,
        spec: LoaderSpec,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        num_workers: int = 1,
        prefetch_factor: int = 4,
        state: dict[str, Any] | None = None,
        allow_data_change: bool = False,
    ) -> None:
        self.spec = spec
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batch_size = micro_batch_size
        positions: dict[int, StreamPosition] = {}
        rows_consumed = 0
        if state is not None:
            _check_state_matches(state, spec, allow_data_change)
            rows_consumed = int(state["rows_consumed"])
            if rows_consumed % dp_size:
                raise ValueError(f"rows_consumed={rows_consumed} is not a multiple of dp={dp_size}")
            positions = {int(k): StreamPosition.from_dict(v) for k, v in state["positions"].items()}
        self.rows_consumed = rows_consumed  # global rows, all ranks
        self.positions = positions
        self.dataset = StreamingRowDataset(
            spec, dp_rank, dp_size, num_workers, start_row=rows_consumed // dp_size, positions=positions
        )
        loader_kwargs: dict[str, Any] = {}
        if num_workers > 0:
            loader_kwargs = dict(prefetch_factor=prefetch_factor, persistent_workers=False,
                                 multiprocessing_context="fork" if _fork_ok() else "spawn")
        self._loader = DataLoader(
            self.dataset, batch_size=None, num_workers=num_workers, **loader_kwargs
        )
        self._rows = iter(self._loader)

    def next_row(self) -> RowItem:
        """This rank's next row, recorded as consumed."""
        item = _as_tensors(next(self._rows))
        self.positions[item.stream] = item.position
        self.rows_consumed += self.dp_size  # every rank consumes in lockstep
        return item

    def next_microbatch(self) -> tuple[DualStreamBatch, int]:
        """(stacked micro-batch, real tokens in it)."""
        items = [self.next_row() for _ in range(self.micro_batch_size)]
        return stack_dual_stream_batches([i.batch for i in items]), sum(i.num_tokens for i in items)

    def take_source_tokens(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            **_state_identity(self.spec),
            "shards_fingerprint": self.spec.shards_fingerprint,
            "rows_consumed": self.rows_consumed,
            "positions": {str(k): asdict(v) for k, v in sorted(self.positions.items())},
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
        }

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Each stream's position from its owning data-parallel rank (TP/PP peers hold copies)."""
        if not states:
            raise ValueError("no data states to merge")
        first = states[0]
        dp = int(first["dp_size"])
        merged = {k: v for k, v in first.items() if k not in ("positions", "dp_rank", "dp_size")}
        positions: dict[str, Any] = {}
        for state in states:
            if state["rows_consumed"] != first["rows_consumed"]:
                raise ValueError("data-parallel ranks consumed different numbers of rows")
            for stream, pos in state["positions"].items():
                if int(stream) % dp == int(state["dp_rank"]):
                    positions[stream] = pos
        merged["positions"] = dict(sorted(positions.items(), key=lambda kv: int(kv[0])))
        return merged

    def close(self) -> None:
        self._rows = iter(())  # the loader's iterator, once dropped, shuts its workers down


def _fork_ok() -> bool:
    return "fork" in mp.get_all_start_methods()


def _state_identity(spec: LoaderSpec) -> dict[str, Any]:
    """What a saved data position refers to: the stream layout and the row format's cuts."""
    return {
        "num_streams": spec.num_streams,
        "seed": spec.seed,
        "seq_length": spec.seq_length,
        "wedlm": spec.wedlm,
        "shuffle": spec.shuffle,
        "num_shards": len(spec.shard_paths),
        **spec.row_format.position_key(),
    }


#: Keys a state saved before they existed lacks, with the value such a state had.
_STATE_DEFAULTS = {"appended_end_tokens": 0}


def _check_state_matches(state: dict[str, Any], spec: LoaderSpec, allow_data_change: bool = False) -> None:
    """A saved data position only means something for the same stream layout, row format and shards."""
    restart = "or set checkpointing.load_data_state=false to restart the data from the beginning"
    if "blend" in state:
        raise ValueError(
            "the checkpoint's data position was saved by a blend of several sources (data.blend) but this run "
            f"reads one (data.path); resume with the same data.blend, {restart}"
        )
    for key, current in _state_identity(spec).items():
        saved = state.get(key, _STATE_DEFAULTS.get(key, current))
        if saved == current:
            continue
        if key == "appended_end_tokens":
            raise ValueError(
                f"the checkpoint's data position was saved with {saved} end token(s) appended to every SFT reply "
                f"but this run appends {current}: its rows and stream positions would differ. Resume "
                f"with wedlm.num_learnable_end_tokens={saved + 1}, {restart}"
            )
        raise ValueError(
            f"the checkpoint's data position was saved with {key}={saved!r} but this run has "
            f"{current!r}; resume with the same data settings (data.num_streams, data.seed, "
            f"data.seq_length, data.shuffle, wedlm.block_size/enabled, same shards), {restart}"
        )
    saved = state.get("shards_fingerprint")
    if saved and spec.shards_fingerprint and saved != spec.shards_fingerprint and not allow_data_change:
        raise ValueError(
            f"the checkpoint's data position was saved on another shard set than {spec.data_dir} holds now "
            f"(fingerprint {saved}, now {spec.shards_fingerprint}: shard names, sizes or sample/token counts "
            "differ); its stream positions would land in unrelated data. Point data.path at the data the run "
            "trained on, set checkpointing.load_data_state=false to start the new data from its beginning, "
            "or checkpointing.allow_data_change=true if every shard still holds the same samples"
        )
