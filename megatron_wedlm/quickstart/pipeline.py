"""The from-scratch quickstart, stage by stage, through the project's real entry points:

    corpus -> tokenizer -> prepare_data -> ar_pretrain -> wedlm_pretrain -> sft -> export
    -> evaluate -> calibrate -> report

Corpus, tokenizer and report run in process; every other stage is the command a user would
run, printed and launched as a subprocess, independent ones two at a time. Tau is chosen on the
calibration prompts and the targets are judged on the disjoint test prompts at that tau. Each
stage owns its subdirectory of the output (:class:`Layout`); a rerun replaces them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_wedlm.data.tokenizer import check_reload, save_tokenizer, train_tokenizer
from megatron_wedlm.decoding.generation_defaults import write_decoding_defaults
from megatron_wedlm.decoding.options import STOP_FILLS
from megatron_wedlm.eval.builtin_tasks import ANSWER_END, builtin_task
from megatron_wedlm.eval.report import write_report
from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.eval.runner import combine_reports
from megatron_wedlm.quickstart.calibration import Calibration, calibration_from_reports, describe
from megatron_wedlm.quickstart.corpus import CorpusSpec, read_corpus, sample_texts, write_corpus, write_sft_pairs
from megatron_wedlm.quickstart.settings import (
    PRESET_DIR,
    REPO_ROOT,
    TRAINING_STAGES,
    QuickstartSettings,
    TrainingStageSettings,
)
from megatron_wedlm.quickstart.stages import Console, StageRunner
from megatron_wedlm.quickstart.summary import RunRecord, build_summary, print_summary, write_summary
from megatron_wedlm.runtime.hf_local import load_pretrained, load_tokenizer
from megatron_wedlm.runtime.precision import native_bf16_reason

#: Subdirectories and files of the output directory that a run writes (and a rerun replaces).
OWNED_PATHS = ("data", "tokenizer", "runs", "hf", "eval", "logs", "stages.json",
               "report.json", "report.md", "speed_accuracy.png")
STAGES = ("corpus", "tokenizer", "prepare_data", "ar_pretrain", "wedlm_pretrain", "sft", "export",
          "evaluate", "calibrate", "report")
#: Entry point of each training stage.
TRAINING_SCRIPTS = {"ar_pretrain": "pretrain/pretrain_wedlm.py", "wedlm_pretrain": "pretrain/pretrain_wedlm.py",
                    "sft": "sft/sft_wedlm.py"}
#: The other entry points the stages run.
PREPARE_DATA = "tools/prepare_data.py"
CONVERT_CHECKPOINT = "tools/convert_checkpoint.py"
EVALUATE = "inference/evaluate.py"
#: What the run needs from the repository checkout, relative to its root.
CHECKOUT_PATHS = (PREPARE_DATA, *dict.fromkeys(TRAINING_SCRIPTS.values()), CONVERT_CHECKPOINT, EVALUATE,
                  str(PRESET_DIR.relative_to(REPO_ROOT)))


def require_checkout(root: Path) -> None:
    """Raise ``ValueError`` unless ``root`` is a checkout holding the entry points and configs the
    stages run (``pip install -e .`` keeps them next to the package; a wheel does not)."""
    missing = [path for path in CHECKOUT_PATHS if not (root / path).exists()]
    if missing:
        raise ValueError(
            f"the quickstart needs a checkout of the repository: it runs the entry points and configs next to "
            f"the megatron_wedlm package it imported ({root / 'megatron_wedlm'}), and {root} has no "
            f"{', '.join(missing)}. An installed package does not carry them: clone the repository, run "
            "`pip install -e .` in it and run `python tools/quickstart.py` from the checkout."
        )


@dataclass(frozen=True)
class Layout:
    """Where every artefact of a run lives."""

    root: Path

    @property
    def corpus(self) -> Path:
        return self.root / "data" / "corpus.jsonl"

    @property
    def shards(self) -> Path:
        return self.root / "data" / "shards"

    @property
    def sft_pairs(self) -> Path:
        return self.root / "data" / "sft.jsonl"

    @property
    def sft_shards(self) -> Path:
        return self.root / "data" / "sft_shards"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    def run_dir(self, stage: str) -> Path:
        return self.root / "runs" / {"ar_pretrain": "ar", "wedlm_pretrain": "wedlm", "sft": "sft"}[stage]

    def training_data(self, stage: str) -> Path:
        return self.sft_shards if stage == "sft" else self.shards

    def hf_dir(self, model: str) -> Path:
        return self.root / "hf" / model

    def eval_dir(self, model: str, split: str = "test") -> Path:
        return self.root / "eval" / model if split == "test" else self.root / "eval" / split / model


BASE, WEDLM = "ar-base", "wedlm"


def _python() -> list[str]:
    return [sys.executable]


def _subprocess_env() -> dict[str, str]:
    """Children import this checkout, stay offline and do not oversubscribe the cores."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stage_precision(setting: str) -> tuple[str | None, str]:
    """The ``trainer.precision`` a stage's ``precision`` setting asks for (None: the training
    config's own) and why; ``native`` is bf16 where bf16 matmuls are native, else fp32."""
    if setting == "config":
        return None, ""
    if setting != "native":
        return setting, "as the preset says"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = native_bf16_reason(device)
    if reason:
        return "bf16", f"this {device.type.upper()} multiplies bf16 matrices natively ({reason})"
    return "fp32", f"this {device.type.upper()} has no native bf16 matrix instructions, where bf16 is slower than fp32"


def precision_overrides(stage: TrainingStageSettings) -> list[tuple[str, str]]:
    """The (``key=value`` override, why) pairs of a stage's precision settings, with
    ``fp32_train_steps`` where ``native`` fell back to fp32."""
    precision, why = stage_precision(stage.precision)
    if precision is None:
        return []
    pairs = [(f"trainer.precision={precision}", why)]
    if precision == "fp32" and stage.fp32_train_steps:
        pairs.append((f"trainer.train_steps={stage.fp32_train_steps}",
                      "fp32 steps are slower, and the preset's time budget holds this many"))
    return pairs


def read_training_result(run_dir: Path) -> dict[str, Any]:
    """The ``--result-json`` summary a training run wrote: final step, loss per step, checkpoints."""
    path = run_dir / "result.json"
    if not path.is_file():
        raise FileNotFoundError(f"the training run in {run_dir} wrote no result.json")
    result = json.loads(path.read_text())
    if not result.get("checkpoints"):
        raise FileNotFoundError(f"the training run in {run_dir} saved no checkpoint (see its result.json)")
    return result


def previous_fingerprint(report_json: str | Path, preset: str, seed: int) -> str:
    """The fingerprint of an earlier run's report.json, which must be of the same preset and seed."""
    path = Path(report_json)
    if not path.is_file():
        raise ValueError(f"--compare-with {path}: no such report.json")
    q = json.loads(path.read_text()).get("quickstart")
    if not q or "fingerprint" not in q:
        raise ValueError(f"--compare-with {path}: not a quickstart report (no 'quickstart.fingerprint')")
    if (q.get("preset"), q.get("seed")) != (preset, seed):
        raise ValueError(f"--compare-with {path}: that run used preset {q.get('preset')!r} and seed {q.get('seed')}, "
                         f"this one preset {preset!r} and seed {seed}; only a same-seed rerun must match")
    return q["fingerprint"]


def clear_outputs(root: Path) -> None:
    """Remove what an earlier run left in ``root`` (only the paths a run writes)."""
    for name in OWNED_PATHS:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class StagedRun:
    """What both quickstart pipelines share: output directory, console, stage runner, and running
    the project's entry points from the checkout's root."""

    def __init__(self, out_dir: str | Path, settings: Any, seed: int = 0,
                 console: Console | None = None, compare_with: str | Path | None = None):
        self.root = Path(out_dir).resolve()
        self.settings = settings
        self.seed = seed
        # read now: the earlier report may live in out_dir, which the run clears
        self.previous_fingerprint = None if compare_with is None else previous_fingerprint(
            compare_with, settings.name, seed)
        self.console = console or Console()
        self.env = _subprocess_env()
        self.runner: StageRunner | None = None
        self.calibration: Calibration | None = None

    def start(self, kind: str = "") -> StageRunner:
        """Clear what an earlier run left in the output directory; the runner of this run's stages."""
        self.root.mkdir(parents=True, exist_ok=True)
        clear_outputs(self.root)
        self.runner = StageRunner(self.root, self.console, env=self.env)
        self.console.print(f"quickstart preset {self.settings.name!r}{kind}, seed {self.seed}, output {self.root}")
        return self.runner

    def run_training(self, stage: str, run_dir: Path, data: Path, init_from: Path | None = None) -> dict[str, Any]:
        """``torchrun`` the stage's entry point with its training config, on ``data``, into ``run_dir``."""
        cfg = self.settings.training_config_path(stage)
        overrides = [f"data.path={data}", f"trainer.output_dir={run_dir}",
                     f"trainer.seed={self.seed}", f"data.seed={self.seed}"]
        if init_from is not None:
            overrides.append(f"model.init_from={init_from}")
        for override, why in precision_overrides(getattr(self.settings, stage)):
            overrides.append(override)
            self.console.print(f"[{stage}] {override}: {why}")
        nproc = getattr(self.settings, stage).nproc
        self._run([*_python(), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   TRAINING_SCRIPTS[stage], "--config", cfg.relative_to(REPO_ROOT) if cfg.is_relative_to(REPO_ROOT)
                   else cfg, "--result-json", run_dir / "result.json", *overrides],
                  env={"OMP_NUM_THREADS": "1"})
        result = read_training_result(run_dir)
        losses = [float(v) for _, v in sorted(result.get("losses", {}).items(), key=lambda kv: int(kv[0]))]
        checkpoint = result["checkpoints"][-1]
        detail: dict[str, Any] = {"run_dir": str(run_dir), "checkpoint": checkpoint,
                                  "steps": result.get("final_step"), "skipped_steps": result.get("skipped_steps", [])}
        if losses:
            detail.update(first_loss=losses[0], last_loss=losses[-1])
            self.console.print(f"[{stage}] loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
                               f"checkpoint {checkpoint}")
        return detail

    def eval_dtype(self) -> tuple[str, str]:
        """The task evaluation's ``--dtype`` (``eval.precision`` by :func:`stage_precision`'s rule) and why."""
        precision, why = stage_precision(self.settings.eval.precision)
        assert precision is not None  # "config" is not an eval.precision (settings.py checks)
        return precision, why

    def evaluate_command(self, model_dir: Path, tasks: list[str], methods: list[str], out: Path,
                         num_examples: int | None, speed_examples: str, *extra: str,
                         dtype: str | None = None) -> list[Any]:
        """``inference/evaluate.py`` at the preset's decoding settings, one decoding thread (one prompt
        at a time is latency-bound), in ``dtype`` (default: :meth:`eval_dtype`'s)."""
        e = self.settings.eval
        dtype = dtype or self.eval_dtype()[0]
        return [*_python(), EVALUATE, "--model", model_dir, *extra,
                "--tasks", ",".join(tasks), "--methods", ",".join(methods),
                "--taus", ",".join(f"{t:g}" for t in e.taus),
                *([] if num_examples is None else ["--num-examples", str(num_examples)]),
                "--seed", str(self.seed), "--window-size", str(e.window_size),
                "--distance-penalty", f"{e.distance_penalty:g}", "--stop-fill", e.stop_fill,
                "--stop-penalty" if e.stop_penalty else "--no-stop-penalty",
                "--device", "cpu", "--dtype", dtype,
                "--speed-examples", speed_examples, "--out", out]

    def join_report_parts(self, out: Path, parts: list[str]) -> dict[str, Any]:
        """Fold the reports written under ``out/<part>/`` into the one in ``out``."""
        reports = [EvalReport.load(str(d / "report.json")) for d in [out, *(out / p for p in parts)]]
        paths = write_report(combine_reports(reports), str(out))
        for part in parts:
            shutil.rmtree(out / part)
        return {"report": paths["json"], "joined": parts}

    def calibrate_into(self, base_report: Path, wedlm_report: Path, hf_dir: Path) -> dict[str, Any]:
        """Choose tau on the calibration reports and store it with the decoding settings in the
        WeDLM export's generation_config.json."""
        e = self.settings.eval
        self.calibration = c = calibration_from_reports(
            EvalReport.load(str(base_report)), EvalReport.load(str(wedlm_report)), e.calibration_tasks,
            tolerance=e.calibration_tolerance, learned_accuracy=e.base_learned_accuracy, per_task=e.tau_per_task,
            min_gain=e.calibration_min_gain)
        for line in describe(c, self.settings.accuracy_reference):
            self.console.print(f"[calibrate] {line}")
        defaults = {"window_size": e.window_size, "entropy_threshold": c.operating_tau,
                    "distance_penalty": e.distance_penalty, "contiguous_stop": STOP_FILLS[e.stop_fill],
                    "stop_penalty": e.stop_penalty}
        path = write_decoding_defaults(hf_dir, defaults)
        self.console.print(f"[calibrate] decoding defaults {defaults} -> {path}")
        return {**asdict(c), "generation_config": str(path)}

    def publish_summary(self, summary: dict[str, Any]) -> dict[str, str]:
        """report.json/.md/.png in the output directory, and the table on the console."""
        paths = write_summary(summary, self.root)
        print_summary(summary, self.console.print)
        self.console.print("wrote " + ", ".join(str(p) for p in paths.values()))
        return {k: str(v) for k, v in paths.items()}

    def _run(self, command: list[Any], log_name: str | None = None, env: dict[str, str] | None = None,
             tag: str | None = None) -> None:
        assert self.runner is not None
        self.runner.run([str(c) for c in command], log_name=log_name, env=env, cwd=REPO_ROOT, tag=tag)

    def _in_parallel(self, jobs: list[Any]) -> list[Any]:
        assert self.runner is not None
        return self.runner.in_parallel(jobs)


class Quickstart(StagedRun):
    """One run of the from-scratch quickstart; ``run()`` executes the stages in order."""

    def __init__(self, out_dir: str | Path, settings: QuickstartSettings, seed: int = 0,
                 console: Console | None = None, compare_with: str | Path | None = None):
        super().__init__(out_dir, settings, seed, console, compare_with)
        self.layout = Layout(self.root)

    # -- stages ------------------------------------------------------------------------------
    def corpus(self) -> dict[str, Any]:
        c = self.settings.corpus
        spec = CorpusSpec(task_examples=dict(c.task_examples), record_documents=c.record_documents,
                          code_chars=c.code_chars, examples_per_document=c.examples_per_document)
        stats = write_corpus(spec, self.layout.corpus, seed=self.seed)
        self.console.print(
            f"[corpus] {stats.documents} documents ({stats.task_documents} with {stats.task_examples} task examples, "
            f"{stats.record_documents} record tables, "
            f"{stats.code_documents} stdlib files), {stats.chars / 1e6:.2f} M characters -> {stats.path}"
        )
        n_pairs = write_sft_pairs(self.settings.sft.task_examples, self.layout.sft_pairs, seed=self.seed)
        self.console.print(f"[corpus] {n_pairs} SFT prompt/response pairs -> {self.layout.sft_pairs}")
        return {**asdict(stats), "sft_pairs": n_pairs, "sft_path": str(self.layout.sft_pairs)}

    def tokenizer(self) -> dict[str, Any]:
        texts = list(read_corpus(self.layout.corpus))
        tok = train_tokenizer(texts, self.settings.tokenizer.vocab_size)
        save_tokenizer(tok, self.layout.tokenizer)
        prompts = [ex.prompt + " " + ex.reference + "\n" for name in self.settings.eval.tasks
                   for ex in builtin_task(name, self.settings.eval.num_examples, seed=self.seed).examples]
        check_reload(self.layout.tokenizer, sample_texts(texts, 200, self.seed) + prompts)
        n_tokens = sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
        self.console.print(
            f"[tokenizer] byte-level BPE, {len(tok)} tokens (mask id {tok.mask_token_id}, eos id "
            f"{tok.eos_token_id}); corpus = {n_tokens / 1e6:.2f} M tokens; reload gives identical ids"
        )
        return {"vocab_size": len(tok), "mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id,
                "corpus_tokens": n_tokens, "path": str(self.layout.tokenizer)}

    def prepare_data(self) -> dict[str, Any]:
        # the reply end is passed escaped ('\\n'), as the command is printed on one line (console, report.md)
        jobs = {"pretrain": (self.layout.corpus, self.layout.shards, []),
                "sft": (self.layout.sft_pairs, self.layout.sft_shards,
                        ["--task", "sft", "--raw-sft", "--reply-end", ANSWER_END.encode("unicode_escape").decode()])}

        def prepare(name: str) -> dict[str, Any]:
            source, out, extra = jobs[name]
            self._run([*_python(), PREPARE_DATA, "--input", source, "--tokenizer", self.layout.tokenizer,
                       "--output", out, *extra, "--samples-per-shard", str(self.settings.corpus.samples_per_shard),
                       "--overwrite"], log_name=f"prepare_data_{name}", tag=f"prepare_data:{name}")
            manifest = json.loads((out / "manifest.json").read_text())
            return {"path": str(out), "shards": len(manifest.get("shards", [])),
                    "mask_token_id": manifest.get("mask_token_id")}

        return dict(zip(jobs, self._in_parallel([lambda n=n: prepare(n) for n in jobs])))

    def train(self, stage: str, init_from: Path | None = None) -> dict[str, Any]:
        return self.run_training(stage, self.layout.run_dir(stage), self.layout.training_data(stage), init_from)

    def export(self, checkpoints: dict[str, Path]) -> dict[str, Any]:
        def convert(model: str) -> None:
            self._run([*_python(), CONVERT_CHECKPOINT, "megatron-to-hf", "--input", checkpoints[model],
                       "--output", self.layout.hf_dir(model), "--tokenizer", self.layout.shards / "tokenizer",
                       "--overwrite"], log_name=f"export_{model}", tag=f"export:{model}")

        self._in_parallel([lambda m=m: convert(m) for m in checkpoints])
        return {model: self._check_export(self.layout.hf_dir(model)) for model in checkpoints}

    def _check_export(self, hf_dir: Path) -> dict[str, Any]:
        """Reload the export as a user would, and check it is usable for decoding."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the console shows one line per export instead

        model = load_pretrained(AutoModelForCausalLM, hf_dir).eval()
        ours = load_tokenizer(self.layout.tokenizer)
        exported = load_tokenizer(hf_dir)
        texts = sample_texts(list(read_corpus(self.layout.corpus)), 50, self.seed)
        for text in texts:
            if exported(text)["input_ids"] != ours(text)["input_ids"]:
                raise ValueError(f"the tokenizer exported to {hf_dir} encodes {text[:50]!r} differently from "
                                 f"the trained one in {self.layout.tokenizer}")
        check_reload(hf_dir, texts)
        ids = torch.tensor([ours("Count from 3 to 7:")["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits
        if not torch.isfinite(logits).all():
            raise ValueError(f"the model exported to {hf_dir} produces non-finite logits")
        info = {"path": str(hf_dir), "class": type(model).__name__,
                "parameters": sum(p.numel() for p in model.parameters()),
                "mask_token_id": getattr(model.config, "mask_token_id", None),
                "vocab_size": model.config.vocab_size}
        self.console.print(f"[export] {hf_dir.name}: AutoModelForCausalLM -> {info['class']}, "
                           f"{info['parameters'] / 1e6:.2f} M parameters, mask_token_id={info['mask_token_id']}")
        return info

    def evaluate_all(self) -> dict[str, Any]:
        """The evaluations in two lanes of about equal length; the block-wise baseline decodes in
        the other lane from the WeDLM sweep, its rows joined to the WeDLM report afterwards."""
        lanes = [[(WEDLM, ["streaming", "ar"], "test", ""), (BASE, ["ar"], "test", "")],
                 [(BASE, ["ar"], "calibration", ""), (WEDLM, ["streaming"], "calibration", ""),
                  (WEDLM, ["blockwise"], "test", "blockwise")]]
        done = self._in_parallel([lambda lane=lane: [self.evaluate(*job) for job in lane] for lane in lanes])
        reports = {f"{model}:{split}": report for lane, results in zip(lanes, done)
                   for (model, _, split, part), report in zip(lane, results) if not part}
        parts = [part for lane in lanes for (_, _, _, part) in lane if part]
        reports[f"{WEDLM}:test"] = self.join_report_parts(self.layout.eval_dir(WEDLM), parts)
        return reports

    def evaluate(self, model: str, methods: list[str], split: str = "test", part: str = "") -> dict[str, Any]:
        """One decoding thread; a ``part`` writes under ``eval/<model>/<part>/``, joined by
        :meth:`join_report_parts`."""
        e = self.settings.eval
        suffix = ("" if split == "test" else f"_{split}") + (f"_{part}" if part else "")
        out = self.layout.eval_dir(model, split) / part  # an empty part is the directory itself
        if split == "test":
            tasks, num_examples = list(e.tasks), e.num_examples
        else:
            tasks, num_examples = [f"{t}:{split}" for t in e.calibration_tasks], e.calibration_examples
        # every prompt timed one at a time, as the speed targets assume
        self._run(self.evaluate_command(self.layout.hf_dir(model), tasks, methods, out, num_examples, "all"),
                  log_name=f"eval_{model}{suffix}", tag=f"evaluate:{model}{suffix}", env={"OMP_NUM_THREADS": "1"})
        return {"report": str(out / "report.json")}

    def calibrate(self) -> dict[str, Any]:
        """Choose tau on the calibration prompts and store it, with window and penalty, in the WeDLM export."""
        return self.calibrate_into(self.layout.eval_dir(BASE, "calibration") / "report.json",
                                   self.layout.eval_dir(WEDLM, "calibration") / "report.json", self.layout.hf_dir(WEDLM))

    def report(self, timings: dict[str, Any]) -> dict[str, Any]:
        assert self.runner is not None
        assert self.calibration is not None
        summary = build_summary(
            base_report=self.layout.eval_dir(BASE) / "report.json",
            wedlm_report=self.layout.eval_dir(WEDLM) / "report.json",
            settings=self.settings, seed=self.seed, calibration=self.calibration,
            run=RunRecord(stages=self.runner.records, timings=timings,
                          training={s: read_training_result(self.layout.run_dir(s)) for s in TRAINING_STAGES},
                          previous_fingerprint=self.previous_fingerprint),
        )
        return self.publish_summary(summary)

    # -- driver ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        runner = self.start()
        s = self.settings
        with runner.heartbeat():
            runner.stage("corpus", "build the training text (built-in tasks, records, stdlib source)", self.corpus)
            runner.stage("tokenizer", f"train a {s.tokenizer.vocab_size}-token byte-level BPE, save as HF",
                         self.tokenizer)
            runner.stage("prepare_data", "tokenize into webdataset shards (tools/prepare_data.py)", self.prepare_data)
            ar = runner.stage("ar_pretrain", f"AR pretraining from scratch, torchrun x{s.ar_pretrain.nproc}",
                              lambda: self.train("ar_pretrain"))
            base_ckpt = Path(ar.detail["checkpoint"])
            we = runner.stage("wedlm_pretrain", f"WeDLM continued pretraining, torchrun x{s.wedlm_pretrain.nproc}",
                              lambda: self.train("wedlm_pretrain", init_from=base_ckpt))
            sft = runner.stage("sft", f"WeDLM SFT on the task pairs (sft/sft_wedlm.py), torchrun x{s.sft.nproc}",
                               lambda: self.train("sft", init_from=Path(we.detail["checkpoint"])))
            wedlm_ckpt = Path(sft.detail["checkpoint"])
            runner.stage("export", "megatron-to-hf for the base and the WeDLM model, reload with AutoModelForCausalLM",
                         lambda: self.export({BASE: base_ckpt, WEDLM: wedlm_ckpt}))
            runner.stage("evaluate", "inference/evaluate.py, two at a time: calibration and test prompts; base model "
                         "AR, WeDLM model streaming (tau sweep), block-wise and AR", self.evaluate_all)
            runner.stage("calibrate", "choose tau on the calibration prompts, write it into the WeDLM export's "
                         "generation_config.json", self.calibrate)
            timings = {"total_seconds": self.console.elapsed,
                       "longest_silence_seconds": self.console.longest_gap}
            result = runner.stage("report", "accuracy/speed table, targets, report.json/.md/.png",
                                  lambda: self.report(timings))
        return result.detail
