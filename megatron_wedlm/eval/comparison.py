"""A base model and its WeDLM(s) side by side, shaped like the paper's main table.

Three optional parts: multiple choice by log-likelihood (:mod:`.multiple_choice`, every model in
AR mode, each WeDLM paired with the base on the same items); generation tasks (AR and streaming
per model, accuracy with its interval, speed-ups over its own and the base's AR); chat prompts
(:mod:`.chat_speed`). Rank 0 of a torchrun launch returns the report, the others None.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_wedlm.decoding.inputs import find_mask_token_id, load_checkpoint
from megatron_wedlm.decoding.settings import DecodeSettings
from megatron_wedlm.eval.chat_speed import decode_chat_prompts, summarize_chat
from megatron_wedlm.eval.multiple_choice import (
    MCItem,
    MCScore,
    load_mc_set,
    mean_with_interval,
    paired_difference,
    score_multiple_choice,
)
from megatron_wedlm.eval.sharding import Shard
from megatron_wedlm.eval.tasks import arc_spelling

__all__ = ["ComparePlan", "ModelSpec", "compare_models", "comparison_markdown", "plot_comparison", "write_comparison",
           "parse_mc_sets"]

AR, STREAMING = "ar", "streaming"
#: Chance accuracy of each multiple-choice set (four options each).
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "mmlu": 0.25}
DEFAULT_MC_SETS = "arc_easy,arc_challenge,hellaswag:1000,mmlu:1000"


@dataclass(frozen=True)
class ModelSpec:
    """``name`` as the table shows it; ``base``: the AR model the others are compared with."""

    name: str
    path: str
    base: bool = False


def parse_mc_sets(text: str) -> list[tuple[str, int | None]]:
    """``"arc_easy,hellaswag:1000"`` -> ``[("arc_easy", None), ("hellaswag", 1000)]`` (None: every item)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, limit = part.partition(":")
        name = arc_spelling(name)  # arc_c / arc_e: the paper suite's spelling of the same sets
        if name not in CHANCE:
            raise ValueError(f"unknown multiple-choice set {name!r}; choose from {sorted(CHANCE)}")
        out.append((name, int(limit) if limit else None))
    return out


def _log(message: str) -> None:
    print(f"[compare] {message}", flush=True)


@dataclass(frozen=True)
class ComparePlan:
    """What a comparison runs, built once by its caller.

    ``settings``: the streaming operating point; ``dtype`` the decoding precision, ``mc_dtype`` the
    scoring one (float32: lm-eval's numbers); ``device`` "cuda": each rank's own GPU; ``cache_dir``
    keeps each model's multiple-choice scores (keyed by weights, items, precision)."""

    mc_sets: Sequence[tuple[str, int | None]] = ()
    gen_tasks: Sequence[str] = ()
    gen_limit: int | None = None
    chat_prompts: Sequence[str] = ()
    settings: DecodeSettings = field(default_factory=DecodeSettings)
    dtype: str = "auto"
    mc_dtype: str = "float32"
    mc_batch_size: int = 16
    chat: bool = True
    device: str = "cpu"
    cache_dir: str | None = None


def compare_models(models: Sequence[ModelSpec], plan: ComparePlan, shard: Shard | None = None,
                   log: Callable[[str], None] = _log) -> dict[str, Any] | None:
    """Run every part of ``plan`` for every model; the report as a JSON-ready dict on rank 0."""
    if sum(m.base for m in models) != 1:
        raise ValueError("give exactly one base model")
    shard = shard or Shard()
    if plan.device == "cuda":
        plan = dataclasses.replace(plan, device=f"cuda:{shard.local_rank}")
    started = time.time()
    report = _report_header(models, plan, shard)
    mc_items = {name: load_mc_set(name, limit) for name, limit in plan.mc_sets}
    per_item: dict[str, dict[str, Any]] = {name: {} for name in mc_items}
    for spec in models:
        for name, scores in _score_model(spec, mc_items, plan, shard.rank == 0, log).items():
            per_item[name][spec.name] = scores
        if plan.gen_tasks or plan.chat_prompts:
            _decode_parts(spec, report, plan, shard, log)
    if shard.rank != 0:
        return None
    base = next(m.name for m in models if m.base)
    for name, by_model in per_item.items():
        report["multiple_choice"][name] = _mc_entry(name, by_model, base)
    _speedups_vs_base(report, base)
    report["seconds"] = round(time.time() - started, 1)
    return report


def _report_header(models: Sequence[ModelSpec], plan: ComparePlan, shard: Shard) -> dict[str, Any]:
    settings = plan.settings
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "processes": shard.world},
        "models": {m.name: {"path": m.path, "base": m.base} for m in models},
        "settings": {"window_size": settings.window_size, "entropy_threshold": settings.entropy_threshold,
                     "distance_penalty": settings.distance_penalty, "leftmost_fallback": settings.leftmost_fallback,
                     "contiguous_stop": settings.contiguous_stop, "stop_penalty": settings.stop_penalty,
                     "max_new_tokens": settings.max_new_tokens, "dtype": plan.dtype, "mc_dtype": plan.mc_dtype,
                     "chat": plan.chat},
        "multiple_choice": {}, "generation": {}, "chat": {},
    }


def _score_model(spec: ModelSpec, mc_items: dict[str, list[MCItem]], plan: ComparePlan, lead: bool,
                 log: Callable[[str], None]) -> dict[str, list[MCScore]]:
    """One model's multiple-choice scores per set, read from the cache where it has them."""
    model = tokenizer = None
    out = {}
    for name, items in mc_items.items():
        cached = _cache_file(plan.cache_dir, spec, name, items, plan.mc_dtype)
        if cached is not None and cached.is_file():
            out[name] = [MCScore(**{**d, "logprobs": tuple(d["logprobs"]), "is_greedy": tuple(d["is_greedy"])})
                         for d in json.loads(cached.read_text())]
            if lead:
                log(f"{spec.name} {name}: scores read from {cached}")
            continue
        if model is None:
            model, tokenizer = load_checkpoint(spec.path, device=plan.device, dtype=plan.mc_dtype,
                                               require_mask_token=False)
        exclude = None if spec.base else find_mask_token_id(model, tokenizer, None)
        t0 = time.time()
        tenth = [0]

        def progress(done: int, total: int, name: str = name, tenth: list[int] = tenth) -> None:
            if lead and 10 * done // total > tenth[0]:
                tenth[0] = 10 * done // total
                log(f"{spec.name} {name}: {done}/{total} choices scored, {time.time() - t0:.0f}s")

        out[name] = scores = score_multiple_choice(model, tokenizer, items, batch_size=plan.mc_batch_size,
                                                   exclude_token_id=exclude, on_progress=progress)
        if lead:
            log(f"{spec.name} {name}: {len(items)} items in {time.time() - t0:.0f}s, acc "
                f"{sum(s.acc for s in scores) / len(scores):.3f}")
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps([dataclasses.asdict(x) for x in scores]))
    return out


def _speedups_vs_base(report: dict[str, Any], base: str) -> None:
    """Every generation row's and every chat row's tokens/s over the base model's AR."""
    for by_model in report["generation"].values():
        base_ar = (by_model.get(base) or {}).get(AR, {}).get("tokens_per_second")
        for methods in by_model.values():
            for entry in methods.values():
                tps = entry.get("tokens_per_second")
                entry["speedup_vs_base_ar"] = tps / base_ar if tps and base_ar else None
    base_ar = report["chat"].get(base, {}).get("ar_tokens_per_second")
    for name, entry in report["chat"].items():
        if name != base:
            entry["speedup_vs_base_ar"] = (entry["streaming_tokens_per_second"] / base_ar) if base_ar else None


def _cache_file(cache_dir: str | None, spec: ModelSpec, name: str, items: Sequence[MCItem],
                dtype: str) -> Path | None:
    """Where one model's scores on one item set are kept: keyed by the weights files' names, sizes
    and times, whether the mask token is excluded (WeDLM) or not, the item ids and the precision."""
    if cache_dir is None:
        return None
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(spec.path).glob("*.safetensors"))
    key = json.dumps([str(Path(spec.path).resolve()), weights, spec.base, dtype, [it.id for it in items]])
    return Path(cache_dir) / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _mc_entry(name: str, by_model: dict[str, list[Any]], base: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"items": len(by_model[base]), "chance": CHANCE[name], "models": {}, "vs_base": {}}
    for model, scores in by_model.items():
        entry["models"][model] = {metric: list(mean_with_interval([getattr(s, metric) for s in scores]))
                                  for metric in ("acc", "acc_norm")}
        if model != base:
            entry["vs_base"][model] = {metric: list(paired_difference([getattr(s, metric) for s in scores],
                                                                      [getattr(s, metric) for s in by_model[base]]))
                                       for metric in ("acc", "acc_norm")}
    return entry


def _decode_parts(spec: ModelSpec, report: dict[str, Any], plan: ComparePlan, shard: Shard,
                  log: Callable[[str], None]) -> None:
    """One model's generation tasks and chat prompts, into ``report``."""
    model, tokenizer = load_checkpoint(spec.path, device=plan.device, dtype=plan.dtype,
                                       require_mask_token=not spec.base)
    if plan.gen_tasks:
        _generation(model, tokenizer, spec, report, plan, shard, log)

    def on_prompt(k: int, n: int) -> None:
        if k % 8 == 0 or k == n:
            log(f"{spec.name} chat: {k}/{n} prompts")

    prompts, settings = plan.chat_prompts, plan.settings
    if prompts and not spec.base:
        decodes = decode_chat_prompts(model, tokenizer, prompts, settings, shard=shard, on_prompt=on_prompt)
        if decodes is not None:
            report["chat"][spec.name] = summarize_chat(decodes).to_dict()
    elif prompts:  # the base model has no streaming: its AR speed is the reference
        ar = decode_chat_prompts(model, tokenizer, prompts, settings, shard=shard, on_prompt=on_prompt, ar_only=True)
        if ar is not None:
            summary = summarize_chat(ar).to_dict()
            report["chat"][spec.name] = {k: summary[k] for k in ("prompts", "ar_tokens", "ar_seconds",
                                                                  "ar_tokens_per_second", "mean_ar_length")}
    del model


def _generation(model: Any, tokenizer: Any, spec: ModelSpec, report: dict[str, Any], plan: ComparePlan,
                shard: Shard, log: Callable[[str], None]) -> None:
    """One model's generation tasks through the runner: AR, and streaming for a WeDLM."""
    from megatron_wedlm.eval.runner import EvalPlan, evaluate  # the generation runner, only when asked for

    tau = plan.settings.entropy_threshold if plan.settings.entropy_threshold is not None else 0.0
    result = evaluate(model, tokenizer, EvalPlan(
        list(plan.gen_tasks), [AR] if spec.base else [AR, STREAMING], taus=[tau], settings=plan.settings,
        limit=plan.gen_limit, chat=plan.chat, shard=shard, model_name=spec.name, keep_samples=False))
    if result is None:
        return
    for r in result.results:
        report["generation"].setdefault(r.task, {}).setdefault(spec.name, {})[r.method] = {
            "n": r.num_examples, "accuracy": r.accuracy, "ci95": list(r.accuracy_ci95 or ()),
            "tokens_per_forward": r.tokens_per_forward, "tokens_per_second": r.tokens_per_second,
            "speedup_vs_ar": r.speedup_vs_ar}
        log(f"{spec.name} {r.task} {r.method}: accuracy {r.accuracy:.3f}, "
            f"{r.tokens_per_forward or 0:.2f} tokens/forward")


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _interval(triple: Sequence[float]) -> str:
    mean, lo, hi = triple
    return f"{_pct(mean)} [{_pct(lo)}, {_pct(hi)}]"


def comparison_markdown(report: dict[str, Any]) -> str:
    """report.md: one table per part (rows: benchmarks; columns: model x method)."""
    names = list(report["models"])
    base = next(n for n, m in report["models"].items() if m["base"])
    s = report["settings"]
    lines = [f"# {' vs '.join(names)}", "",
             f"{report['date']}; {report['machine']['processor'] or report['machine']['platform']}, "
             f"{report['machine']['cpus']} CPUs, {report['machine']['processes']} process(es). Streaming: window "
             f"{s['window_size']}, tau {s['entropy_threshold']}, lambda {s['distance_penalty']}, fallback "
             f"{'leftmost' if s['leftmost_fallback'] else 'argmin'}; decoding in {s['dtype']}, scoring in "
             f"{s['mc_dtype']}. Accuracies in %, with 95% intervals."]
    if report["multiple_choice"]:
        lines += ["", "## Multiple choice (log-likelihood, AR mode; acc_norm as lm-eval)", "",
                  "| set | items | chance | " + " | ".join(f"{n} acc_norm" for n in names)
                  + " | " + " | ".join(f"{n} - {base} (paired)" for n in names if n != base) + " | acc: "
                  + " / ".join(names) + " |",
                  "|---" * (4 + 2 * len(names) - 1) + "|"]
        for name, e in report["multiple_choice"].items():
            lines.append(f"| {name} | {e['items']} | {_pct(e['chance'])} | "
                         + " | ".join(_interval(e["models"][n]["acc_norm"]) for n in names) + " | "
                         + " | ".join(_interval(e["vs_base"][n]["acc_norm"]) for n in names if n != base) + " | "
                         + " / ".join(_pct(e["models"][n]["acc"][0]) for n in names) + " |")
    if report["generation"]:
        cols = [(n, m) for n in names for m in ((AR,) if n == base else (AR, STREAMING))]
        lines += ["", "## Generation", "",
                  "| task | " + " | ".join(f"{n} {m}" for n, m in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for task, by_model in report["generation"].items():
            cells = []
            for n, m in cols:
                e = by_model.get(n, {}).get(m)
                if e is None:
                    cells.append("-")
                    continue
                lo_hi = f" [{_pct(e['ci95'][0])}, {_pct(e['ci95'][1])}]" if e["ci95"] else ""
                speed = (f"; {e['tokens_per_forward']:.2f} tok/fwd, {e['tokens_per_second'] or 0:.1f} tok/s"
                         + (f", {e['speedup_vs_ar']:.2f}x own AR" if m == STREAMING and e["speedup_vs_ar"] else "")
                         + (f", {e['speedup_vs_base_ar']:.2f}x base AR" if e.get("speedup_vs_base_ar") and n != base
                            else ""))
                cells.append(f"{_pct(e['accuracy'])}{lo_hi}{speed}")
            lines.append(f"| {task} (n={next(iter(next(iter(by_model.values())).values()))['n']}) | "
                         + " | ".join(cells) + " |")
    if report["chat"]:
        lines += ["", "## Chat prompts (greedy; streaming against the same model's AR reply)", "",
                  "| model | prompts | AR tok/s | streaming tok/fwd | streaming tok/s | x own AR | x base AR "
                  "| identical replies | common prefix / AR length (tokens) |", "|---" * 9 + "|"]
        for n, e in report["chat"].items():
            if "streaming_tokens" not in e:
                lines.append(f"| {n} | {e['prompts']} | {e['ar_tokens_per_second']:.1f} | - | - | - | - | - | "
                             f"- / {e['mean_ar_length']:.1f} |")
                continue
            lines.append(f"| {n} | {e['prompts']} | {e['ar_tokens_per_second']:.1f} | "
                         f"{e['streaming_tokens_per_forward']:.2f} | {e['streaming_tokens_per_second']:.1f} | "
                         f"{e['speedup']:.2f} | " + (f"{e['speedup_vs_base_ar']:.2f}" if e.get("speedup_vs_base_ar")
                                                      else "-")
                         + f" | {e['identical']}/{e['prompts']} | {e['mean_common_prefix']:.1f} / "
                         f"{e['mean_ar_length']:.1f} |")
    return "\n".join(lines) + "\n"


def plot_comparison(report: dict[str, Any], path: str) -> bool:
    """Accuracy against tokens per forward, one panel per generation task; False if there is none."""
    if not report["generation"]:
        return False
    import matplotlib  # a plotting dependency, only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["generation"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for model, methods in report["generation"][task].items():
            for method, e in methods.items():
                x = e["tokens_per_forward"] or 1.0
                lo, hi = (e["ci95"] or (e["accuracy"], e["accuracy"]))
                ax.errorbar([x], [100 * e["accuracy"]], yerr=[[100 * max(e["accuracy"] - lo, 0.0)], [100 * max(hi - e["accuracy"], 0.0)]],
                            fmt="o" if method == STREAMING else "*", capsize=3, label=f"{model} {method}")
        ax.set_title(task)
        ax.set_xlabel("tokens / forward")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_comparison(report: dict[str, Any], out_dir: str) -> dict[str, str]:
    """report.json, report.md and (with generation tasks) accuracy_tokens_per_forward.png in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "report.json"), "markdown": os.path.join(out_dir, "report.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(comparison_markdown(report))
    plot = os.path.join(out_dir, "accuracy_tokens_per_forward.png")
    if plot_comparison(report, plot):
        paths["plot"] = plot
    return paths
