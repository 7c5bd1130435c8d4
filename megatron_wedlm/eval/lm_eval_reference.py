"""lm-evaluation-harness's own ``hf`` model on given multiple-choice items: the reference that
:mod:`.multiple_choice` must reproduce (:func:`lm_eval_mc_logprobs` runs any lm-eval model).

The items go to a local jsonl and a task YAML that use their fields unchanged, so the harness
builds the same requests; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_wedlm.eval.multiple_choice import MCItem

_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _write_task(items: Sequence[MCItem], work_dir: Path) -> str:
    rows = [{"id": it.id, "context": it.context, "choices": list(it.choices), "gold": it.gold} for it in items]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    name = "wedlm_mc_reference_" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    task_dir = work_dir / name
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / "items.jsonl"
    data.write_text(text, encoding="utf-8")
    (task_dir / f"{name}.yaml").write_text(
        _TASK_YAML.format(name=name, data=json.dumps(str(data)), cache=json.dumps(str(task_dir / "hf_cache"))),
        encoding="utf-8")
    return name


def lm_eval_hf_logprobs(
    model_dir: str,
    items: Sequence[MCItem],
    work_dir: str,
    batch_size: int = 8,
    with_metrics: bool = False,
) -> list[tuple[float, ...]] | tuple[list[tuple[float, ...]], list[tuple[int, int]]]:
    """Per item, in order, lm-eval's per-choice log-likelihoods from ``hf`` (fp32, CPU, zero-shot).

    With ``with_metrics=True`` also returns lm-eval's own ``(acc, acc_norm)`` per item.
    """
    if not items:
        return ([], []) if with_metrics else []
    _offline()
    from lm_eval.models.huggingface import HFLM  # the class itself: the registry's lazy names are
    # missing once another module registered a model first

    model = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=batch_size)
    return lm_eval_mc_logprobs(model, items, work_dir, with_metrics)


def _offline() -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def lm_eval_mc_logprobs(
    model: Any,
    items: Sequence[MCItem],
    work_dir: str,
    with_metrics: bool = False,
) -> list[tuple[float, ...]] | tuple[list[tuple[float, ...]], list[tuple[int, int]]]:
    """:func:`lm_eval_hf_logprobs` for any lm-eval model instance ``model`` (e.g. lm-eval's
    ``LocalCompletionsAPI`` against a server): the same task file, the same read-back."""
    if not items:
        return ([], []) if with_metrics else []
    _offline()
    import lm_eval
    from lm_eval.tasks import TaskManager

    work = Path(work_dir).resolve()
    task_dir = work / "lm_eval_tasks"
    name = _write_task(items, task_dir)
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=[name],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # lm-eval's own take long to index
        num_fewshot=0,
        log_samples=True,
    )
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    if [s["doc_id"] for s in samples] != list(range(len(items))):
        raise RuntimeError(f"lm-eval logged {len(samples)} samples for {len(items)} items")
    logprobs, metrics = [], []
    for item, sample in zip(items, samples):
        if sample["doc"]["id"] != item.id:
            raise RuntimeError(f"lm-eval sample {sample['doc_id']} is item {sample['doc']['id']}, not {item.id}")
        # filtered_resps: one (loglikelihood, is_greedy) per choice ("none" filter: resps unchanged)
        logprobs.append(tuple(float(resp[0]) for resp in sample["filtered_resps"]))
        metrics.append((int(sample["acc"]), int(sample["acc_norm"])))
    return (logprobs, metrics) if with_metrics else logprobs
