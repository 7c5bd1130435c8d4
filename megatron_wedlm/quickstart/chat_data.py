"""The real-model quickstart's SFT and evaluation data, built on the machine (nothing downloaded),
each list a pure function of its arguments.

Task pairs are the built-in tasks as one user turn and a reply with no leading space or newline
(the chat template's end of turn stops decoding; held-out prompts never appear). General prompts
come from templates; their SFT replies are the base model's own greedy replies, so SFT does not pull
the model away from how it answered them, and a hashed held-out set checks that it still does.
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
    """The general prompts of ``split`` (``"train"`` or ``"test"``: :data:`GENERAL_TEST_PROMPTS` of
    them, chosen by a hash of the prompt), in a fixed order."""
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
    """``(prompt, response)`` of the recorded replies that ended and are not empty: a reply cut at its
    budget would teach the model to end replies mid-sentence."""
    return [(r["prompt"], r["response"]) for r in records if r["ended"] and r["response"]]


def write_pairs(pairs: Iterable[tuple[str, str]], path: str | Path, reference_key: str = "response",
                fields: Mapping[str, Sequence[Any]] | None = None) -> int:
    """Write ``{"prompt", reference_key}`` jsonl lines (``response`` for ``prepare_data.py --task sft``,
    ``reference`` for the ``replies`` task), ``fields`` adding one value per pair; returns how many."""
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
