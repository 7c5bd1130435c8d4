"""Run tasks under WeDLM streaming, block-wise and AR decoding of one model, side by side.

Every method sees the same model, the same tokenized prompts, the same stop tokens and (when
sampling) the same per-example seeds, so accuracy and speed differences come from the decoder.
Entropy thresholds in ``taus`` are swept for both parallel methods (streaming and block-wise:
the same fill rule, different commit policy); AR has no threshold and runs once.

Prompts are decoded one at a time: tokens/s is then the single-stream latency the paper
reports, not a batched throughput. Configurations are interleaved per example, so drifting
machine load affects all of them alike, and one untimed warm-up decode per configuration keeps
one-off costs (allocator growth, kernel selection) out of the first example's timing.
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

from megatron_wedlm.decoding.api import generate
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids, find_mask_token_id
from megatron_wedlm.decoding.settings import METHODS, PARALLEL_METHODS, DecodeSettings
from megatron_wedlm.eval.registry import load_task
from megatron_wedlm.eval.results import EvalReport, MethodResult, SampleRecord
from megatron_wedlm.eval.tasks import Task, truncate_at_stop

#: ``decode_fn(model, prompt_ids, settings, *, tokenizer, generator) -> result`` where the result
#: has ``token_ids``, ``num_forwards``, ``num_slots`` and ``seconds``; the default is
#: :func:`megatron_wedlm.decoding.generate`. Generation stops at the tokenizer's EOS (unless
#: ``stop_at_eos=False``) and at the task's stop strings (``settings.stop_strings``, with the
#: ``tokenizer``), so no method spends time past the end of an answer.
DecodeFn = Callable[..., Any]


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
    **overrides: Any,
) -> EvalReport:
    """Evaluate ``tasks`` with each decoding method; see the module docstring for the protocol.

    ``tasks`` holds :class:`Task` objects or specs for :func:`load_task` (``"counting"``,
    ``"gsm8k:/data/test.jsonl"``); ``limit`` keeps the first N examples of each task.
    ``settings`` (and keyword ``overrides`` of its fields, e.g. ``window_size=8``,
    ``fused_refill=False`` for the paper's step order) steer every decode; ``method``,
    ``entropy_threshold`` (from ``taus``), ``max_new_tokens`` and the stop conditions are set per
    configuration and task. ``max_new_tokens`` caps every task's own budget (``None``: the task's
    budget). ``stop_at_eos``: the tokenizer's / model's EOS ends a generation (default, as the
    reference engine); the task's stop strings always do.
    """
    base = DecodeSettings.build(settings, **overrides)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown decoding methods {unknown or methods}; choose from {METHODS}")
    if not tasks:
        raise ValueError("no tasks to evaluate")
    tasks = [load_task(t, limit=limit) if isinstance(t, str) else t.limited(limit) for t in tasks]
    if any(m in PARALLEL_METHODS for m in methods) and not taus:
        raise ValueError("streaming/blockwise need at least one entropy threshold in taus")
    mask_token_id = find_mask_token_id(model, tokenizer, base.mask_token_id)
    if mask_token_id is None and any(m in PARALLEL_METHODS for m in methods):
        raise ValueError(
            "no mask token: set config.mask_token_id on the model, a mask token on the tokenizer, "
            "or pass mask_token_id; only method 'ar' works without one"
        )
    decode = decode_fn or generate
    device = next(iter(model.parameters())).device if hasattr(model, "parameters") else torch.device("cpu")
    stop_ids = eos_token_ids(model, tokenizer) if stop_at_eos else []
    base = dataclasses.replace(base, mask_token_id=mask_token_id, stop_token_ids=stop_ids)
    configs = [(m, float(t)) for m in methods if m in PARALLEL_METHODS for t in taus]
    configs += [("ar", None)] if "ar" in methods else []

    results: list[MethodResult] = []
    samples: list[SampleRecord] = []
    for task in tasks:
        budget = task.max_new_tokens if max_new_tokens is None else min(task.max_new_tokens, max_new_tokens)
        prompts = [encode_prompt(tokenizer, ex.prompt, chat) for ex in task.examples]
        task_settings = dataclasses.replace(base, max_new_tokens=budget, stop_strings=tuple(task.stop_strings))

        def run(method: str, tau: float | None, index: int) -> Any:
            generator = None
            if base.temperature > 0:  # same seed per example for every method
                generator = torch.Generator(device=device).manual_seed(seed + index)
            config = dataclasses.replace(task_settings, method=method)
            if tau is not None:
                config = dataclasses.replace(config, entropy_threshold=tau)
            return decode(model, prompts[index], config, tokenizer=tokenizer, generator=generator)

        if warmup:
            for method, tau in configs:
                run(method, tau, 0)
        # Interleaved: every configuration decodes example i before any moves to i + 1, so a
        # change in machine load hits all of them alike instead of skewing one method's speed.
        outputs: dict[tuple[str, float | None], list[Any]] = {c: [] for c in configs}
        for i in tqdm(range(len(prompts)), desc=task.name, disable=not progress, file=sys.stderr, leave=False):
            for method, tau in configs:
                outputs[(method, tau)].append(run(method, tau, i))

        task_results = []
        for (method, tau), config_outputs in outputs.items():
            completions = [
                truncate_at_stop(
                    tokenizer.decode(_emitted(o.token_ids, stop_ids), skip_special_tokens=True),
                    task.stop_strings,
                )
                for o in config_outputs
            ]
            judgements = task.judge_all(task.examples, completions)
            result = MethodResult(
                task=task.name, method=method, tau=tau, num_examples=len(config_outputs),
                num_correct=sum(j.correct for j in judgements),
                generated_tokens=sum(len(o.token_ids) for o in config_outputs),
                forwards=sum(int(o.num_forwards) for o in config_outputs),
                slots=sum(int(o.num_slots) for o in config_outputs),
                seconds=sum(float(o.seconds) for o in config_outputs),
            )
            task_results.append(result)
            if progress:
                print(_summary_line(result), file=sys.stderr, flush=True)
            if keep_samples:
                samples += [
                    SampleRecord(task.name, method, tau, ex.uid, c, j.extracted, ex.reference,
                                 j.correct, len(o.token_ids), int(o.num_forwards), float(o.seconds),
                                 j.detail)
                    for ex, c, j, o in zip(task.examples, completions, judgements, config_outputs)
                ]
        _fill_speedups(task_results)
        results += task_results

    record = dict(
        methods=list(methods), taus=[float(t) for t in taus], window_size=base.window_size,
        distance_penalty=base.distance_penalty, refill="fused" if base.fused_refill else "paper",
        stop_at_eos=stop_at_eos, max_new_tokens=max_new_tokens, temperature=base.temperature,
        top_k=base.top_k, top_p=base.top_p, seed=seed, chat=chat, mask_token_id=mask_token_id,
        stop_token_ids=stop_ids, tasks={t.name: len(t.examples) for t in tasks},
        device=str(device),
        torch=torch.__version__, python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    name = model_name or getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return EvalReport(model=name, settings=record, results=results, samples=samples)


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
