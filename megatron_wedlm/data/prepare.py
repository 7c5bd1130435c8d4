"""Raw text or chat records -> a prepared directory of tokenized webdataset shards (the layout
and manifest are :mod:`.manifest`'s contract; usage and options: docs/tools.md, prepare_data.py).

Inputs are read by :mod:`.input_formats` and tokenized by :mod:`.tokenize_part`. Invalid UTF-8
stops the run at ``file:line`` unless ``encoding_errors="replace"``: a replaced byte would train
the model on U+FFFD. The input is cut into parts that depend on the files alone, each tokenized
into ``<output>.parts/`` (by ``workers`` processes, or one job per ``partition=(i, n)``), so a
finished part survives a killed run and the merged output is the same for any worker count or
partitioning. The output is renamed into place only when complete, so a failed run leaves an
earlier prepared directory as it was.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_wedlm.runtime.atomic_output import (
    DiskFullError,
    atomic_output_dir,
    atomic_write_text,
    check_output_dir,
    is_disk_full,
    remove_dead_writers,
)
from .input_formats import (
    ENCODING_ERRORS,
    BadLine,
    InputFormatError,
    InvalidUtf8Error,
    Part,
    collect_input_files,
    input_format,
    plan_parts,
)
from .manifest import FORMAT_VERSION, MANIFEST_FILE, TOKENIZER_DIR, VALID_DIR
from .tokenize_part import (
    DEFAULT_MASK_TOKEN,
    PART_FILE,
    PartOptions,
    PrepareOptions,
    PartResult,
    Sample,
    cached_run_tokenizer,
    holds_out,
    load_tokenizer_with_mask,
    part_dir_name,
    prepare_part,
    reply_end_token_id,
)

__all__ = [
    "BadLine",
    "InputFormatError",
    "InvalidUtf8Error",
    "PrepareOptions",
    "PrepareSummary",
    "Sample",
    "DEFAULT_MASK_TOKEN",
    "default_part_bytes",
    "ENCODING_ERRORS",
    "collect_input_files",
    "holds_out",
    "load_tokenizer_with_mask",
    "merge_parts",
    "prepare_dataset",
    "prepare_partition",
    "work_dir_of",
]

PLAN_FILE = "plan.json"
PLAN_VERSION = 1
_TEXT_UNITS = ("file", "paragraph", "line")
#: Bounds of the default part size, 1/64 of the input: many parts, so every worker gets several
#: and they finish together; at most 64 MiB, so a killed run loses little; at least 1 MiB, so a
#: part's fixed costs (a hand-off to a worker, a partial last shard) stay small.
MIN_PART_BYTES, MAX_PART_BYTES = 1 << 20, 64 << 20


@dataclass
class PrepareSummary:
    task: str
    output_dir: str
    num_samples: int = 0
    num_tokens: int = 0
    num_shards: int = 0
    mask_token_id: int = -1
    mask_token_added: bool = False
    end_token_id: int | None = None  # SFT: the token that ends a reply
    reply_end: str | None = None  # SFT: the text named as the reply's end (PrepareOptions.reply_end)
    bad_lines: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    invalid_utf8: dict[str, dict[str, int]] = field(default_factory=dict)  # file -> bytes, lines, first_line
    valid_fraction: float = 0.0
    valid_samples: int = 0  # held out to <output_dir>/valid (not counted in num_samples)
    valid_tokens: int = 0
    valid_shards: int = 0
    num_parts: int = 0

    def describe(self) -> str:
        lines = [
            f"wrote {self.num_samples} samples ({self.num_tokens} tokens) in {self.num_shards} shards "
            f"to {self.output_dir}",
        ]
        if self.valid_fraction:
            lines.append(
                f"held out {self.valid_samples} samples ({self.valid_tokens} tokens) in {self.valid_shards} shards "
                f"to {Path(self.output_dir) / VALID_DIR} (valid fraction {self.valid_fraction}) for data.valid_path"
            )
        lines += [
            f"mask token id {self.mask_token_id}" + (" (added to the tokenizer)" if self.mask_token_added else ""),
            f"skipped {self.bad_lines} bad lines"
            + (": " + ", ".join(f"{n} {r}" for r, n in sorted(self.bad_by_reason.items())) if self.bad_lines else ""),
        ]
        if self.invalid_utf8:
            replaced = sum(entry["bytes"] for entry in self.invalid_utf8.values())
            lines.append(f"replaced {replaced} invalid UTF-8 bytes by U+FFFD in {len(self.invalid_utf8)} file(s)")
        return "\n".join(lines)


@dataclass
class PartitionReport:
    """What one ``partition=(i, n)`` job did."""

    work_dir: str
    partition: tuple[int, int]
    parts: int  # parts of this partition
    already_done: int  # of them, finished by an earlier run
    remaining: int  # parts of the whole plan not yet finished (by any partition)

    def describe(self) -> str:
        i, n = self.partition
        done = f"partition {i}/{n}: {self.parts} parts finished in {self.work_dir}"
        if self.already_done:
            done += f" ({self.already_done} by an earlier run)"
        if self.remaining:
            return f"{done}; {self.remaining} parts of other partitions remain, then run --merge"
        return f"{done}; every part is finished: run --merge to write the output"


def work_dir_of(output_dir: str | Path) -> Path:
    """Where the parts of ``output_dir`` are prepared: a sibling, so linking them into the
    output stays on one file system, and shared by every partition's job."""
    out = Path(output_dir)
    return out.with_name(out.name + ".parts")


def _check_options(options: PartOptions) -> None:
    if options.task not in ("pretrain", "sft"):
        raise ValueError(f"task must be 'pretrain' or 'sft', got {options.task!r}")
    if options.text_unit not in _TEXT_UNITS:
        raise ValueError(f"text_unit must be one of {_TEXT_UNITS}, got {options.text_unit!r}")
    if options.samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {options.samples_per_shard}")
    if not 0.0 <= options.valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {options.valid_fraction}")
    if options.encoding_errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {options.encoding_errors!r}")


def _input_files(inputs: Sequence[str | Path], task: str) -> list[Path]:
    """The input files (:func:`collect_input_files`); SFT reads records, not plain text."""
    files = collect_input_files(inputs)
    if task == "sft":
        for path in files:
            if input_format(path) == "txt":
                raise ValueError(f"SFT input {path} is plain text: SFT records need 'messages' (or 'prompt' and "
                                 "'response'), in JSON lines, parquet or Arrow")
    return files


def default_part_bytes(files: Sequence[Path]) -> int:
    """Input bytes per part unless told: 1/64 of the input, within [:data:`MIN_PART_BYTES`,
    :data:`MAX_PART_BYTES`]; a function of the input alone, as parts must be."""
    total = sum(f.stat().st_size for f in files)
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, total // 64))


def _file_stats(files: Sequence[Path]) -> list[list[Any]]:
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _plan(inputs: Sequence[str | Path], out: Path, options: PartOptions, part_bytes: int | None, overwrite: bool
          ) -> dict[str, Any]:
    """Check everything a run needs before writing anything, and return the work directory's plan
    (an earlier one when the inputs and options are the same; its finished parts are then kept)."""
    _check_options(options)
    files = _input_files(inputs, options.task)
    part_bytes = part_bytes or default_part_bytes(files)
    check_output_dir(out, [*inputs, *files, options.tokenizer_dir], overwrite)
    tokenizer, _, _ = cached_run_tokenizer(options)  # loaded before the workers fork, which share it
    if options.reply_end is not None:
        reply_end_token_id(tokenizer, options.reply_end, options.task)
    work = work_dir_of(out)
    key = {"version": PLAN_VERSION, "inputs": [str(i) for i in inputs], "options": asdict(options),
           "fingerprint": options.fingerprint(), "part_bytes": part_bytes}
    stats = _file_stats(files)
    stored = _read_plan(work)
    if stored is not None and {k: stored.get(k) for k in key} == key and stored["files"] == stats:
        return stored
    if stored is not None and {k: stored.get(k) for k in key} != key:
        if not overwrite:
            raise ValueError(
                f"{work} holds the parts of a preparation with other inputs or options; re-run that one's "
                f"command to finish it, pass --overwrite to start over, or remove {work}"
            )
        shutil.rmtree(work)
        stored = None
    plan = {**key, "files": stats, "parts": [p.to_dict() for p in plan_parts(files, part_bytes)]}
    if stored is not None:
        _drop_changed_parts(work, stored, plan)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(work / PLAN_FILE, json.dumps(plan, indent=1) + "\n")
    return plan


def _drop_changed_parts(work: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Remove the finished parts that a changed input file (a re-downloaded one) made stale: a
    part is kept when it is the same part of the same file, unchanged (name, size, mtime)."""
    old_stats = {f: s for f, *s in old["files"]}
    new_stats = {f: s for f, *s in new["files"]}
    for index in range(len(old["parts"])):
        part = old["parts"][index]
        same = (index < len(new["parts"]) and new["parts"][index] == part
                and old_stats.get(part["file"]) == new_stats.get(part["file"]))
        if not same:
            shutil.rmtree(work / part_dir_name(index), ignore_errors=True)


def _read_plan(work: Path) -> dict[str, Any] | None:
    try:
        return json.loads((work / PLAN_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise ValueError(f"{work / PLAN_FILE} is unreadable ({err}); remove {work} and start over") from None


def _options_of(plan: dict[str, Any]) -> PartOptions:
    return PartOptions(**plan["options"])


def _finished(work: Path, index: int) -> bool:
    return (work / part_dir_name(index) / PART_FILE).is_file()


class _Progress:
    """One progress bar over parts, with documents and tokens per second."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="part", desc="prepare", disable=not enabled,
                        file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.docs = self.tokens = 0

    def add(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.docs} docs, {self.docs / elapsed:,.0f} docs/s, "
                                 f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)

    def part_done(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


_progress_queue: Any = None


def _init_worker(queue: Any) -> None:
    # one core per worker: the tokenizer's own thread pool would compete with the other workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _progress_queue
    _progress_queue = queue


def _worker_part(options: PartOptions, index: int, part: Part, work: Path) -> PartResult:
    return prepare_part(options, index, part, work, progress=lambda d, t: _progress_queue.put((d, t)))


def _run_parts(plan: dict[str, Any], indices: Sequence[int], workers: int, show_progress: bool, out: Path) -> int:
    """Prepare the unfinished parts among ``indices``; returns how many were finished before. A
    part that fails stops the run once the running parts are finished (:func:`_part_failed`)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    work = work_dir_of(out)
    options = _options_of(plan)
    parts = [Part(**p) for p in plan["parts"]]
    remove_dead_writers(work, "part-*")  # the part directories of killed runs on this host
    todo = [i for i in indices if not _finished(work, i)]
    progress = _Progress(len(indices), len(indices) - len(todo), show_progress)
    failure: tuple[int, BaseException] | None = None
    try:
        if workers == 1 or len(todo) <= 1:
            for i in todo:
                try:
                    prepare_part(options, i, parts[i], work, progress=progress.add)
                except (ValueError, OSError) as err:
                    failure = (i, err)
                    break
                progress.part_done()
        else:
            failure = _run_in_pool(options, parts, todo, work, workers, progress)
    finally:
        progress.close()
    if failure is not None:
        index, err = failure
        raise _part_failed(index, parts[index], work, out, err) from err
    return len(indices) - len(todo)


def _part_failed(index: int, part: Part, work: Path, out: Path, err: BaseException) -> BaseException:
    """The error a failed part stops the run with: a full disk named as such, else the part's
    error naming the part and the finished parts kept (none finished: the work directory goes)."""
    done = sum(1 for _ in work.glob(f"part-*/{PART_FILE}"))
    if not done:
        shutil.rmtree(work, ignore_errors=True)
    if is_disk_full(err, work.parent):
        return DiskFullError(out)
    kept = (f"\n{done} finished parts are kept in {work}; fix the input and run the same command again to "
            "prepare the others" if done else "")
    message = f"part {index} ({part.file}) failed: {err}{kept}"
    try:
        return type(err)(message) if isinstance(err, ValueError) else ValueError(message)
    except TypeError:  # an error class that takes more than a message
        return ValueError(message)


def _run_in_pool(options: PartOptions, parts: list[Part], todo: list[int], work: Path, workers: int,
                 progress: _Progress) -> tuple[int, BaseException] | None:
    """The parts in ``workers`` forked processes; a failure starts no new part, lets the running
    ones finish, and is returned (part, error)."""
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = context.Queue()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(queue,))
    failure: tuple[int, BaseException] | None = None
    try:
        pending: dict[Future, int] = {pool.submit(_worker_part, options, i, parts[i], work): i for i in todo}
        while pending:
            finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            _drain(queue, progress)
            for future in finished:
                index = pending.pop(future)
                if future.cancelled():
                    continue
                err = future.exception()
                if err is None:
                    progress.part_done()
                elif failure is None:
                    failure = (index, err)
                    for other in pending:
                        other.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _drain(queue, progress)
    return failure


def _drain(queue: Any, progress: _Progress) -> None:
    import queue as queue_module

    while True:
        try:
            docs, tokens = queue.get_nowait()
        except queue_module.Empty:
            return
        progress.add(docs, tokens)


def prepare_partition(
    inputs: Sequence[str | Path], output_dir: str | Path, tokenizer_dir: str | Path, partition: tuple[int, int],
    options: PrepareOptions = PrepareOptions(), *, workers: int = 1, part_bytes: int | None = None,
    overwrite: bool = False, show_progress: bool = False,
) -> PartitionReport:
    """Prepare partition ``i`` of ``n`` (``partition=(i, n)``) of the parts into the work
    directory; :func:`merge_parts` writes the output once every partition is finished. The other
    arguments are :func:`prepare_dataset`'s."""
    i, n = partition
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"partition {i}/{n}: give I/N with 0 <= I < N")
    out = Path(output_dir)
    plan = _plan(inputs, out, PartOptions.of(options, tokenizer_dir), part_bytes, overwrite)
    mine = [p for p in range(len(plan["parts"])) if p % n == i]
    before = _run_parts(plan, mine, workers, show_progress, out)
    work = work_dir_of(out)
    remaining = sum(1 for p in range(len(plan["parts"])) if not _finished(work, p))
    return PartitionReport(str(work), (i, n), len(mine), before, remaining)


def prepare_dataset(
    inputs: Sequence[str | Path], output_dir: str | Path, tokenizer_dir: str | Path,
    options: PrepareOptions = PrepareOptions(), *, workers: int = 1, part_bytes: int | None = None,
    overwrite: bool = False, show_progress: bool = False, report: Callable[[str], None] | None = None,
) -> PrepareSummary:
    """Tokenize ``inputs`` into a prepared directory ``output_dir`` as ``options`` say; returns
    the summary ``manifest.json`` stores. Every input is checked and the tokenizer loaded before
    anything is written; ``report`` (default stderr) gets each bad line, as ``file:line: reason``.
    """
    out = Path(output_dir)
    plan = _plan(inputs, out, PartOptions.of(options, tokenizer_dir), part_bytes, overwrite)
    before = _run_parts(plan, range(len(plan["parts"])), workers, show_progress, out)
    report = report or (lambda line: print(line, file=sys.stderr))
    if before:
        report(f"went on from an earlier run: {before} of {len(plan['parts'])} parts were finished")
    return merge_parts(out, overwrite=overwrite, report=report)


def merge_parts(output_dir: str | Path, *, overwrite: bool = False,
                report: Callable[[str], None] | None = None) -> PrepareSummary:
    """Write ``output_dir`` from its finished parts (after every partition's job): the parts'
    shards linked in part order, the tokenizer and the manifest; the work directory is removed."""
    out = Path(output_dir)
    work = work_dir_of(out)
    plan = _read_plan(work)
    if plan is None:
        raise FileNotFoundError(f"{work} holds no prepared parts of {out}: run tools/prepare_data.py with "
                                "--partition I/N first (or without it, to prepare and merge in one go)")
    options = _options_of(plan)
    report = report or (lambda line: print(line, file=sys.stderr))
    missing = [i for i in range(len(plan["parts"])) if not _finished(work, i)]
    if missing:
        shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(f"{len(missing)} of {len(plan['parts'])} parts are not finished ({shown}); run the "
                         "partitions that hold them (a part p belongs to partition p % N) before --merge")
    results = [PartResult.read(work / part_dir_name(i)) for i in range(len(plan["parts"]))]
    tokenizer, mask_id, added = cached_run_tokenizer(options)
    summary = _summary_of(results, options, tokenizer, out, mask_id, added, report)
    files = [Path(f) for f, _, _ in plan["files"]]
    with atomic_output_dir(out, inputs=[*plan["inputs"], *files, options.tokenizer_dir], overwrite=overwrite) as staging:
        shards = _link_shards(work, results, staging, valid=False)
        summary.num_shards = len(shards)
        tokenizer.save_pretrained(str(staging / TOKENIZER_DIR))
        manifest = _manifest(tokenizer, summary, shards, files, options.encoding_errors)
        if options.valid_fraction:
            valid_shards = _link_shards(work, results, staging / VALID_DIR, valid=True)
            summary.valid_shards = len(valid_shards)
            manifest["valid"] = {"path": VALID_DIR, "fraction": options.valid_fraction,
                                 "num_samples": summary.valid_samples, "num_tokens": summary.valid_tokens}
            _write_valid_manifest(staging / VALID_DIR, tokenizer, summary, manifest, valid_shards)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return summary


def _summary_of(results: Sequence[PartResult], options: PartOptions, tokenizer, out: Path, mask_id: int,
                added: bool, report: Callable[[str], None]) -> PrepareSummary:
    """The parts' counts added up; their bad lines reported in input order (the first ``max_reported``)."""
    summary = PrepareSummary(task=options.task, output_dir=str(out), mask_token_id=mask_id, mask_token_added=added,
                             valid_fraction=options.valid_fraction, reply_end=options.reply_end,
                             num_parts=len(results))
    reported = 0
    for result in results:
        summary.num_samples += result.samples
        summary.num_tokens += result.tokens
        summary.valid_samples += result.valid_samples
        summary.valid_tokens += result.valid_tokens
        summary.bad_lines += result.bad_lines
        for reason, count in result.bad_by_reason.items():
            summary.bad_by_reason[reason] = summary.bad_by_reason.get(reason, 0) + count
        for line in result.reported:
            if reported < options.max_reported:
                report(f"skipped {line}")
            reported += 1
        for file, entry in result.invalid_utf8.items():
            into = summary.invalid_utf8.setdefault(file, {"bytes": 0, "lines": 0, "first_line": 0})
            into["bytes"] += entry["bytes"]
            into["lines"] += entry["lines"]
            into["first_line"] = min(into["first_line"] or entry["first_line"], entry["first_line"])
        if summary.end_token_id is None and result.end_token_id is not None:
            summary.end_token_id = result.end_token_id
    if summary.bad_lines > options.max_reported:
        report(f"(further bad lines are counted but not listed; max_reported={options.max_reported})")
    for file, entry in summary.invalid_utf8.items():
        report(f"{file}:{entry['first_line']}: replaced {entry['bytes']} invalid UTF-8 byte(s) on "
               f"{entry['lines']} line(s) by U+FFFD")
    if summary.num_samples == 0:
        raise ValueError(f"no usable samples in {len(results)} input part(s); {summary.bad_lines} bad lines")
    if options.reply_end is not None:
        summary.end_token_id = reply_end_token_id(tokenizer, options.reply_end, options.task)
    elif options.task == "sft" and summary.end_token_id is None:
        summary.end_token_id = tokenizer.eos_token_id
    if options.valid_fraction and summary.valid_samples == 0:
        raise ValueError(
            f"valid_fraction={options.valid_fraction} held out none of the {summary.num_samples} documents; raise it "
            "(or leave it out for no validation split)"
        )
    return summary


def _link_shards(work: Path, results: Sequence[PartResult], directory: Path, valid: bool) -> list[dict[str, Any]]:
    """Every part's shards (or held-out shards), in part order, as ``directory/shard-NNNNNN.tar``:
    hard links where the file system allows (no copy of the data), copies elsewhere."""
    directory.mkdir(exist_ok=True)
    shards: list[dict[str, Any]] = []
    for result in results:
        source = work / part_dir_name(result.index) / (VALID_DIR if valid else "")
        for shard in result.valid_shards if valid else result.shards:
            name = f"shard-{len(shards):06d}.tar"
            try:
                os.link(source / shard["path"], directory / name)
            except OSError:
                shutil.copyfile(source / shard["path"], directory / name)
            shards.append({**shard, "path": name})
    return shards


def _write_valid_manifest(directory: Path, tokenizer, summary: PrepareSummary, train_manifest: dict[str, Any],
                          shards: list[dict[str, Any]]) -> None:
    """``valid/``'s tokenizer and manifest: the training manifest's tokenization, its own shards."""
    tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))
    manifest = {
        **{k: v for k, v in train_manifest.items() if k != "valid"},
        "num_samples": summary.valid_samples,
        "num_tokens": summary.valid_tokens,
        "shards": shards,
        "held_out": {"fraction": summary.valid_fraction, "training_data": ".."},
        "bad_lines": 0,  # counted in the training directory's manifest
        "bad_by_reason": {},
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _manifest(
    tokenizer, summary: PrepareSummary, shards: list[dict[str, Any]], files: list[Path], encoding_errors: str
) -> dict[str, Any]:
    """What ``manifest.json`` records: the format, the tokenizer's special ids, the shards and the summary."""
    return {
        "format_version": FORMAT_VERSION,
        "task": summary.task,
        "tokenizer": TOKENIZER_DIR,
        "mask_token": tokenizer.mask_token,
        "mask_token_id": summary.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **({"end_token_id": summary.end_token_id} if summary.task == "sft" else {}),
        **({"reply_end": summary.reply_end} if summary.reply_end is not None else {}),
        "pad_token_id": tokenizer.pad_token_id,
        "tokenizer_length": len(tokenizer),
        "num_samples": summary.num_samples,
        "num_tokens": summary.num_tokens,
        "shards": shards,
        "inputs": [str(f) for f in files],
        "bad_lines": summary.bad_lines,
        "bad_by_reason": summary.bad_by_reason,
        "encoding_errors": encoding_errors,
        "invalid_utf8": summary.invalid_utf8,
    }
