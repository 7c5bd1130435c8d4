"""Quickstart corpus and tokenizer: deterministic, held-out prompts stay out, ids survive the export reload."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_wedlm.eval.builtin_tasks import FAMILIES, builtin_task, training_corpus
from megatron_wedlm.quickstart.corpus import (
    CorpusSpec,
    build_documents,
    read_corpus,
    stdlib_dir,
    stdlib_documents,
    write_corpus,
    write_sft_pairs,
)
from megatron_wedlm.data.tokenizer import MASK_TOKEN, check_reload, save_tokenizer, train_tokenizer

SPEC = CorpusSpec(task_examples={"counting": 100, "copying": 150, "arithmetic": 50}, record_documents=20,
                  code_chars=20000, examples_per_document=3)


def test_corpus_is_deterministic_and_seeded(tmp_path):
    a = write_corpus(SPEC, tmp_path / "a.jsonl", seed=3)
    b = write_corpus(SPEC, tmp_path / "b.jsonl", seed=3)
    c = write_corpus(SPEC, tmp_path / "c.jsonl", seed=4)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert (a.task_examples, a.record_documents) == (300, 20) and 100 <= a.task_documents < 300
    assert a.documents == a.task_documents + a.record_documents + a.code_documents
    assert c.task_examples == a.task_examples and c.code_documents == a.code_documents
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) == a.documents and all(set(json.loads(x)) == {"text"} for x in lines)


def test_corpus_never_contains_an_evaluation_prompt(tmp_path):
    spec = CorpusSpec(task_examples={f: 1000 for f in FAMILIES}, record_documents=0, code_chars=0)
    write_corpus(spec, tmp_path / "c.jsonl", seed=0)
    texts = set(read_corpus(tmp_path / "c.jsonl"))
    for family in FAMILIES:
        for ex in builtin_task(family, num_examples=30, seed=0).examples:
            assert not any(t.startswith(ex.prompt) for t in texts), ex.prompt


def _correct_answer(prompt: str) -> str:
    """The completion a perfect model gives, recomputed from the prompt (counting and copying)."""
    if prompt.startswith("Count from "):
        start, end = (int(x) for x in prompt[len("Count from "):-1].split(" to "))
        return "".join(f" {i}" for i in range(start, end + 1)) + "\n"
    assert prompt.startswith("Repeat ")
    return " " + prompt[len("Repeat "):-1] + "\n"


def test_sft_pairs_are_seeded_correct_and_held_out_free(tmp_path):
    counts = {"counting": 300, "copying": 200}
    n = write_sft_pairs(counts, tmp_path / "a.jsonl", seed=2)
    write_sft_pairs(counts, tmp_path / "b.jsonl", seed=2)
    write_sft_pairs(counts, tmp_path / "c.jsonl", seed=3)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    pairs = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert n == len(pairs) == 500 and all(set(p) == {"prompt", "response"} for p in pairs)
    assert sum(p["prompt"].startswith("Count") for p in pairs) == 300
    assert all(p["response"] == _correct_answer(p["prompt"]) for p in pairs)
    # shuffled across families, not one block per family
    assert any(p["prompt"].startswith("Repeat") for p in pairs[:100])
    # an independent draw: not the pretraining corpus's examples in the same order
    corpus_copying = training_corpus(200, seed=2, families=("copying",))
    sft_copying = [p["prompt"] + p["response"] for p in pairs if p["prompt"].startswith("Repeat")]
    assert sft_copying != corpus_copying
    held_out = {ex.prompt for f in counts for ex in builtin_task(f, num_examples=30, seed=2).examples}
    assert not held_out & {p["prompt"] for p in pairs}
    with pytest.raises(ValueError, match="unknown families"):
        write_sft_pairs({"poetry": 3}, tmp_path / "d.jsonl", seed=0)
    with pytest.raises(ValueError, match="must hold examples"):
        write_sft_pairs({"counting": 0}, tmp_path / "d.jsonl", seed=0)
    with pytest.raises(ValueError, match="counting must be >= 0"):
        write_sft_pairs({"counting": -1, "copying": 5}, tmp_path / "d.jsonl", seed=0)


def test_stdlib_documents_come_from_the_running_python(tmp_path):
    docs = stdlib_documents(max_chars=30000, chars_per_file=4000)
    assert 30000 <= sum(len(d) for d in docs) <= 30000 + len(docs)
    first = sorted(stdlib_dir().glob("*.py"))[0].read_text(encoding="utf-8", errors="replace")
    assert first.strip("\n").startswith(docs[0].strip("\n")[:200])
    assert all(len(d) <= 4001 for d in docs)


@pytest.mark.parametrize("bad, message", [
    ({"task_examples": {"counting": 0}}, "must hold examples"),
    ({"task_examples": {"counting": -1}}, "counting must be >= 0"),
    ({"task_examples": {"poetry": 3}}, "unknown families"),
    ({"code_chars": -1}, "code_chars"),
    ({"examples_per_document": 0}, "examples_per_document"),
])
def test_corpus_spec_rejects_bad_sizes(bad, message):
    with pytest.raises(ValueError, match=message):
        CorpusSpec(**{"task_examples": {"copying": 10}, "record_documents": 0, "code_chars": 0, **bad})


def test_corpus_holds_the_requested_examples_grouped_into_documents(tmp_path):
    docs = build_documents(SPEC, seed=0)
    task_docs = [t for kind, t in docs if kind == "task"]
    examples = [line for t in task_docs for line in t.splitlines()]
    assert sorted(examples) == sorted(line for f, n in SPEC.task_examples.items()
                                      for line in "".join(training_corpus(n, seed=0, families=(f,))).splitlines())
    assert sum(kind == "records" for kind, _ in docs) == 20
    assert [t for _, t in docs] == list(read_corpus(write_corpus(SPEC, tmp_path / "c.jsonl", seed=0).path))
    sizes = {len(t.splitlines()) for t in task_docs}
    assert sizes == {1, 2, 3}  # 1..examples_per_document examples, each one line
    # one example per document: every task document is exactly one training_corpus example
    one = CorpusSpec(task_examples={"copying": 40}, record_documents=0, code_chars=0)
    write_corpus(one, tmp_path / "one.jsonl", seed=0)
    assert sorted(read_corpus(tmp_path / "one.jsonl")) == sorted(training_corpus(40, seed=0, families=("copying",)))


def test_tokenizer_round_trips_and_survives_reload_next_to_a_qwen2_config(tmp_path):
    write_corpus(SPEC, tmp_path / "c.jsonl", seed=0)
    texts = list(read_corpus(tmp_path / "c.jsonl"))
    tok = train_tokenizer(texts, vocab_size=400)
    assert len(tok) == 400 and tok.mask_token == MASK_TOKEN and tok.mask_token_id is not None
    save_tokenizer(tok, tmp_path / "tok")
    reloaded = check_reload(tmp_path / "tok", texts[:50] + ["Count from 17 to 21: 17 18 19 20 21\n", "ünïcode ✓"])
    assert reloaded("def f(x):\n    return x\n")["input_ids"] == tok("def f(x):\n    return x\n")["input_ids"]
    # the same corpus trains the same tokenizer
    again = train_tokenizer(texts, vocab_size=400)
    assert again.get_vocab() == tok.get_vocab()


def test_check_reload_catches_a_tokenizer_that_changes_after_export(tmp_path):
    """A BPE with GPT-2 style pre-tokenization (digits grouped) is re-split by Qwen2Tokenizer."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator([" ".join(str(i) for i in range(300))] * 5, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", mask_token=MASK_TOKEN)
    save_tokenizer(tok, tmp_path / "gpt2_style")
    with pytest.raises(ValueError, match="differently after a reload"):
        check_reload(tmp_path / "gpt2_style", ["Count from 117 to 121: 117 118 119 120 121"])


def test_train_tokenizer_rejects_a_vocab_smaller_than_the_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
