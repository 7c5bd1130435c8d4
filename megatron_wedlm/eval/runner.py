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

import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from megatron_wedlm.eval.registry import load_task
from megatron_wedlm.eval.results import EvalReport, MethodResult, SampleRecord
from megatron_wedlm.eval.tasks import Task, truncate_at_stop

METHODS: tuple[str, ...] = ("streaming", "blockwise", "ar")
PARALLEL_METHODS = ("streaming", "blockwise")

#: ``decode_fn(model, prompt_ids, method=..., **decode_kwargs) -> result`` where the result has
#: ``token_ids``, ``num_forwards``, ``num_slots`` and ``seconds``; the default is
#: :func:`megatron_wedlm.decoding.generate`. Generation stops at the tokenizer's EOS and at the
#: task's stop strings (passed as ``stop_strings`` with the ``tokenizer``), so no method spends
#: time past the end of an answer.
DecodeFn = Callable[..., Any]


def _default_decode_fn() -> DecodeFn:
    from megatron_wedlm.decoding import generate

    return generate


_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_checkpoint(
    path: str, device: str | None = None, dtype: str = "auto", require_mask_token: bool = True
) -> tuple[Any, Any]:
    """(model, tokenizer) of a local checkpoint via the decoding package's loader.

    ``dtype`` is a name (``auto``: bf16 on CUDA, fp32 on CPU); ``require_mask_token=False``
    admits plain AR checkpoints, for an AR-only evaluation.
    """
    from megatron_wedlm.decoding import load_tokenizer, load_wedlm_model

    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    model = load_wedlm_model(path, device=device, dtype=_DTYPES[dtype], require_mask_token=require_mask_token)
    return model, load_tokenizer(path)


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.append(source)
        elif isinstance(source, (list, tuple)):
            ids.extend(int(x) for x in source)
    return sorted(set(ids))


def _resolve_mask_token_id(model: Any, tokenizer: Any, mask_token_id: int | None) -> int | None:
    if mask_token_id is not None:
        return mask_token_id
    from_config = getattr(getattr(model, "config", None), "mask_token_id", None)
    return from_config if from_config is not None else getattr(tokenizer, "mask_token_id", None)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``; ``chat`` wraps it as a user turn with the chat template."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task | str],
    methods: Sequence[str] = METHODS,
    *,
    taus: Sequence[float] = (0.4,),
    limit: int | None = None,
    mask_token_id: int | None = None,
    window_size: int = 16,
    distance_penalty: float = 0.02,
    fused_refill: bool = True,
    stop_at_eos: bool = True,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    warmup: bool = True,
    keep_samples: bool = True,
    progress: bool = False,
    model_name: str | None = None,
    decode_fn: DecodeFn | None = None,
) -> EvalReport:
    """Evaluate ``tasks`` with each decoding method; see the module docstring for the protocol.

    ``tasks`` holds :class:`Task` objects or specs for :func:`load_task` (``"counting"``,
    ``"gsm8k:/data/test.jsonl"``); ``limit`` keeps the first N examples of each task.
    ``max_new_tokens`` caps every task's own budget (``None``: the task's budget).
    ``fused_refill``: the reference engine's schedule (default) or, False, the paper's step order
    (see :mod:`megatron_wedlm.decoding.parallel`). ``stop_at_eos``: the tokenizer's / model's EOS
    ends a generation (default, as the engine); the task's stop strings always do.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown decoding methods {unknown or methods}; choose from {METHODS}")
    if not tasks:
        raise ValueError("no tasks to evaluate")
    tasks = [load_task(t, limit=limit) if isinstance(t, str) else t.limited(limit) for t in tasks]
    if any(m in PARALLEL_METHODS for m in methods) and not taus:
        raise ValueError("streaming/blockwise need at least one entropy threshold in taus")
    mask_token_id = _resolve_mask_token_id(model, tokenizer, mask_token_id)
    if mask_token_id is None and any(m in PARALLEL_METHODS for m in methods):
        raise ValueError(
            "no mask token: set config.mask_token_id on the model, a mask token on the tokenizer, "
            "or pass mask_token_id; only method 'ar' works without one"
        )
    decode = decode_fn or _default_decode_fn()
    device = next(iter(model.parameters())).device if hasattr(model, "parameters") else torch.device("cpu")
    stop_ids = _stop_token_ids(model, tokenizer) if stop_at_eos else []
    configs = [(m, float(t)) for m in methods if m in PARALLEL_METHODS for t in taus]
    configs += [("ar", None)] if "ar" in methods else []

    results: list[MethodResult] = []
    samples: list[SampleRecord] = []
    for task in tasks:
        budget = task.max_new_tokens if max_new_tokens is None else min(task.max_new_tokens, max_new_tokens)
        prompts = [encode_prompt(tokenizer, ex.prompt, chat) for ex in task.examples]

        def run(method: str, tau: float | None, index: int) -> Any:
            generator = None
            if temperature > 0:  # same seed per example for every method
                generator = torch.Generator(device=device).manual_seed(seed + index)
            return decode(
                model, prompts[index], method=method, mask_token_id=mask_token_id,
                window_size=window_size, entropy_threshold=0.4 if tau is None else tau,
                distance_penalty=distance_penalty, max_new_tokens=budget,
                **({} if method == "ar" else {"fused_refill": fused_refill}),
                temperature=temperature, top_k=top_k, top_p=top_p,
                stop_token_ids=stop_ids, stop_strings=list(task.stop_strings), tokenizer=tokenizer,
                generator=generator,
            )

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

    settings = dict(
        methods=list(methods), taus=[float(t) for t in taus], window_size=window_size,
        distance_penalty=distance_penalty, refill="fused" if fused_refill else "paper", stop_at_eos=stop_at_eos,
        max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, chat=chat, mask_token_id=mask_token_id,
        stop_token_ids=stop_ids, tasks={t.name: len(t.examples) for t in tasks},
        device=str(device),
        torch=torch.__version__, python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    name = model_name or getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return EvalReport(model=name, settings=settings, results=results, samples=samples)


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


def _summary_line(r: MethodResult) -> str:
    tpf = f"{r.tokens_per_forward:.2f}" if r.tokens_per_forward is not None else "-"
    tps = f"{r.tokens_per_second:.1f}" if r.tokens_per_second is not None else "-"
    return f"{r.task:>12} | {r.label:<24} acc {r.accuracy:6.1%}  tok/fwd {tpf}  tok/s {tps}"
