"""Run tasks under WeDLM streaming, block-wise and AR decoding of one model, side by side.

Every method sees the same model, prompts, stop tokens and (when sampling) per-example seeds, so
differences come from the decoder. Each entropy threshold in ``taus`` is swept for both parallel
methods; AR runs once.

* **speed mode**, the first ``speed_examples`` examples of each task: decoded one at a time, so
  tokens/s is single-stream latency; configurations are interleaved per example, so drifting
  machine load hits all alike, after one untimed warm-up decode per configuration.
* **accuracy mode**, every other example: continuous batches of ``batch_size`` rows
  (:func:`~megatron_wedlm.decoding.generate_batch`). A greedy row's output and counts do not
  depend on its neighbours, so the figures equal one-at-a-time decoding.

When sampling, every example is decoded alone with seed ``seed + index``. Over torchrun's
processes (:mod:`.sharding`) rank ``r`` decodes examples ``r, r + G, ...``, appends each finished
decode to ``parts_dir/rank{r}.jsonl`` (a restart skips it), and rank 0 returns the report one
process would write; the other ranks return None.
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

#: Default rows decoded together in accuracy mode, and examples per task timed in speed mode.
BATCH_SIZE, SPEED_EXAMPLES = 32, 16
Config = tuple[str, float | None]


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """One evaluation, built once by its caller and passed whole to :func:`evaluate`.

    ``tasks``: :class:`Task` objects or :func:`load_task` specs, cut to ``limit`` examples.
    ``settings`` steer every decode; per configuration and task the runner sets ``method``,
    ``entropy_threshold`` (from ``taus``), the budget (the task's, capped by ``max_new_tokens``)
    and the stops (the task's strings; the EOS too when ``stop_at_eos``). ``speed_examples``
    (None: all) are timed one at a time, the rest decoded ``batch_size`` rows together.
    ``shard``: this process's part of a torchrun launch; ``parts_dir``: finished decodes kept for
    a restart while the settings, examples and ``identity`` (e.g. the checkpoint files) match.
    """

    tasks: Sequence[Task | str]
    methods: Sequence[str] = METHODS
    taus: Sequence[float] = (0.4,)
    settings: DecodeSettings = dataclasses.field(default_factory=DecodeSettings)
    limit: int | None = None
    max_new_tokens: int | None = None
    stop_at_eos: bool = True
    seed: int = 0
    chat: bool = False
    batch_size: int = BATCH_SIZE
    speed_examples: int | None = SPEED_EXAMPLES
    warmup: bool = True
    keep_samples: bool = True
    progress: bool = False
    model_name: str | None = None
    shard: Shard | None = None
    parts_dir: str | None = None
    identity: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown decoding methods {unknown or self.methods}; choose from {METHODS}")
        if self.batch_size < 1 or (self.speed_examples is not None and self.speed_examples < 0):
            raise ValueError(f"batch_size must be >= 1 and speed_examples >= 0 (or None: all), got "
                             f"{self.batch_size} and {self.speed_examples}")

    @property
    def configs(self) -> list[Config]:
        """(method, tau) in report order: each tau for each parallel method, then AR once."""
        configs = [(m, float(t)) for m in self.methods if m in PARALLEL_METHODS for t in self.taus]
        return configs + ([("ar", None)] if "ar" in self.methods else [])


@dataclasses.dataclass
class _TaskWork:
    task: Task
    prompts: list[list[int]]
    settings: DecodeSettings


@dataclasses.dataclass
class _Setup:
    """What :func:`evaluate` derives from the plan and the model before decoding."""

    work: list[_TaskWork]
    base: DecodeSettings
    record: dict[str, Any]
    name: str
    device: torch.device
    dtype: str | None
    shard: Shard


def evaluate(model: Any, tokenizer: Any, plan: EvalPlan) -> EvalReport | None:
    """Evaluate ``plan``'s tasks with each of its methods: the report on rank 0, None on the others."""
    setup = _prepare(model, tokenizer, plan)
    records = setup.shard.gather(_decode_all(model, tokenizer, plan, setup))
    if records is None:
        return None
    by_key = {record_key(r): r for r in records}
    results, samples = _report_rows(setup.work, plan, by_key, setup.base.stop_token_ids)
    setup.record.update(device=str(setup.device), dtype=setup.dtype, processes=setup.shard.world,
                        torch=torch.__version__, python=platform.python_version(),
                        time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return EvalReport(model=setup.name, settings=setup.record, results=results, samples=samples)


def _prepare(model: Any, tokenizer: Any, plan: EvalPlan) -> _Setup:
    """Load and cut the tasks, find the mask and stop tokens, encode every prompt."""
    if not plan.tasks:
        raise ValueError("no tasks to evaluate")
    tasks = [load_task(t, limit=plan.limit) if isinstance(t, str) else t.limited(plan.limit) for t in plan.tasks]
    parallel = any(m in PARALLEL_METHODS for m in plan.methods)
    if parallel and not plan.taus:
        raise ValueError("streaming/blockwise need at least one entropy threshold in taus")
    mask_token_id = find_mask_token_id(model, tokenizer, plan.settings.mask_token_id)
    if mask_token_id is None and parallel:
        raise ValueError(
            "no mask token: set config.mask_token_id on the model, a mask token on the tokenizer, "
            "or pass mask_token_id; only method 'ar' works without one"
        )
    weight = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    device = weight.device if weight is not None else torch.device("cpu")
    # recorded with the report: tokens/s and near-tie answers depend on the weights' dtype
    dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else None
    stop_ids = eos_token_ids(model, tokenizer) if plan.stop_at_eos else []
    base = dataclasses.replace(plan.settings, mask_token_id=mask_token_id, stop_token_ids=stop_ids)
    work = []
    for task in tasks:
        budget = task.max_new_tokens if plan.max_new_tokens is None else min(task.max_new_tokens, plan.max_new_tokens)
        work.append(_TaskWork(task, [encode_prompt(tokenizer, ex.prompt, plan.chat) for ex in task.examples],
                              dataclasses.replace(base, max_new_tokens=budget, stop_strings=tuple(task.stop_strings))))
    name = (plan.model_name or getattr(getattr(model, "config", None), "_name_or_path", "")
            or type(model).__name__)
    return _Setup(work, base, _settings_record(plan, base, tasks), name, device, dtype, plan.shard or Shard())


def _settings_record(plan: EvalPlan, base: DecodeSettings, tasks: list[Task]) -> dict[str, Any]:
    """The settings the report records (the decoding ones under the names the CLI uses)."""
    return dict(
        methods=list(plan.methods), taus=[float(t) for t in plan.taus], window_size=base.window_size,
        distance_penalty=base.distance_penalty, refill="fused" if base.fused_refill else "paper",
        stop_fill="contiguous" if base.contiguous_stop else "anywhere", stop_penalty=base.stop_penalty,
        fallback="leftmost" if base.leftmost_fallback else "argmin", stop_at_eos=plan.stop_at_eos,
        max_new_tokens=plan.max_new_tokens, temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
        seed=plan.seed, chat=plan.chat, mask_token_id=base.mask_token_id, stop_token_ids=list(base.stop_token_ids),
        tasks={t.name: len(t.examples) for t in tasks}, speed_examples=plan.speed_examples,
        batch_size=plan.batch_size,
    )


def _decode_all(model: Any, tokenizer: Any, plan: EvalPlan, setup: _Setup) -> list[Record]:
    """This rank's decodes of every task, those kept from an interrupted run included."""
    log, done = None, {}
    if plan.parts_dir is not None:
        examples = {w.task.name: [ex.uid for ex in w.task.examples] for w in setup.work}
        outputs_depend_on = {k: v for k, v in setup.record.items() if k != "batch_size"}  # a row's output does not
        log = PartsLog(plan.parts_dir, setup.shard.rank, {"model": setup.name, "settings": outputs_depend_on,
                                                          "examples": examples, "identity": plan.identity or {}})
        done = log.open(setup.shard)
    configs = plan.configs
    keys = [(w.task.name, ex.uid, m, t) for w in setup.work for ex in w.task.examples for m, t in configs]
    bar = _Progress(sum(k not in done for k in keys), setup.shard, plan.progress)
    wanted = set(keys)
    mine = [r for r in done.values() if record_key(r) in wanted]

    def keep(rec: Record) -> None:
        mine.append(rec)
        if log is not None:
            log.append(rec)
        bar.advance()

    try:
        decoder = _Decoder(model, tokenizer, plan, setup.device)
        for w in setup.work:
            _decode_task(w, plan, setup.shard, done, decoder, keep)
        bar.wait_for_others()
    finally:
        if log is not None:
            log.close()
    bar.close()
    return mine


class _Decoder:
    """One example alone (speed mode, or any example when sampling) or many in batches (accuracy mode)."""

    def __init__(self, model: Any, tokenizer: Any, plan: EvalPlan, device: torch.device):
        self.model, self.tokenizer, self.seed, self.device = model, tokenizer, plan.seed, device
        self.sampling = plan.settings.temperature > 0
        self.batch_size = plan.batch_size

    def settings(self, w: _TaskWork, method: str, tau: float | None) -> DecodeSettings:
        config = dataclasses.replace(w.settings, method=method)
        return config if tau is None else dataclasses.replace(config, entropy_threshold=tau)

    def alone(self, w: _TaskWork, method: str, tau: float | None, index: int) -> Any:
        generator = None
        if self.sampling:  # same seed per example for every method
            generator = torch.Generator(device=self.device).manual_seed(self.seed + index)
        return generate(self.model, w.prompts[index], self.settings(w, method, tau), tokenizer=self.tokenizer,
                        generator=generator)

    def together(self, w: _TaskWork, method: str, tau: float | None, indices: list[int],
                 on_result: Callable[[int, Any], None]) -> None:
        """Decode ``indices``; ``on_result(example index, result)`` as each finishes."""
        if self.sampling:
            for i in indices:
                on_result(i, self.alone(w, method, tau, i))
            return
        generate_batch(self.model, [w.prompts[i] for i in indices], self.settings(w, method, tau),
                       tokenizer=self.tokenizer, batch_size=self.batch_size,
                       on_result=lambda k, result: on_result(indices[k], result))


def _decode_task(w: _TaskWork, plan: EvalPlan, shard: Shard, done: dict[tuple, Record], decoder: _Decoder,
                 keep: Callable[[Record], None]) -> None:
    """This rank's examples of one task: the speed sample one at a time, interleaved, then the rest in batches."""
    examples, configs = w.task.examples, plan.configs
    timed = len(examples) if plan.speed_examples is None else min(plan.speed_examples, len(examples))
    mine = [i for i in range(len(examples)) if shard.owns(i)]

    def pending(i: int, method: str, tau: float | None) -> bool:
        return (w.task.name, examples[i].uid, method, tau) not in done

    def finished(i: int, method: str, tau: float | None, result: Any, is_timed: bool) -> None:
        keep(_record(w, i, method, tau, result, decoder.tokenizer, w.settings.stop_token_ids, is_timed))

    speed = [i for i in mine if i < timed and any(pending(i, m, t) for m, t in configs)]
    if speed and plan.warmup:
        for method, tau in configs:
            decoder.alone(w, method, tau, speed[0])
    # every configuration decodes example i before any moves to i + 1: load drift hits all alike
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


def _report_rows(work: list[_TaskWork], plan: EvalPlan, records: dict[tuple, Record],
                 stop_ids: Sequence[int]) -> tuple[list[MethodResult], list[SampleRecord]]:
    """Judge every decode and sum each (task, configuration)'s row, examples in task order."""
    results: list[MethodResult] = []
    samples: list[SampleRecord] = []
    for w in work:
        task_results = []
        for method, tau in plan.configs:
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
            if plan.progress:
                print(_summary_line(result), file=sys.stderr, flush=True)
            if plan.keep_samples:
                samples += [
                    SampleRecord(w.task.name, method, tau, ex.uid, r["completion"], j.extracted, ex.reference,
                                 j.correct, r["new_tokens"], r["forwards"], r["seconds"], j.detail)
                    for ex, r, j in zip(w.task.examples, rows, judgements)
                ]
        _fill_speedups(task_results)
        results += task_results
    return results, samples


class _Progress:
    """One bar on rank 0 over every rank's decodes; the ranks count in torchrun's store, each at most
    every ``PERIOD_S`` seconds (an add is a round trip to the store server)."""

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
    """One model's reports from processes that each decoded some methods (the quickstart splits them
    over idle cores), as one report: rows and samples in ``methods`` order per task, speed-ups taken
    against the task's AR row again."""
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
