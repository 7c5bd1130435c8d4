"""The real-model quickstart's data (``quickstart/chat_data.py``): splits and held-out prompts."""

from __future__ import annotations

import json

import pytest

from megatron_wedlm.eval.builtin_tasks import SPLITS, builtin_task
from megatron_wedlm.quickstart.chat_data import (
    GENERAL_TEST_PROMPTS,
    chat_task_pairs,
    general_prompts,
    interleave,
    replies_that_end,
    write_pairs,
)


def test_general_prompts_split_into_a_fixed_held_out_set():
    train, test = general_prompts("train"), general_prompts("test")
    assert len(test) == GENERAL_TEST_PROMPTS and len(train) + len(test) == 200
    assert not set(train) & set(test) and len(set(train)) == len(train)
    assert general_prompts("test") == test  # the same on every call: a pure function


def test_chat_task_pairs_hold_no_evaluation_prompt_and_end_without_newline():
    pairs = chat_task_pairs({"counting": 400, "copying": 400, "arithmetic": 100}, seed=3)
    assert len(pairs) == 900 and pairs == chat_task_pairs({"counting": 400, "copying": 400, "arithmetic": 100}, seed=3)
    held_out = {ex.prompt for family in ("counting", "copying", "arithmetic") for split in SPLITS
                for ex in builtin_task(family, 60, seed=0, split=split).examples}
    assert not {prompt for prompt, _ in pairs} & held_out
    counting = [(p, r) for p, r in pairs if p.startswith("Count from")]
    for prompt, reply in counting:  # a reply is the task's answer, nothing around it
        start, end = (int(x) for x in prompt[len("Count from "):-1].split(" to "))
        assert reply == " ".join(str(i) for i in range(start, end + 1))


def test_interleaved_pairs_round_trip_through_jsonl(tmp_path):
    mixed = interleave([("a", "1"), ("b", "2")], [("c", "3")], seed=0)
    assert sorted(mixed) == [("a", "1"), ("b", "2"), ("c", "3")]
    assert write_pairs(mixed, tmp_path / "x.jsonl", "reference") == 3
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["reference"]) for r in rows] == mixed


def test_fields_go_beside_their_replies_and_must_have_one_value_per_pair(tmp_path):
    pairs = [("a", "x y"), ("b", "")]
    fields = {"reference_ids": [[7, 8], []], "ended": [True, False]}
    assert write_pairs(pairs, tmp_path / "x.jsonl", "reference", fields=fields) == 2
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": "a", "reference": "x y", "reference_ids": [7, 8], "ended": True},
                    {"prompt": "b", "reference": "", "reference_ids": [], "ended": False}]
    with pytest.raises(ValueError, match="2 pairs and 1 values of 'ended'"):
        write_pairs(pairs, tmp_path / "y.jsonl", "reference", fields={"ended": [True]})
    assert not (tmp_path / "y.jsonl").exists()  # refused before anything is written


def test_only_replies_that_ended_and_say_something_train():
    records = [{"prompt": "a", "response": "done.", "ended": True},
               {"prompt": "b", "response": "cut at the bud", "ended": False},
               {"prompt": "c", "response": "", "ended": True},
               {"prompt": "d", "response": "also done.", "ended": True}]
    assert replies_that_end(records) == [("a", "done."), ("d", "also done.")]
