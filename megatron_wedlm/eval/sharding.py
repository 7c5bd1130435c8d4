"""An evaluation spread over torchrun's processes, and the per-rank record of finished decodes.

Why torchrun, not a pool of our own or Ray: replicas share only the examples and the results,
which torchrun's environment and c10d store give; users already run it for training, and it ends
every worker when one fails, with that worker's error (lm-eval spreads replicas the same way).

* :class:`Shard`: this rank among ``world``; gathers records on rank 0 and keeps a progress
  counter in the store for one aggregated bar.
* :class:`PartsLog`: ``parts/rank{r}.jsonl``, a line per finished decode, so a restart skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

#: A finished decode: ``task``, ``uid``, ``method``, ``tau``, ``completion``, ``new_tokens``,
#: ``forwards``, ``slots``, ``seconds`` (None when it was not timed).
Record = dict[str, Any]
RUN_FILE = "run.json"


def record_key(record: Record) -> tuple[str, str, str, float | None]:
    """What identifies a decode: task, example, method, tau."""
    return record["task"], record["uid"], record["method"], record["tau"]


class Shard:
    """Rank ``rank`` of ``world`` processes; one process (the default) is rank 0 of 1, with no collectives."""

    def __init__(self, rank: int = 0, world: int = 1, store: Any = None, local_rank: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.rank, self.world, self.store, self.local_rank = rank, world, store, local_rank
        self._prefix = f"wedlm_eval/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    @classmethod
    def from_environment(cls, timeout_s: float = 3600.0) -> "Shard":
        """The shard torchrun's environment describes; a plain ``python`` run is one process. With
        ``WORLD_SIZE > 1`` it joins the rendezvous and starts a gloo group (records are small Python
        objects, gathered on the CPU); ``timeout_s`` bounds rank 0's wait for the others."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world == 1:
            return cls(local_rank=local_rank)
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, store, local_rank)

    def owns(self, index: int) -> bool:
        """Whether example ``index`` of a task is this rank's: ranks take every ``world``-th example."""
        return index % self.world == self.rank

    def count(self, name: str, n: int = 0) -> int:
        """Add ``n`` to the counter ``name`` shared by all ranks and return its value (0 for one process)."""
        return self.store.add(self._prefix + name, n) if self.store is not None else 0

    def gather(self, records: list[Record]) -> list[Record] | None:
        """Every rank's records on rank 0 (in rank order, concatenated); None on the other ranks."""
        if self.world == 1:
            return list(records)
        parts: list[list[Record]] | None = [[] for _ in range(self.world)] if self.rank == 0 else None
        dist.gather_object(records, parts, dst=0)
        return [r for part in parts for r in part] if parts is not None else None

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group (after the gather, so no rank is left waiting)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


class PartsLog:
    """``<dir>/rank{r}.jsonl``: this rank's finished decodes, a JSON line each, flushed as written.
    ``<dir>/run.json`` holds what they depend on (model, checkpoint files, settings, examples): a
    restart with the same identity skips the decodes in any rank's file (so it may use another
    number of processes); another identity clears the directory first."""

    def __init__(self, directory: str | Path, rank: int, identity: dict[str, Any]):
        self.dir, self.rank = Path(directory), rank
        self.identity = json.loads(json.dumps(identity))  # as it reads back from the file
        self._file = None

    def open(self, shard: "Shard") -> dict[tuple, Record]:
        """Check the identity, open this rank's file for appending, return the records already done
        (stale ones are cleared by each node's first process while the others wait at a barrier)."""
        run = self.dir / RUN_FILE
        if shard.local_rank == 0 and run.is_file() and json.loads(run.read_text(encoding="utf-8")) != self.identity:
            print(f"{self.dir} holds results of another evaluation (settings or checkpoint differ): starting afresh",
                  file=sys.stderr)
            shutil.rmtree(self.dir)
        shard.barrier()
        self.dir.mkdir(parents=True, exist_ok=True)
        if not run.is_file():
            tmp = self.dir / f".{RUN_FILE}.{self.rank}"
            tmp.write_text(json.dumps(self.identity, indent=1), encoding="utf-8")
            os.replace(tmp, run)  # every rank writes the same content; the rename is atomic
        done = {record_key(r): r for r in _read(p for p in sorted(self.dir.glob("rank*.jsonl")) if p.is_file())}
        self._file = open(self.dir / f"rank{self.rank}.jsonl", "a", encoding="utf-8")
        return done

    def append(self, record: Record) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _read(paths: Iterable[Path]) -> list[Record]:
    """Records of the files; a last line cut short by a killed process is ignored (it is redone)."""
    records = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
