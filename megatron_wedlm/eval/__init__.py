"""Post-training evaluation: accuracy and speed of streaming, block-wise and AR decoding.

* ``tasks``            the Task interface (prompts, references, stop strings, scorer)
* ``builtin_tasks``    counting / copying / arithmetic, generated from a seed, plus training text
* ``jsonl_tasks``      GSM8K, MATH, ARC, MMLU from local jsonl in few-shot formats
* ``code_tasks``       HumanEval, MBPP, scored by running code in ``sandbox``
* ``answer_extraction`` how final answers are pulled out of generated text
* ``paper_suite``      the paper's protocol: ``paper:gsm8k``, ``paper:math``, ... (docs/evaluation.md)
* ``paper_extraction`` the reference evaluator's answer extraction and equivalence rules
* ``reference_prompts`` the paper's few-shot text, read from a Tencent/WeDLM checkout
* ``dataset_files``    benchmark records from local hub downloads (jsonl, JSON, parquet, csv)
* ``scoring``          scoring saved completions (``inference/score.py``) as the runner does
* ``registry``         ``load_tasks("counting,gsm8k:path.jsonl")``
* ``runner``           ``evaluate(model, tokenizer, EvalPlan(tasks, methods, taus=...))``: speed mode
                       (one prompt at a time, timed) and accuracy mode (continuous batches)
* ``sharding``         an evaluation over torchrun's processes; per-rank records for a restart
* ``report``           ``write_report(report, out_dir)``: JSON, Markdown, speed-accuracy PNG
* ``lm_eval_adapter``  the ``wedlm`` model for lm-evaluation-harness (imports lm_eval lazily)
* ``slot_probe``       per distance, how many confidently filled mask slots are wrong (no decoding)
* ``follow``           ``--follow RUN_DIR``: evaluate a training run's checkpoints as they appear
* ``multiple_choice``  ARC / HellaSwag / MMLU by log-likelihood, as lm-eval's ``hf`` model scores them
* ``lm_eval_reference`` the same items through lm-eval's own ``hf`` model (the check of the above)
* ``chat_speed``       streaming against AR of one model on chat prompts: speed and agreement
* ``comparison``       a base model and its WeDLMs side by side (``tools/compare_models.py``)
"""

from megatron_wedlm.eval.builtin_tasks import builtin_task, training_corpus, training_pairs
from megatron_wedlm.eval.registry import load_task, load_tasks
from megatron_wedlm.eval.report import write_report
from megatron_wedlm.eval.results import EvalReport, MethodResult
from megatron_wedlm.eval.runner import METHODS, EvalPlan, evaluate
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

__all__ = [
    "METHODS",
    "EvalExample",
    "EvalPlan",
    "EvalReport",
    "Judgement",
    "MethodResult",
    "Task",
    "builtin_task",
    "evaluate",
    "load_task",
    "load_tasks",
    "training_corpus",
    "training_pairs",
    "write_report",
]
