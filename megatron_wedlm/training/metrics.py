"""Where a run's numbers go: ``metrics.jsonl``, Weights & Biases, and a console progress bar.

Only the logging rank writes. ``metrics.jsonl`` holds one history, the running run's lineage
(:mod:`.checkpoint_index`): records off it are moved to ``metrics.abandoned.jsonl`` at the start,
tagged ``abandoned_by``, never cut silently.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from megatron_wedlm.config.schema import TrainConfig
from megatron_wedlm.runtime.atomic_output import atomic_write_text

from .wandb_auth import wandb_mode

__all__ = ["MetricsLogger", "METRICS_ABANDONED_FILE", "METRICS_FILE", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
METRICS_ABANDONED_FILE = "metrics.abandoned.jsonl"
REQUIRED_KEYS = ("step", "loss", "mlm_loss", "ar_loss", "masked_tokens", "lr", "grad_norm", "tokens_per_sec",
                 "tokens_per_sec_per_device", "tflops_per_device", "mfu", "peak_memory_gib")
VALID_LOSS_KEY = "valid/loss"  # present in the record of a step followed by a validation
VALID_SUMMARY_KEYS = ("valid/loss", "valid/mlm_loss", "valid/ar_loss")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (a file or the run directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _json_number(value: Any) -> Any:
    """NaN/inf are not JSON: write them as strings so the file stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _throughput_postfix(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's throughput fields: TFLOP/s per device, MFU when known, peak memory."""
    fields = {}
    if "tflops_per_device" in record:
        fields["tflops"] = f"{record['tflops_per_device']:.3g}"
    if record.get("mfu") is not None:
        fields["mfu"] = f"{100 * record['mfu']:.1f}%"
    if "peak_memory_gib" in record:
        fields["mem"] = f"{record['peak_memory_gib']:.1f}G"
    return fields


class MetricsLogger:
    def __init__(
        self,
        cfg: TrainConfig,
        config_dict: dict[str, Any],
        start_step: int,
        enabled: bool,
        wandb_run_id: str | None = None,
        run_id: str | None = None,
        lineage: list[dict[str, Any]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.output_dir = Path(cfg.trainer.output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.wandb_run = None
        self.wandb_run_id = wandb_run_id
        self._bar = None
        self._summary: dict[str, Any] = {}  # the run summary's numbers: last train loss, last validation
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._set_aside_other_history(run_id, lineage or [{"run_id": run_id, "from_step": start_step}])
        if cfg.logging.wandb.enabled:
            self._start_wandb(config_dict)
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            total = cfg.trainer.exit_at_step or cfg.trainer.train_steps
            self._bar = tqdm(
                total=total, initial=start_step, desc=cfg.trainer.task, unit="step",
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
            )

    def _set_aside_other_history(self, run_id: str | None, lineage: list[dict[str, Any]]) -> None:
        """Move the records off ``lineage`` to ``metrics.abandoned.jsonl`` (appended and synced first)."""
        from .checkpoint_index import on_lineage  # imports torch

        if not self.path.exists():
            return
        kept, moved = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            history = on_lineage(record.get("run_id"), int(record["step"]), lineage)
            (kept if history else moved).append(line if history else {**record, "abandoned_by": run_id})
        if not moved:
            return
        with open(self.output_dir / METRICS_ABANDONED_FILE, "a") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in moved))
            handle.flush()
            os.fsync(handle.fileno())
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        steps = [record["step"] for record in moved]
        self.message(
            f"{len(moved)} records of {self.path} (steps {min(steps)}..{max(steps)}) are not part of this run's "
            f"history; moved to {METRICS_ABANDONED_FILE}"
        )

    def _start_wandb(self, config_dict: dict[str, Any]) -> None:
        import wandb

        w = self.cfg.logging.wandb
        directory = Path(w.dir or self.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or self.output_dir.name,
            group=w.group,
            tags=list(w.tags),
            mode=wandb_mode(w.mode),
            dir=str(directory),
            config=config_dict,
            id=self.wandb_run_id,
            resume="allow" if self.wandb_run_id else None,
        )
        self.wandb_run_id = self.wandb_run.id

    @property
    def wandb_run_dir(self) -> str | None:
        return None if self.wandb_run is None else str(Path(self.wandb_run.dir).parent)

    def log_step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}", lr=f"{record['lr']:.2e}",
                **_throughput_postfix(record), refresh=False,
            )
        step = int(record["step"])
        self._summary["loss"] = record["loss"]  # the last train loss, whether or not this record is written
        validated = VALID_LOSS_KEY in record
        if validated:
            self._summary.update({k: record[k] for k in VALID_SUMMARY_KEYS if k in record})
        if step % self.cfg.logging.log_interval and not record.get("skipped") and not record.get("final") \
                and not validated:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({k: _json_number(v) for k, v in record.items()}) + "\n")
        if self.wandb_run is not None:
            # committed now, so the row's automatic summary precedes the explicit one written at close
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self._to_wandb(f"step {step}", lambda run: run.log(numbers, step=step, commit=True))

    def _to_wandb(self, what: str, call: Callable[[Any], Any]) -> None:
        """``call(run)``; if wandb fails, say so once and log on without it (SLURM signals wandb's
        service with the job: a run finishing its step to save must not fail on it)."""
        try:
            call(self.wandb_run)
        except Exception as err:  # noqa: BLE001 - any failure of the logging side channel
            self.wandb_run = None
            self.message(f"wandb failed at {what} ({type(err).__name__}: {err}); its run misses the records from "
                         f"there on, which {self.path} holds")

    def message(self, text: str) -> None:
        """A line for the console that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.wandb_run is not None:
            summary = {k: _json_number(v) for k, v in self._summary.items()}
            self._to_wandb("the run's end", lambda run: (run.summary.update(summary), run.finish()))
            self.wandb_run = None
