"""Writing an :class:`EvalReport` as JSON, a Markdown table and a speed-accuracy plot (PNG).

The table uses the fixed formats of ``COLUMNS``, so each cell can be matched to the JSON; the plot
is the paper's trade-off view: tokens/s against accuracy, a line per parallel method over tau.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from megatron_wedlm.eval.results import EvalReport, MethodResult

JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "report.json", "report.md", "speed_accuracy.png"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_interval(interval: tuple[float, float] | None) -> str:
    """A proportion's interval in percent, e.g. ``49.0-94.3``."""
    return "-" if interval is None else f"{100 * interval[0]:.1f}-{100 * interval[1]:.1f}"


#: (header, cell formatter) in table order.
COLUMNS: list[tuple[str, Callable[[MethodResult], str]]] = [
    ("method", lambda r: r.method),
    ("tau", lambda r: _fmt(r.tau, "g")),
    ("n", lambda r: str(r.num_examples)),
    ("timed", lambda r: str(r.num_examples if r.timed_examples is None else r.timed_examples)),
    ("accuracy (%)", lambda r: _fmt(100 * r.accuracy, ".1f")),
    ("95% CI (%)", lambda r: format_interval(r.accuracy_ci95)),
    ("tokens/forward", lambda r: _fmt(r.tokens_per_forward, ".2f")),
    ("p_cache", lambda r: _fmt(r.p_cache, ".3f")),
    ("tokens/s", lambda r: _fmt(r.tokens_per_second, ".1f")),
    ("speedup vs AR", lambda r: _fmt(r.speedup_vs_ar, ".2f")),
    ("forwards", lambda r: str(r.forwards)),
    ("tokens", lambda r: str(r.generated_tokens)),
]


def markdown_table(report: EvalReport) -> str:
    s = report.settings
    lines = [
        f"# Evaluation: {report.model}",
        "",
        f"window {s.get('window_size')}, distance penalty {s.get('distance_penalty')}, "
        f"stop fill {s.get('stop_fill', 'anywhere')}, stop penalty {'on' if s.get('stop_penalty') else 'off'}, "
        f"fallback {s.get('fallback', 'argmin')}, "
        f"temperature {s.get('temperature')}, device {s.get('device')}, torch {s.get('torch')}. "
        "Speed (tokens/s, speedup): speed mode, one prompt at a time, wall clock of each decode call "
        "(prefill included, same for every method), on the first examples of each task (`timed`); "
        "speedup = tokens/s over AR tokens/s. Accuracy, tokens/forward and p_cache: every example (`n`), "
        f"the untimed ones decoded in batches of {s.get('batch_size', 1)} (accuracy mode; a row's greedy "
        "output does not depend on its batch).",
    ]
    for task in report.tasks:
        lines += ["", f"## {task}", ""]
        lines.append("| " + " | ".join(h for h, _ in COLUMNS) + " |")
        lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
        for r in report.results:
            if r.task == task:
                lines.append("| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def brief_model_name(name: str) -> str:
    """``name`` with every local path in it cut to its last component, for titles and captions; a hub
    id such as ``tencent/WeDLM-8B`` stays whole."""
    return re.sub(r"(?<!\S)(?:~|\.{1,2})?/(?:[^\s/]+/)*([^\s/]+)/?", r"\1", name)


def plot_speed_accuracy(report: EvalReport, path: str, title: str | None = None) -> None:
    """One panel per task; ``title`` defaults to the model's brief name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = report.tasks
    cols = min(3, len(tasks))
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    markers = {"streaming": "o-", "blockwise": "s--", "ar": "*"}
    for ax, task in zip(axes.flat, tasks):
        for method in report.methods:
            points = sorted(
                ((r.tokens_per_second or 0.0, 100 * r.accuracy, r.tau) for r in report.results
                 if r.task == task and r.method == method),
                key=lambda p: p[2] if p[2] is not None else 0.0,
            )
            if not points:
                continue
            xs, ys, taus = zip(*points)
            ax.plot(xs, ys, markers.get(method, "x-"), label=method, markersize=12 if method == "ar" else 6)
            for x, y, tau in points:
                if tau is not None:
                    ax.annotate(f"{tau:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(task)
        ax.set_xlabel("tokens / s")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle(title or f"{brief_model_name(report.model)}: speed vs accuracy (labels: entropy threshold tau)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: EvalReport, out_dir: str) -> dict[str, str]:
    """Write report.json, report.md and speed_accuracy.png into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, JSON_NAME),
        "markdown": os.path.join(out_dir, MARKDOWN_NAME),
        "plot": os.path.join(out_dir, PLOT_NAME),
    }
    with open(paths["json"], "w", encoding="utf-8") as f:
        f.write(report.to_json())
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(markdown_table(report))
    plot_speed_accuracy(report, paths["plot"])
    return paths
