"""Post-training evaluation: accuracy and speed of streaming, block-wise and AR decoding.

* ``tasks``            the Task interface (prompts, references, stop strings, scorer)
* ``builtin_tasks``    counting / copying / arithmetic, generated from a seed, plus training text
* ``jsonl_tasks``      GSM8K, MATH, ARC, MMLU from local jsonl in few-shot formats
* ``code_tasks``       HumanEval, MBPP, scored by running code in ``sandbox``
* ``answer_extraction`` how final answers are pulled out of generated text
* ``registry``         ``load_tasks("counting,gsm8k:path.jsonl")``
* ``runner``           ``evaluate(model, tokenizer, tasks, methods, taus=...) -> EvalReport``: speed mode
                       (one prompt at a time, timed) and accuracy mode (continuous batches)
* ``sharding``         an evaluation over torchrun's processes; per-rank records for a restart
* ``report``           ``write_report(report, out_dir)``: JSON, Markdown, speed-accuracy PNG
* ``lm_eval_adapter``  the ``wedlm`` model for lm-evaluation-harness (imports lm_eval lazily)
* ``slot_probe``       per distance, how many confidently filled mask slots are wrong (no decoding)
"""

from megatron_wedlm.eval.builtin_tasks import builtin_task, training_corpus, training_pairs
from megatron_wedlm.eval.registry import load_task, load_tasks
from megatron_wedlm.eval.report import write_report
from megatron_wedlm.eval.results import EvalReport, MethodResult
from megatron_wedlm.eval.runner import METHODS, evaluate
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

__all__ = [
    "METHODS",
    "EvalExample",
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
