"""The quickstart's training text, built on the machine: nothing is downloaded.

Two kinds of documents, because the quickstart has to show two things:

* **Low-entropy sequences** (``training_corpus`` of the built-in tasks -- counting, copying,
  multiples -- plus small structured record tables). Their continuations are nearly
  deterministic, which is where parallel decoding commits many tokens per forward, and their
  evaluation prompts are held out from this text (``megatron_wedlm.eval.builtin_tasks``).
  A document holds 1 to ``examples_per_document`` task examples one after another. Why: WeDLM
  training cuts each document into blocks aligned to its start, and a masked slot sees clean
  memory only of *earlier* blocks. With one example per document, a short answer always sits in
  block 0 next to its own (maskable) prompt, so the model never practises the situation of
  inference -- the whole prompt known (in the KV cache), the answer masked -- and it does not
  learn to decode short answers in parallel. Several examples per document put every example
  at many block offsets.
* **Real text**: Python's own standard-library sources, present on every machine with Python.
  They keep the tokenizer and the model honest on high-entropy text, where the report must
  show that parallel decoding gains little.

Next to the pretraining corpus, :func:`write_sft_pairs` writes the prompt/response pairs of the
quickstart's WeDLM SFT stage.

Everything is a pure function of the seed and of the Python installation (the stdlib files
are taken in sorted order), so a re-run builds byte-identical files.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_wedlm.eval.builtin_tasks import FAMILIES, training_corpus, training_pairs

_RECORD_ITEMS = ("apple", "pear", "plum", "fig", "lime", "kiwi", "date", "melon")


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library (``Lib/`` of CPython)."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(f"the Python standard library was not found at {path}")
    return path


def stdlib_documents(max_chars: int, chars_per_file: int = 6000) -> list[str]:
    """Head of each ``Lib/*.py`` file in sorted order (cut at a line end) until ``max_chars``.

    Taking a head of many files rather than whole files gives more varied code for the same
    budget; sorting makes the choice the same on every run.
    """
    if max_chars <= 0:
        return []
    docs: list[str] = []
    total = 0
    for path in sorted(stdlib_dir().glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > chars_per_file:
            cut = text.rfind("\n", 0, chars_per_file)
            text = text[: cut + 1 if cut > 0 else chars_per_file]
        text = text.strip("\n")
        if not text:
            continue
        text = text[: max_chars - total]
        docs.append(text + "\n")
        total += len(text) + 1
        if total >= max_chars:
            break
    if not docs:
        raise FileNotFoundError(f"no *.py files in {stdlib_dir()}")
    return docs


def record_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` small CSV tables with numbered rows: repeated structure, few free choices."""
    rng = random.Random(f"records:{seed}")
    docs = []
    for _ in range(n):
        start, rows, qty = rng.randrange(1, 100), rng.randint(3, 8), rng.randint(1, 9)
        items = rng.sample(_RECORD_ITEMS, 3)
        lines = ["id,item,qty"]
        lines += [f"{start + i},{items[i % 3]},{qty}" for i in range(rows)]
        docs.append("\n".join(lines) + "\n")
    return docs


def check_task_examples(task_examples: Mapping[str, int], what: str) -> None:
    """Reject examples-per-family maps with unknown families, negative counts or nothing in them.

    Shared by the corpus and the SFT pairs, whose ``task_examples`` a preset sets; ``what`` names
    which one in the message.
    """
    unknown = [f for f in task_examples if f not in FAMILIES]
    if unknown:
        raise ValueError(f"{what} task_examples has unknown families {unknown}; choose from {FAMILIES}")
    for family, n in task_examples.items():
        if n < 0:
            raise ValueError(f"{what} {family} must be >= 0, got {n}")
    if sum(task_examples.values()) == 0:
        raise ValueError(f"{what} task_examples must hold examples: the built-in tasks are what is evaluated")


@dataclass(frozen=True)
class CorpusSpec:
    """How much of each document kind the corpus holds.

    ``task_examples`` maps each built-in task family to its number of training examples. They
    are set per family because the families differ a lot in length and difficulty: a counting
    example has ~2x the tokens of a copying one, so equal counts would spend most tokens on
    counting. Examples are grouped into documents of 1 to ``examples_per_document`` (see the
    module docstring).
    """

    task_examples: Mapping[str, int]
    record_documents: int
    code_chars: int
    examples_per_document: int = 1

    def __post_init__(self) -> None:
        check_task_examples(self.task_examples, "corpus")
        for name, value in (("record_documents", self.record_documents), ("code_chars", self.code_chars)):
            if value < 0:
                raise ValueError(f"corpus {name} must be >= 0, got {value}")
        if self.examples_per_document < 1:
            raise ValueError(f"corpus examples_per_document must be >= 1, got {self.examples_per_document}")


@dataclass(frozen=True)
class CorpusStats:
    path: str
    documents: int
    task_examples: int
    task_documents: int
    record_documents: int
    code_documents: int
    chars: int
    code_chars: int


def build_documents(spec: CorpusSpec, seed: int) -> list[tuple[str, str]]:
    """``(kind, text)`` documents, interleaved deterministically so every shard sees every kind."""
    examples = [t for family, n in spec.task_examples.items() if n
                for t in training_corpus(n, seed=seed, families=(family,))]
    rng = random.Random(f"corpus-groups:{seed}")
    rng.shuffle(examples)
    tagged = []
    start = 0
    while start < len(examples):
        k = rng.randint(1, spec.examples_per_document)
        tagged.append(("task", "".join(examples[start : start + k])))
        start += k
    tagged += [("records", t) for t in record_documents(spec.record_documents, seed=seed)]
    tagged += [("code", t) for t in stdlib_documents(spec.code_chars)]
    random.Random(f"corpus-order:{seed}").shuffle(tagged)
    return tagged


def write_corpus(spec: CorpusSpec, path: str | Path, seed: int) -> CorpusStats:
    """Write the corpus as jsonl (``{"text": ...}`` per line), the input of ``tools/prepare_data.py``."""
    docs = build_documents(spec, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _, text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    count = {k: sum(1 for kind, _ in docs if kind == k) for k in ("task", "records", "code")}
    return CorpusStats(
        path=str(path),
        documents=len(docs),
        task_examples=sum(spec.task_examples.values()),
        task_documents=count["task"],
        record_documents=count["records"],
        code_documents=count["code"],
        chars=sum(len(t) for _, t in docs),
        code_chars=sum(len(t) for kind, t in docs if kind == "code"),
    )


def write_sft_pairs(task_examples: Mapping[str, int], path: str | Path, seed: int) -> int:
    """Write ``{"prompt", "response"}`` lines of the built-in tasks; returns how many.

    The input of ``tools/prepare_data.py --task sft --raw-sft``. Why an SFT stage in the
    quickstart: in continued pretraining a masked slot right after the end of a counting range
    rarely has the whole prompt and answer before it in view, so a minutes-trained model does not
    learn where to stop. SFT keeps every prompt observed and masks only answers, which is the
    decoding situation (docs/results.md: what it changed). Pairs are an independent draw of
    the training split (held-out prompts never appear), in a seeded shuffled order.
    """
    check_task_examples(task_examples, "sft")
    pairs = [pair for family, n in task_examples.items() if n > 0
             for pair in training_pairs(n, seed=f"sft:{seed}", families=(family,))]
    random.Random(f"sft-order:{seed}").shuffle(pairs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for prompt, response in pairs:
            f.write(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False) + "\n")
    return len(pairs)


def read_corpus(path: str | Path) -> Iterator[str]:
    """Texts of a corpus file written by :func:`write_corpus`."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def sample_texts(texts: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """A deterministic sample of ``n`` texts (all when fewer), e.g. to check a tokenizer on."""
    if len(texts) <= n:
        return list(texts)
    return random.Random(f"sample:{seed}").sample(list(texts), n)
