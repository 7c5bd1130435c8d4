"""Built-in low-entropy tasks (counting, copying, arithmetic) generated from a seed, no files.

Low-entropy output is where parallel decoding shines, and these need no download, so they serve
the quick evaluation and the quickstart (which trains on ``training_corpus``). Formats:
``"Count from 17 to 21:"`` -> ``" 17 18 19 20 21"``, ``"Repeat q w e r:"`` -> ``" q w e r"``,
``"12 + 35 ="`` -> ``" 47"`` (also ``x`` and ``First 4 multiples of 7:``); a completion ends at a
newline and must equal the reference, whitespace collapsed.

Held out by content: an instance whose key's SHA-256 falls in a fixed 10% bucket
(``is_held_out``) is only ever a prompt, the others only training text, so the two never overlap
for any seeds. The held-out ones split again (``held_out_split``): 4 buckets *calibration* (where
tau is chosen), 6 *test* (where it is measured), so tau is never chosen on the prompts it is
reported on.
"""

from __future__ import annotations

import functools
import hashlib
import random
import string
from collections.abc import Callable, Iterator, Sequence

from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

FAMILIES: tuple[str, ...] = ("counting", "copying", "arithmetic")
ANSWER_END = "\n"  # ends every completion and stops its decoding
HELD_OUT_PERCENT = 10
#: Held-out buckets below this one form the calibration split, the rest the test split.
CALIBRATION_PERCENT = 4
SPLITS: tuple[str, ...] = ("test", "calibration")
#: Counting ranges span this many steps. At most 12 (not more) because the end of a range is the one
#: thing a small model must look up in the prompt; with longer ranges a model trained for minutes
#: only learns a length prior and overshoots (docs/results.md).
COUNT_STEPS = range(4, 13)
# The other ranges the generators draw from; split_size enumerates the same ones.
COUNT_STARTS = range(200)
ADD_OPERANDS = range(100)
MUL_FACTORS = range(1, 13)
MULTIPLES_OF = range(2, 100)
MULTIPLES_TERMS = range(4, 13)

_Instance = tuple[str, str, str]  # (key, prompt, answer without the leading space)


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 100


def is_held_out(key: str) -> bool:
    """Whether a task instance belongs to the evaluation split (stable across processes)."""
    return _bucket(key) < HELD_OUT_PERCENT


def held_out_split(key: str) -> str | None:
    """``"calibration"`` or ``"test"`` for a held-out instance, ``None`` for a training one."""
    bucket = _bucket(key)
    if bucket >= HELD_OUT_PERCENT:
        return None
    return "calibration" if bucket < CALIBRATION_PERCENT else "test"


def _uniform(rng: random.Random, values: range) -> int:
    return rng.randrange(values.start, values.stop)


def _counting(rng: random.Random) -> _Instance:
    start = _uniform(rng, COUNT_STARTS)
    end = start + _uniform(rng, COUNT_STEPS)
    answer = " ".join(str(i) for i in range(start, end + 1))
    return f"counting:{start}:{end}", f"Count from {start} to {end}:", answer


def _copying(rng: random.Random) -> _Instance:
    letters = " ".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
    return f"copying:{letters}", f"Repeat {letters}:", letters


def _arithmetic(rng: random.Random) -> _Instance:
    kind = rng.choice(("add", "mul", "multiples"))
    if kind == "add":
        a, b = _uniform(rng, ADD_OPERANDS), _uniform(rng, ADD_OPERANDS)
        return f"arithmetic:add:{a}:{b}", f"{a} + {b} =", str(a + b)
    if kind == "mul":
        a, b = _uniform(rng, MUL_FACTORS), _uniform(rng, MUL_FACTORS)
        return f"arithmetic:mul:{a}:{b}", f"{a} x {b} =", str(a * b)
    n, terms = _uniform(rng, MULTIPLES_OF), _uniform(rng, MULTIPLES_TERMS)
    answer = " ".join(str(n * i) for i in range(1, terms + 1))
    return f"arithmetic:multiples:{n}:{terms}", f"First {terms} multiples of {n}:", answer


_GENERATORS: dict[str, Callable[[random.Random], _Instance]] = {
    "counting": _counting,
    "copying": _copying,
    "arithmetic": _arithmetic,
}


def _keys(family: str) -> Iterator[str]:
    """Every instance key ``family``'s generator can draw (counting and arithmetic: small finite sets)."""
    if family == "counting":
        yield from (f"counting:{a}:{a + k}" for a in COUNT_STARTS for k in COUNT_STEPS)
    elif family == "arithmetic":
        yield from (f"arithmetic:add:{a}:{b}" for a in ADD_OPERANDS for b in ADD_OPERANDS)
        yield from (f"arithmetic:mul:{a}:{b}" for a in MUL_FACTORS for b in MUL_FACTORS)
        yield from (f"arithmetic:multiples:{n}:{t}" for n in MULTIPLES_OF for t in MULTIPLES_TERMS)
    else:
        raise ValueError(f"built-in task {family!r} has no finite key set")


@functools.cache
def split_size(family: str, split: str) -> int | None:
    """How many distinct prompts ``family`` has in held-out ``split``; ``None`` where that is too many
    to matter (copying: 26^3 to 26^12 strings). A task cannot ask for more prompts than this."""
    _check_families([family])
    if family == "copying":
        return None
    return sum(held_out_split(key) == split for key in _keys(family))


def _check_families(families: Sequence[str]) -> None:
    unknown = [f for f in families if f not in _GENERATORS]
    if unknown or not families:
        raise ValueError(f"unknown built-in task families {unknown or families}; choose from {FAMILIES}")


def _draw(
    family: str, rng: random.Random, split: str | None, seen: set[str] | None = None
) -> _Instance:
    """Rejection-sample an instance of ``split`` (``None``: training; ``seen``: keys to avoid)."""
    for _ in range(100_000):
        inst = _GENERATORS[family](rng)
        if held_out_split(inst[0]) == split and (seen is None or inst[0] not in seen):
            if seen is not None:
                seen.add(inst[0])
            return inst
    raise RuntimeError(f"could not draw a new {family!r} instance of the {split or 'training'} split; "
                       "ask for fewer examples")


def normalize_answer(text: str) -> str:
    """The documented extraction: text up to the first newline, whitespace collapsed."""
    return " ".join(text.split(ANSWER_END, 1)[0].split())


class BuiltinTask(Task):
    """Exact-match task over one built-in family and held-out split; see the module docstring."""

    stop_strings = (ANSWER_END,)

    def __init__(self, family: str, num_examples: int = 50, seed: int = 0, split: str = "test"):
        _check_families([family])
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} of built-in task {family!r}; choose from {SPLITS}")
        self.name = family
        self.split = split
        # Budgets fit digit-by-digit tokenizers (Qwen): 13 numbers x (space + 3 digits) < 100.
        self.max_new_tokens = {"counting": 100, "copying": 40, "arithmetic": 80}[family]
        available = split_size(family, split)
        if available is not None and num_examples > available:
            raise ValueError(f"built-in task {family!r} has {available} prompts in its {split} split, "
                             f"{num_examples} were asked for: ask for at most {available}")
        rng = random.Random(f"eval:{family}:{seed}" + ("" if split == "test" else f":{split}"))
        seen: set[str] = set()
        examples = []
        for _ in range(num_examples):
            key, prompt, answer = _draw(family, rng, split, seen=seen)
            examples.append(EvalExample(uid=key, prompt=prompt, reference=answer))
        super().__init__(examples)

    def judge(self, example: EvalExample, completion: str) -> Judgement:
        extracted = normalize_answer(completion)
        return Judgement(extracted=extracted, correct=extracted == example.reference)


def builtin_task(name: str, num_examples: int = 50, seed: int = 0, split: str = "test") -> BuiltinTask:
    """Evaluation task ``name`` (one of ``FAMILIES``) with held-out prompts of ``split``."""
    return BuiltinTask(name, num_examples=num_examples, seed=seed, split=split)


def completion_of(answer: str) -> str:
    """The text a correct model generates for ``answer`` (a leading space, then the stop string)."""
    return f" {answer}{ANSWER_END}"


def training_pairs(
    n: int, seed: int | str = 0, families: Sequence[str] = FAMILIES
) -> list[tuple[str, str]]:
    """``n`` (prompt, completion) pairs from the training split, families in rotation.

    Completions read as a correct answer to the evaluation prompt would (leading space, closing
    newline). Instances may repeat, held-out ones never appear; a string ``seed`` names an
    independent draw (e.g. SFT pairs next to a pretraining corpus)."""
    _check_families(families)
    rng = random.Random(f"train:{seed}")
    pairs = []
    for i in range(n):
        _, prompt, answer = _draw(families[i % len(families)], rng, None)
        pairs.append((prompt, completion_of(answer)))
    return pairs


def training_corpus(n: int, seed: int = 0, families: Sequence[str] = FAMILIES) -> list[str]:
    """``n`` training documents (``prompt + completion``), disjoint from every evaluation prompt."""
    return [prompt + completion for prompt, completion in training_pairs(n, seed, families)]
