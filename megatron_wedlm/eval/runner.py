"""Run tasks under WeDLM streaming, block-wise and AR decoding of one model, side by side.

Every method sees the same model, the same tokenized prompts, the same stop tokens and (when
sampling) the same per-example seeds, so accuracy and speed differences come from the decoder.
Entropy thresholds in ``taus`` are swept for both parallel methods (streaming and block-wise:
the same fill rule, different commit policy); AR has no threshold and runs once.

Accuracy and speed are two measurements:

* **speed mode**, on the first ``speed_examples`` examples of each task: prompts are decoded one at
  a time, so tokens/s is the single-stream latency the paper reports, not a batched throughput.
  Configurations are interleaved per example, so drifting machine load affects all of them
  alike, and one untimed warm-up decode per configuration keeps one-off costs (allocator growth,
  kernel selection) out of the first example's timing. Tokens/s and the speed-up over AR come
  from these decodes only (``MethodResult.timed_examples``).
* **accuracy mode**, every other example: decoded in batches of ``batch_size`` rows
  (:func:`~megatron_wedlm.decoding.generate_batch`: streaming and block-wise keep the batch full,
  a finished row's place going to the next prompt). A row's greedy output and its forward and
  slot counts do not depend on the rows beside it, so accuracy, tokens/forward and p_cache over
  all examples are those of one-at-a-time decoding. An example of the speed sample is not decoded
  again: its output would be the same.

When sampling (``temperature > 0``) every example is decoded alone with its own seed
(``seed + index``), so a draw does not depend on batch or process either.

Spread over processes (``shard``, from torchrun's environment, see :mod:`.sharding`): rank ``r``
decodes examples ``r, r + G, ...`` of every task, one model replica per process; each finished
decode is appended to ``parts_dir/rank{r}.jsonl`` at once, so a restart skips it; rank 0 gathers
every rank's decodes, judges them and returns the report, the same report one process writes for
the same examples (timings aside). The other ranks return None.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from megatron_wedlm.decoding.api import generate, generate_batch
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids, find_mask_token_id
from megatron_wedlm.decoding.settings import METHODS, PARALLEL_METHODS, DecodeSettings
from megatron_wedlm.eval.registry import load_task
from megatron_wedlm.eval.results import EvalReport, MethodResult, SampleRecord
from megatron_wedlm.eval.sharding import PartsLog, Record, Shard, record_key
from megatron_wedlm.eval.tasks import Task, truncate_at_stop

#: ``decode_fn(model, prompt_ids, settings, *, tokenizer, generator) -> result`` where the result
#: has ``token_ids``, ``num_forwards``, ``num_slots`` and ``seconds``; the default is
#: :func:`megatron_wedlm.decoding.generate`. Generation stops at the tokenizer's EOS (unless
#: ``stop_at_eos=False``) and at the task's stop strings (``settings.stop_strings``, with the
#: ``tokenizer``), so no method spends time past the end of an answer.
DecodeFn = Callable[..., Any]
#: ``decode_batch_fn(model, prompts, settings, *, tokenizer, batch_size, on_result) -> results``,
#: default :func:`megatron_wedlm.decoding.generate_batch`; ``on_result(index, result)`` as each
#: prompt finishes.
DecodeBatchFn = Callable[..., Any]
#: Default rows decoded together in accuracy mode, and examples per task timed in speed mode.
BATCH_SIZE, SPEED_EXAMPLES = 32, 16


@dataclasses.dataclass
class _TaskWork:
    task: Task
    prompts: list[list[int]]
    settings: DecodeSettings


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task | str],
    methods: Sequence[str] = METHODS,
    *,
    taus: Sequence[float] = (0.4,),
    settings: DecodeSettings | None = None,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    stop_at_eos: bool = True,
    seed: int = 0,
    chat: bool = False,
    warmup: bool = True,
    keep_samples: bool = True,
    progress: bool = False,
    model_name: str | None = None,
    decode_fn: DecodeFn | None = None,
    decode_batch_fn: DecodeBatchFn | None = None,
    batch_size: int = BATCH_SIZE,
    speed_examples: int | None = SPEED_EXAMPLES,
    shard: Shard | None = None,
    parts_dir: str | None = None,
    identity: dict[str, Any] | None = None,
    **overrides: Any,
) -> EvalReport | None:
    """Evaluate ``tasks`` with each decoding method; see the module docstring for the protocol.

    ``tasks`` holds :class:`Task` objects or specs for :func:`load_task` (``"counting"``,
    ``"gsm8k:/data/test.jsonl"``); ``limit`` keeps the first N examples of each task.
    ``settings`` (and keyword ``overrides`` of its fields, e.g. ``window_size=8``,
    ``fused_refill=False`` for the paper's step order) steer every decode; ``method``,
    ``entropy_threshold`` (from ``taus``), ``max_new_tokens`` and the stop conditions are set per
    configuration and task. ``max_new_tokens`` caps every task's own budget (``None``: the task's
    budget). ``stop_at_eos``: the tokenizer's / model's EOS ends a generation (default, as the
    reference engine); the task's stop strings always do.

    ``speed_examples``: examples per task timed one at a time (None: all, today's single-stream
    protocol for every example); ``batch_size``: rows decoded together for the rest. A custom
    ``decode_fn`` without ``decode_batch_fn`` decodes every example alone. ``shard``: this
    process's part of a run over several (default: one process); ``parts_dir``: where finished
    decodes are kept for a restart, valid while ``identity`` (e.g. the checkpoint files' sizes and
    times; the settings and examples are added here) stays the same. Returns the report on rank 0,
    None on other ranks.
    """
    base = DecodeSettings.build(settings, **overrides)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown decoding methods {unknown or methods}; choose from {METHODS}")
    if not tasks:
        raise ValueError("no tasks to evaluate")
    if batch_size < 1 or (speed_examples is not None and speed_examples < 0):
        raise ValueError(f"batch_size must be >= 1 and speed_examples >= 0 (or None: all), got {batch_size} and "
                         f"{speed_examples}")
    tasks = [load_task(t, limit=limit) if isinstance(t, str) else t.limited(limit) for t in tasks]
    if any(m in PARALLEL_METHODS for m in methods) and not taus:
        raise ValueError("streaming/blockwise need at least one entropy threshold in taus")
    mask_token_id = find_mask_token_id(model, tokenizer, base.mask_token_id)
    if mask_token_id is None and any(m in PARALLEL_METHODS for m in methods):
        raise ValueError(
            "no mask token: set config.mask_token_id on the model, a mask token on the tokenizer, "
            "or pass mask_token_id; only method 'ar' works without one"
        )
    shard = shard or Shard()
    weight = next(iter(model.parameters())) if hasattr(model, "parameters") else None
    device = weight.device if weight is not None else torch.device("cpu")
    # recorded with the report: tokens/s and near-tie answers depend on the weights' dtype
    dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else None
    stop_ids = eos_token_ids(model, tokenizer) if stop_at_eos else []
    base = dataclasses.replace(base, mask_token_id=mask_token_id, stop_token_ids=stop_ids)
    configs = [(m, float(t)) for m in methods if m in PARALLEL_METHODS for t in taus]
    configs += [("ar", None)] if "ar" in methods else []
    name = model_name or getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__

    record = dict(
        methods=list(methods), taus=[float(t) for t in taus], window_size=base.window_size,
        distance_penalty=base.distance_penalty, refill="fused" if base.fused_refill else "paper",
        stop_fill="contiguous" if base.contiguous_stop else "anywhere", stop_penalty=base.stop_penalty,
        fallback="leftmost" if base.leftmost_fallback else "argmin", stop_at_eos=stop_at_eos, max_new_tokens=max_new_tokens, temperature=base.temperature,
        top_k=base.top_k, top_p=base.top_p, seed=seed, chat=chat, mask_token_id=mask_token_id,
        stop_token_ids=stop_ids, tasks={t.name: len(t.examples) for t in tasks},
        speed_examples=speed_examples, batch_size=batch_size,
    )
    work = []
    for task in tasks:
        budget = task.max_new_tokens if max_new_tokens is None else min(task.max_new_tokens, max_new_tokens)
        work.append(_TaskWork(task, [encode_prompt(tokenizer, ex.prompt, chat) for ex in task.examples],
                              dataclasses.replace(base, max_new_tokens=budget, stop_strings=tuple(task.stop_strings))))

    log = None
    done: dict[tuple, Record] = {}
    if parts_dir is not None:
        examples = {w.task.name: [ex.uid for ex in w.task.examples] for w in work}
        outputs_depend_on = {k: v for k, v in record.items() if k != "batch_size"}  # a row's output does not
        log = PartsLog(parts_dir, shard.rank, {"model": name, "settings": outputs_depend_on, "examples": examples,
                                               "identity": identity or {}})
        done = log.open(shard)
    try:
        decoder = _Decoder(model, tokenizer, base, seed, device, decode_fn, decode_batch_fn, batch_size)
        keys = [(w.task.name, ex.uid, m, t) for w in work for ex in w.task.examples for m, t in configs]
        bar = _Progress(sum(k not in done for k in keys), shard, progress)
        wanted = set(keys)
        mine = [r for r in done.values() if record_key(r) in wanted]  # kept from an earlier, interrupted run

        def keep(rec: Record) -> None:
            mine.append(rec)
            if log is not None:
                log.append(rec)
            bar.advance()

        for w in work:
            _decode_task(w, configs, shard, done, decoder, keep, speed_examples, warmup)
        bar.wait_for_others()
    finally:
        if log is not None:
            log.close()
    records = shard.gather(mine)
    bar.close()
    if records is None:
        return None
    by_key = {record_key(r): r for r in records}
    results, samples = _report_rows(work, configs, by_key, stop_ids, keep_samples, progress)
    record.update(device=str(device), dtype=dtype, processes=shard.world, torch=torch.__version__,
                  python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return EvalReport(model=name, settings=record, results=results, samples=samples)


class _Decoder:
    """One example alone (speed mode, or any example when sampling) or many in batches (accuracy mode)."""

    def __init__(self, model: Any, tokenizer: Any, base: DecodeSettings, seed: int, device: torch.device,
                 decode_fn: DecodeFn | None, decode_batch_fn: DecodeBatchFn | None, batch_size: int):
        self.model, self.tokenizer, self.seed, self.device = model, tokenizer, seed, device
        self.sampling = base.temperature > 0
        self.one = decode_fn or generate
        self.batch = decode_batch_fn or (generate_batch if decode_fn is None else None)
        self.batch_size = batch_size

    def settings(self, w: _TaskWork, method: str, tau: float | None) -> DecodeSettings:
        config = dataclasses.replace(w.settings, method=method)
        return config if tau is None else dataclasses.replace(config, entropy_threshold=tau)

    def alone(self, w: _TaskWork, method: str, tau: float | None, index: int) -> Any:
        generator = None
        if self.sampling:  # same seed per example for every method
            generator = torch.Generator(device=self.device).manual_seed(self.seed + index)
        return self.one(self.model, w.prompts[index], self.settings(w, method, tau), tokenizer=self.tokenizer,
                        generator=generator)

    def together(self, w: _TaskWork, method: str, tau: float | None, indices: list[int],
                 on_result: Callable[[int, Any], None]) -> None:
        """Decode ``indices``; ``on_result(example index, result)`` as each finishes."""
        if self.sampling or self.batch is None:
            for i in indices:
                on_result(i, self.alone(w, method, tau, i))
            return
        self.batch(self.model, [w.prompts[i] for i in indices], self.settings(w, method, tau),
                   tokenizer=self.tokenizer, batch_size=self.batch_size,
                   on_result=lambda k, result: on_result(indices[k], result))


def _decode_task(w: _TaskWork, configs: list[tuple[str, float | None]], shard: Shard, done: dict[tuple, Record],
                 decoder: _Decoder, keep: Callable[[Record], None], speed_examples: int | None,
                 warmup: bool) -> None:
    """This rank's examples of one task: the speed sample one at a time, interleaved, then the rest in batches."""
    examples = w.task.examples
    timed = len(examples) if speed_examples is None else min(speed_examples, len(examples))
    mine = [i for i in range(len(examples)) if shard.owns(i)]

    def pending(i: int, method: str, tau: float | None) -> bool:
        return (w.task.name, examples[i].uid, method, tau) not in done

    def finished(i: int, method: str, tau: float | None, result: Any, is_timed: bool) -> None:
        keep(_record(w, i, method, tau, result, decoder.tokenizer, w.settings.stop_token_ids, is_timed))

    speed = [i for i in mine if i < timed and any(pending(i, m, t) for m, t in configs)]
    if speed and warmup:
        for method, tau in configs:
            decoder.alone(w, method, tau, speed[0])
    # Interleaved: every configuration decodes example i before any moves to i + 1, so a change in
    # machine load hits all of them alike instead of skewing one method's speed.
    for i in speed:
        for method, tau in configs:
            if pending(i, method, tau):
                finished(i, method, tau, decoder.alone(w, method, tau, i), True)
    for method, tau in configs:
        rest = [i for i in mine if i >= timed and pending(i, method, tau)]
        if rest:
            decoder.together(w, method, tau, rest,
                             lambda i, result, m=method, t=tau: finished(i, m, t, result, False))


def _record(w: _TaskWork, index: int, method: str, tau: float | None, result: Any, tokenizer: Any,
            stop_ids: Sequence[int], timed: bool) -> Record:
    text = tokenizer.decode(_emitted(result.token_ids, stop_ids), skip_special_tokens=True)
    return dict(task=w.task.name, uid=w.task.examples[index].uid, method=method, tau=tau,
                completion=truncate_at_stop(text, w.task.stop_strings), new_tokens=len(result.token_ids),
                forwards=int(result.num_forwards), slots=int(result.num_slots),
                seconds=float(result.seconds) if timed else None)


def _report_rows(work: list[_TaskWork], configs: list[tuple[str, float | None]], records: dict[tuple, Record],
                 stop_ids: Sequence[int], keep_samples: bool,
                 progress: bool) -> tuple[list[MethodResult], list[SampleRecord]]:
    """Judge every decode and sum each (task, configuration)'s row, examples in task order."""
    results: list[MethodResult] = []
    samples: list[SampleRecord] = []
    for w in work:
        task_results = []
        for method, tau in configs:
            rows = [records[(w.task.name, ex.uid, method, tau)] for ex in w.task.examples]
            judgements = w.task.judge_all(w.task.examples, [r["completion"] for r in rows])
            timed = [r for r in rows if r["seconds"] is not None]
            result = MethodResult(
                task=w.task.name, method=method, tau=tau, num_examples=len(rows),
                num_correct=sum(j.correct for j in judgements),
                generated_tokens=sum(r["new_tokens"] for r in rows),
                forwards=sum(r["forwards"] for r in rows),
                slots=sum(r["slots"] for r in rows),
                seconds=sum(r["seconds"] for r in timed),
                timed_examples=len(timed), timed_tokens=sum(r["new_tokens"] for r in timed),
            )
            task_results.append(result)
            if progress:
                print(_summary_line(result), file=sys.stderr, flush=True)
            if keep_samples:
                samples += [
                    SampleRecord(w.task.name, method, tau, ex.uid, r["completion"], j.extracted, ex.reference,
                                 j.correct, r["new_tokens"], r["forwards"], r["seconds"], j.detail)
                    for ex, r, j in zip(w.task.examples, rows, judgements)
                ]
        _fill_speedups(task_results)
        results += task_results
    return results, samples


class _Progress:
    """One bar on rank 0 over every rank's decodes, with an ETA; the ranks count in torchrun's store.

    A rank adds its count to the store at most every ``PERIOD_S`` seconds: each add is a round trip
    to the launcher's store server, which a decode of a small model should not wait for every time.
    """

    PERIOD_S = 1.0

    def __init__(self, total: int, shard: Shard, enabled: bool):
        self.shard, self.total = shard, total
        self.bar = tqdm(total=total, desc="evaluate", unit="decode", file=sys.stderr, dynamic_ncols=True,
                        disable=not enabled or shard.rank != 0)
        self.pending, self.sent = 0, time.monotonic()

    def advance(self) -> None:
        if self.shard.world == 1:
            self.bar.update(1)
            return
        self.pending += 1
        if time.monotonic() - self.sent >= self.PERIOD_S:
            self._flush()

    def _flush(self) -> None:
        self._show(self.shard.count("done", self.pending))
        self.pending, self.sent = 0, time.monotonic()

    def _show(self, n: int) -> None:
        self.bar.update(min(n, self.total) - self.bar.n)

    def wait_for_others(self) -> None:
        """Rank 0 keeps the bar moving while the other ranks finish (their results come in the gather)."""
        if self.shard.world == 1:
            return
        self._flush()
        self.shard.count("finished", 1)
        if self.shard.rank == 0:
            while self.shard.count("finished") < self.shard.world:
                self._show(self.shard.count("done"))
                time.sleep(0.5)
            self._show(self.shard.count("done"))

    def close(self) -> None:
        self.bar.close()


def _emitted(token_ids: Any, stop_ids: Sequence[int]) -> list[int]:
    """Output ids without a trailing stop token (decoders emit the stop token itself)."""
    ids = [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def _fill_speedups(task_results: list[MethodResult]) -> None:
    ar = next((r for r in task_results if r.method == "ar"), None)
    if ar is None or not ar.tokens_per_second:
        return
    for r in task_results:
        if r.tokens_per_second is not None:
            r.speedup_vs_ar = r.tokens_per_second / ar.tokens_per_second


def combine_reports(reports: Sequence[EvalReport], methods: Sequence[str] = METHODS) -> EvalReport:
    """One model's reports from several processes, each decoding some of the methods, as one report.

    Why: one process decodes its configurations one after the other, so a caller with idle cores
    (the quickstart) splits the methods across processes. Rows and samples come back per task in
    ``methods`` order, as one process would have written them, and every speed-up is taken against
    its task's AR row again. Only rows measured in the same process as that AR row were
    interleaved with it example by example (see the module docstring); the others ran beside it
    at the same time.
    """
    if not reports:
        raise ValueError("combine_reports needs at least one report")
    models = {r.model for r in reports}
    if len(models) > 1:
        raise ValueError(f"combine_reports got reports of different models: {sorted(models)}")
    unknown = sorted({m for r in reports for m in r.methods} - set(methods))
    if unknown:
        raise ValueError(f"methods {unknown} are not in the order given ({list(methods)})")
    tasks = list(dict.fromkeys(t for r in reports for t in r.tasks))
    task_rank, method_rank = {t: i for i, t in enumerate(tasks)}, {m: i for i, m in enumerate(methods)}

    def order(row: Any) -> tuple[int, int]:
        return task_rank[row.task], method_rank[row.method]

    results = sorted((dataclasses.replace(r) for report in reports for r in report.results), key=order)
    for task in tasks:
        _fill_speedups([r for r in results if r.task == task])
    samples = sorted((s for report in reports for s in report.samples), key=order)
    settings = {**reports[0].settings, "methods": [m for m in methods if any(m in r.methods for r in reports)]}
    return EvalReport(model=reports[0].model, settings=settings, results=results, samples=samples)


def _summary_line(r: MethodResult) -> str:
    tpf = f"{r.tokens_per_forward:.2f}" if r.tokens_per_forward is not None else "-"
    tps = f"{r.tokens_per_second:.1f}" if r.tokens_per_second is not None else "-"
    return f"{r.task:>12} | {r.label:<24} acc {r.accuracy:6.1%}  tok/fwd {tpf}  tok/s {tps}"
