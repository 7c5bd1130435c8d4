"""The quickstart's training text, built on the machine from the seed and the Python installation
alone (nothing downloaded; a rerun writes byte-identical files): low-entropy documents of the
built-in tasks (their evaluation prompts held out) and CSV tables, where parallel decoding gains,
and Python's own stdlib sources, high-entropy text where it must be shown to gain little; plus the
SFT pairs (:func:`write_sft_pairs`).
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
    """Head of each ``Lib/*.py`` file in sorted order (cut at a line end) until ``max_chars``:
    heads of many files give more varied code than whole files."""
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
    """Raise ``ValueError`` for an examples-per-family map with unknown families, negative counts or
    nothing in it; ``what`` names the map in the message."""
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
    """How much of each document kind the corpus holds; ``task_examples`` is per family, since the
    families differ in length and difficulty. Several examples per document put each at many block
    offsets, so a short answer is also masked with its whole prompt known, as in decoding."""

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
    """Write ``{"prompt", "response"}`` lines (the input of ``tools/prepare_data.py --task sft
    --raw-sft``) of an independent, seeded draw of the tasks' training split; returns how many."""
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
