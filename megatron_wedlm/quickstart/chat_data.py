"""The real-model quickstart's SFT and evaluation data, built on the machine: nothing is downloaded.

Two kinds of conversations, because the real-model preset must show two things:

* **Task pairs**: the built-in tasks (counting, copying, arithmetic) as one user turn and the
  assistant's reply, e.g. ``"Count from 17 to 21:"`` -> ``"17 18 19 20 21"``.
  ``tools/prepare_data.py --task sft`` renders them with the model's own chat template (system
  prompt included), so training sees exactly what ``inference/evaluate.py --chat`` feeds the
  model. The replies carry no leading space and no newline: in chat form the reply ends at the
  template's end-of-turn token, which is what stops decoding. Held-out prompts never appear
  (``megatron_wedlm.eval.builtin_tasks``).
* **General prompts**: short everyday requests, built from templates and fillers. Their replies
  in the SFT data are the *base model's own* greedy replies, so SFT on the task pairs does not
  pull the model away from how it answered everything else (self-distillation; masked-slot
  training on them also teaches parallel decoding of ordinary chat text). A fixed set of them,
  chosen by a hash of the prompt, is held out: the evaluation checks that the WeDLM model, decoded
  autoregressively, still gives the base model's reply there.

Every list is a pure function of its arguments (seeded draws, hash-based splits), so a rerun
builds the same data.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_wedlm.eval.builtin_tasks import training_pairs
from megatron_wedlm.quickstart.corpus import check_task_examples

_CAPITALS = ("France", "Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Brazil", "India", "Kenya",
             "Norway", "Peru", "Greece", "Mexico", "Australia", "China", "Chile", "Poland", "Turkey", "Sweden")
_ANIMALS = ("cat", "dog", "horse", "spider", "bird", "cow", "ant", "snake", "fish", "octopus", "frog", "bee",
            "rabbit", "lion", "whale", "duck", "goat", "crab", "owl", "bat")
_WORDS = ("happy", "big", "fast", "cold", "bright", "old", "strong", "quiet", "early", "rich", "soft", "easy",
          "heavy", "wet", "loud", "sharp", "clean", "young", "empty", "dark")
_TOPICS = ("the ocean", "autumn", "a city at night", "friendship", "the moon", "rain", "coffee", "mountains",
           "a library", "winter", "the desert", "music", "a garden", "trains", "the stars", "snow", "bread",
           "a river", "birds", "summer")
_CONCEPTS = ("gravity", "photosynthesis", "inflation", "a black hole", "democracy", "electricity", "evolution",
             "an atom", "the internet", "a vaccine", "recycling", "a volcano", "DNA", "the water cycle",
             "an eclipse", "a rainbow", "machine learning", "friction", "a tsunami", "compound interest")
_TEMPLATES = (
    ("capital", "What is the capital of {}?", _CAPITALS),
    ("legs", "How many legs does a {} have?", _ANIMALS),
    ("animal", "Tell me one fact about the {}.", _ANIMALS),
    ("opposite", "What is the opposite of \"{}\"?", _WORDS),
    ("synonym", "Give me a synonym for \"{}\".", _WORDS),
    ("sentence", "Use the word \"{}\" in a sentence.", _WORDS),
    ("haiku", "Write a haiku about {}.", _TOPICS),
    ("title", "Suggest a title for a short story about {}.", _TOPICS),
    ("explain", "Explain {} in one sentence.", _CONCEPTS),
    ("kid", "How would you explain {} to a child?", _CONCEPTS),
)
#: General prompts held out for the evaluation (those with the lowest hash of their text).
GENERAL_TEST_PROMPTS = 50


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def general_prompts(split: str) -> list[str]:
    """The general prompts of ``split`` (``"train"`` or ``"test"``), in a fixed order.

    200 prompts in all (10 templates x 20 fillers), :data:`GENERAL_TEST_PROMPTS` of them ``test``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"general prompts come in a 'train' and a 'test' split, not {split!r}")
    prompts = [template.format(filler) for _, template, fillers in _TEMPLATES for filler in fillers]
    held_out = set(sorted(prompts, key=_digest)[:GENERAL_TEST_PROMPTS])
    return [p for p in prompts if (p in held_out) == (split == "test")]


def chat_task_pairs(task_examples: Mapping[str, int], seed: int) -> list[tuple[str, str]]:
    """``(user prompt, assistant reply)`` pairs of the built-in tasks' training split, shuffled."""
    check_task_examples(task_examples, "sft")
    pairs = [(prompt, completion.strip()) for family, n in task_examples.items() if n > 0
             for prompt, completion in training_pairs(n, seed=f"chat-sft:{seed}", families=(family,))]
    random.Random(f"chat-sft-order:{seed}").shuffle(pairs)
    return pairs


def interleave(first: list[tuple[str, str]], second: list[tuple[str, str]], seed: int) -> list[tuple[str, str]]:
    """Both lists in one seeded order, so every part of an SFT run sees both kinds."""
    merged = list(itertools.chain(first, second))
    random.Random(f"chat-sft-mix:{seed}").shuffle(merged)
    return merged


def replies_that_end(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """``(prompt, response)`` of the recorded replies that ended and are not empty: the general
    replies that train. One cut at its token budget would be learnt with the end-of-turn token
    after it and teach the model to end replies mid-sentence."""
    return [(r["prompt"], r["response"]) for r in records if r["ended"] and r["response"]]


def write_pairs(pairs: Iterable[tuple[str, str]], path: str | Path, reference_key: str = "response",
                fields: Mapping[str, Sequence[Any]] | None = None) -> int:
    """Write ``{"prompt", reference_key}`` jsonl lines; returns how many.

    ``response`` is what ``tools/prepare_data.py --task sft`` reads, ``reference`` what the
    evaluation's ``replies`` task reads. ``fields`` adds keys with one value per pair, e.g. the
    tokens a model generated for the reply (which its text need not tokenize back to).
    """
    pairs = list(pairs)
    for key, values in (fields or {}).items():
        if len(values) != len(pairs):
            raise ValueError(f"write_pairs got {len(pairs)} pairs and {len(values)} values of {key!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, (prompt, reply) in enumerate(pairs):
            record: dict[str, Any] = {"prompt": prompt, reference_key: reply}
            record.update({key: values[i] for key, values in (fields or {}).items()})
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(pairs)
