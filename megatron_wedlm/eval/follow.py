"""Follow a training run: evaluate each checkpoint once it is complete, while the run trains.

``inference/evaluate.py --follow RUN_DIR`` polls the run's checkpoints; each complete one not yet
evaluated (oldest first) is loaded as its HF export would be, evaluated, and recorded:

* a JSON line in ``RUN_DIR/evals.jsonl`` (``step``, ``run_id``, ``checkpoint``, ``time``,
  ``seconds``, ``report``, flat ``metrics`` ``eval/<task>/<config>/<metric>``, ``results``). The
  file is also the state: a restarted ``--follow`` skips what it lists.
* the same metrics in the training run's own wandb run, against ``eval/step`` (wandb's ``step``
  only grows, and training is ahead of the checkpoint evaluated); an online run is joined in
  shared mode as a secondary writer, an offline one gets an offline run of the same id.

It stops once a checkpoint at or past ``until_step`` (default ``trainer.train_steps``) and all
before it are evaluated, or once no live run has held ``RUN_DIR`` for ``wait_for_run_s`` seconds
(which bridges the gaps of a SLURM job chain). It waits for a directory that does not exist yet,
skips a checkpoint pruned before its turn, and follows the current lineage only: after a rollback
the abandoned branch is passed over.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_wedlm.config import config_from_yaml_text
from megatron_wedlm.config.schema import TrainConfig
from megatron_wedlm.decoding.options import resolve_decoding_settings, window_settings
from megatron_wedlm.decoding.settings import DecodeSettings
from megatron_wedlm.eval.report import write_report
from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.eval.runner import EvalPlan, evaluate
from megatron_wedlm.training.checkpoint_index import (
    CONFIG_FILE,
    CheckpointReadError,
    lineage_checkpoints,
    read_trainer_state,
)
from megatron_wedlm.training.hf_export import checkpoints_root, load_checkpoint
from megatron_wedlm.training.run_dir import run_in_progress
from megatron_wedlm.training.wandb_auth import ONLINE_MODES, wandb_mode

__all__ = ["EVALS_FILE", "FollowSettings", "follow_run", "read_evals", "row_metrics"]

EVALS_FILE = "evals.jsonl"
STEP_METRIC = "eval/step"


@dataclass
class FollowSettings:
    """What each checkpoint is evaluated with: ``plan`` less what the checkpoint adds, its window
    settings (resolved from ``decoding``, the command line's; None: the checkpoint's, else built-in)
    and, when ``plan.taus`` is empty, its tau."""

    plan: EvalPlan
    device: str | None = None
    dtype: str = "auto"
    decoding: dict[str, Any] = field(default_factory=dict)
    report_dir: str | Path | None = None  # each checkpoint's full report goes to <report_dir>/iter_N


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/evals.jsonl`` (none when it does not exist)."""
    path = Path(run_dir) / EVALS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row_metrics(report: EvalReport) -> dict[str, float]:
    """``eval/<task>/<config>/<metric>`` for accuracy, tokens_per_forward and p_cache."""
    metrics = {}
    for result in report.results:
        config = result.method if result.tau is None else f"{result.method}_tau{result.tau:g}"
        for name in ("accuracy", "tokens_per_forward", "p_cache"):
            value = getattr(result, name)
            if value is not None:
                metrics[f"eval/{result.task}/{config}/{name}"] = float(value)
    return metrics


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_config(run_dir: Path) -> TrainConfig | None:
    file = run_dir / CONFIG_FILE
    return config_from_yaml_text(file.read_text()) if file.is_file() else None


class _WandbLog:
    """The training run's wandb run, joined on the first row (None without wandb or its id)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.say = say
        self.run = None
        self.tried = False

    def log(self, checkpoint: Path, metrics: dict[str, float], step: int) -> None:
        if not self.tried:
            self.tried = True
            self.run = self._join(checkpoint)
        if self.run is not None:
            self.run.log({STEP_METRIC: step, **metrics})

    def _join(self, checkpoint: Path):
        cfg = _run_config(self.run_dir)
        run_id = read_trainer_state(checkpoint).get("wandb_run_id")
        if cfg is None or not cfg.logging.wandb.enabled or run_id is None:
            self.say(f"note: the run in {self.run_dir} logs to no wandb run; evaluations go to {EVALS_FILE} only")
            return None
        import wandb  # optional dependency, needed only here

        w = cfg.logging.wandb
        mode = wandb_mode(w.mode)
        shared = mode in ONLINE_MODES
        settings = wandb.Settings(x_label="follow", x_primary=False, x_update_finish_state=False) if shared else None
        run = wandb.init(  # named as the training names it (MetricsLogger), so a sync keeps the run as it is
            project=w.project, entity=w.entity, name=w.name or self.run_dir.name, group=w.group, tags=list(w.tags),
            id=run_id, resume="allow", dir=str(w.dir or self.run_dir), mode="shared" if shared else mode,
            settings=settings,
        )
        run.define_metric(STEP_METRIC)
        run.define_metric("eval/*", step_metric=STEP_METRIC)
        return run

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _until_step(run_dir: Path, until_step: int | None) -> int | None:
    if until_step is not None:
        return until_step
    cfg = _run_config(run_dir)
    return None if cfg is None else cfg.trainer.train_steps


def follow_run(
    run_dir: str | Path,
    settings: FollowSettings,
    *,
    until_step: int | None = None,
    poll_interval_s: float = 60.0,
    wait_for_run_s: float = 0.0,
    say: Callable[[str], None] = _stderr,
) -> list[dict[str, Any]]:
    """Evaluate the run's checkpoints as they appear until it is done (see the module
    docstring); return the rows this call appended to ``evals.jsonl``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        say(f"--follow: waiting for {run_dir} to appear (the training run's trainer.output_dir; is the path right?)")
        while not run_dir.is_dir():
            time.sleep(poll_interval_s)
    done = {_key(row) for row in read_evals(run_dir)}
    wandb_log = _WandbLog(run_dir, say)
    appended: list[dict[str, Any]] = []
    idle_since: float | None = None  # when no run was found training, with nothing left to evaluate
    try:
        while True:
            root = checkpoints_root(run_dir)
            until = _until_step(run_dir, until_step)
            found = _history(root)
            for key, path in found:
                if key in done or (until is not None and key[0] > until):
                    continue
                row = _evaluate_checkpoint(key, path, settings, say)
                if row is None:
                    continue
                with open(run_dir / EVALS_FILE, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
                wandb_log.log(path, row["metrics"], row["step"])
                done.add(key)
                appended.append(row)
            if until is not None and any(step >= until for (step, _), _ in found):
                say(f"--follow: the run has saved step {max(step for (step, _), _ in found)} (>= {until}); done")
                return appended
            remaining = [key for key, _ in _history(root) if key not in done]
            if found and not remaining and not run_in_progress(run_dir):
                if idle_since is None:
                    idle_since = time.monotonic()
                    if wait_for_run_s > 0:
                        say(f"--follow: no run is training in {run_dir}; waiting up to {wait_for_run_s:g} s "
                            "for a job that continues it")
                if time.monotonic() - idle_since >= wait_for_run_s:
                    say(f"--follow: no run is training in {run_dir} and every checkpoint is evaluated; done")
                    return appended
            else:
                idle_since = None
            time.sleep(poll_interval_s)
    finally:
        wandb_log.close()


def _key(row: dict[str, Any]) -> tuple[int, str | None]:
    """A checkpoint is one step saved by one run: a rollback's new run saves steps again."""
    return int(row["step"]), row.get("run_id")


def _history(root: Path) -> list[tuple[tuple[int, str | None], Path]]:
    """The run's checkpoints (:func:`_key`, path) on its current lineage, oldest first."""
    found = []
    for step, path in lineage_checkpoints(root):
        try:
            found.append(((step, read_trainer_state(path).get("run_id")), path))
        except CheckpointReadError:  # removed meanwhile (pruned)
            continue
    return found


def _evaluate_checkpoint(key: tuple[int, str | None], path: Path, settings: FollowSettings,
                         say: Callable[[str], None]) -> dict | None:
    step, run_id = key
    started = time.perf_counter()
    say(f"--follow: evaluating {path}")
    # as evaluate.py: a mask token is needed by the parallel methods, unless one is given
    plan = settings.plan
    needs_mask = plan.settings.mask_token_id is None and list(plan.methods) != ["ar"]
    try:  # everything read from the checkpoint's files; after this, it may be pruned
        values, _ = resolve_decoding_settings(settings.decoding, path)
        model, tokenizer = load_checkpoint(path, device=settings.device, dtype=settings.dtype,
                                           require_mask_token=needs_mask)
    except Exception:
        if not path.exists():  # pruned by keep_last while waiting its turn or while loading
            say(f"note: checkpoint {path.name} was removed before it could be evaluated; skipped")
            return None
        raise
    plan = dataclasses.replace(plan, taus=list(plan.taus or [values["entropy_threshold"]]), model_name=str(path),
                               settings=DecodeSettings.build(plan.settings, **window_settings(values)))
    report = evaluate(model, tokenizer, plan)
    metrics = row_metrics(report)
    report_dir = None
    if settings.report_dir is not None:
        report_dir = Path(settings.report_dir) / path.name
        write_report(report, report_dir)
    say(f"--follow: step {step}: " + ", ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in metrics.items()))
    return {
        "step": step,
        "run_id": run_id,
        "checkpoint": str(path),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.perf_counter() - started,
        "report": None if report_dir is None else str(report_dir),
        "metrics": metrics,
        "results": [result.to_dict() for result in report.results],
    }
