"""``replies:PATH``: does a model still give the replies it is expected to give?

A jsonl of ``{"prompt", "reference"}`` records; a completion is correct when it equals its
reference, outer whitespace aside. Used after fine-tuning, against the base model's replies
recorded with the same greedy decoding and budget (:data:`REPLY_TOKENS`, or a record's own).
"""

from __future__ import annotations

from megatron_wedlm.eval.dataset_files import Layout, read_records, require
from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

#: Default token budget of a reply (references must be recorded with the same one).
REPLY_TOKENS = 48


class ReplyTask(Task):
    """Exact match of the whole reply against a recorded one; see the module docstring."""

    name = "replies"

    def __init__(self, path: str):
        layout = Layout("replies", ("prompt", "reference"), 'a local jsonl file, one {"prompt", "reference"} record per line')
        records = read_records(path, layout)
        for i, r in enumerate(records):
            for key in ("prompt", "reference"):
                require(r[key], str, f"record {i + 1} {key!r}", layout)
        budgets = {int(r.get("max_new_tokens", REPLY_TOKENS)) for r in records}
        self.max_new_tokens = max(budgets, default=REPLY_TOKENS)
        super().__init__([EvalExample(uid=f"replies:{i}", prompt=r["prompt"], reference=r["reference"])
                          for i, r in enumerate(records)])

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        extracted = completion.strip()
        return Judgement(extracted=extracted, correct=extracted == example.reference.strip())
