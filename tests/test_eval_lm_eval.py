"""The ``wedlm`` lm-evaluation-harness model: likelihoods against a brute-force forward,
generation against the streaming decoder, and an offline run of local harness tasks."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from megatron_wedlm.decoding import generate  # noqa: E402
from megatron_wedlm.eval.lm_eval_adapter import WeDLMLM  # noqa: E402
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer, arch="qwen2", seed=2)


def _request(kind: str, args: tuple, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


@torch.no_grad()
def brute_force_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """One unpadded forward over context + continuation, summing the continuation's log-probs."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([ctx + cont])).logits[0].float()
    logits[:, tokenizer.mask_token_id] = float("-inf")
    logprobs = torch.log_softmax(logits, -1)
    total, greedy = 0.0, True
    for i, token in enumerate(cont):
        row = logprobs[len(ctx) + i - 1]
        total += row[token].item()
        greedy &= int(row.argmax()) == token
    return total, greedy


PAIRS = [
    ("Count from 3 to 9:", " 3 4 5 6 7 8 9"),
    ("Question: What is 2 + 2?\nAnswer:", " 4"),
    ("def add(a, b): return", " a + b"),
    ("Repeat q w e:", " q w e"),
    ("The quick brown", " fox"),
]


def test_loglikelihood_matches_brute_force_in_any_batch_size(model, tokenizer):
    for context, continuation in PAIRS:  # the chosen splits tokenize cleanly on their own
        joined = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        parts = tokenizer(context, add_special_tokens=False)["input_ids"] + tokenizer(continuation, add_special_tokens=False)["input_ids"]
        assert joined == parts
    requests = [_request("loglikelihood", pair, i) for i, pair in enumerate(PAIRS)]
    expected = [brute_force_loglikelihood(model, tokenizer, *pair) for pair in PAIRS]
    for batch_size in (1, 3):
        got = WeDLMLM(model=model, tokenizer=tokenizer, batch_size=batch_size).loglikelihood(requests)
        assert [g for _, g in got] == [g for _, g in expected]
        for (lp, _), (ref, _) in zip(got, expected):
            assert lp == pytest.approx(ref, abs=1e-4)
    # trailing context whitespace moves to the continuation, so the token boundary is the same
    moved = WeDLMLM(model=model, tokenizer=tokenizer).loglikelihood([_request("loglikelihood", ("The quick brown ", "fox"))])
    assert moved[0][0] == pytest.approx(expected[-1][0], abs=1e-4)


def test_loglikelihood_greedy_flag_is_true_for_the_models_own_continuation(model, tokenizer):
    lm = WeDLMLM(model=model, tokenizer=tokenizer)
    context = "Count from 3 to 9:"
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        for _ in range(3):
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[tokenizer.mask_token_id] = float("-inf")
            ids.append(int(logits.argmax()))
    greedy_ids = ids[-3:]
    prefix_len = len(ids) - 3
    # score token ids directly (text round trips of random tokens need not re-tokenize the same)
    (lp, is_greedy), = lm._score([(ids[:prefix_len], greedy_ids)])
    assert is_greedy and lp < 0


def test_loglikelihood_rolling_equals_full_sequence_score(model, tokenizer):
    text = "Count from 3 to 9: 3 4 5 6 7 8 9"
    lm = WeDLMLM(model=model, tokenizer=tokenizer)
    (rolling,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    eos = tokenizer.decode([tokenizer.eos_token_id])
    expected, _ = brute_force_loglikelihood(model, tokenizer, eos, text)
    assert rolling == pytest.approx(expected, abs=1e-4)
    # a context window shorter than the text still scores every token exactly once, so the total
    # can only change through lost context, and stays finite and negative
    short = WeDLMLM(model=model, tokenizer=tokenizer, max_length=6).loglikelihood_rolling(
        [_request("loglikelihood_rolling", (text,))]
    )[0]
    assert short < 0 and short != pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("refill", ["fused", "paper"])
def test_generate_until_is_streaming_decoding_cut_at_until(model, tokenizer, refill):
    lm = WeDLMLM(model=model, tokenizer=tokenizer, window_size=4, entropy_threshold=0.5, refill=refill)
    contexts = ["Count from 3 to 9:", "Repeat q w e:"]
    until = ["4", "e"]
    requests = [_request("generate_until", (c, {"until": [u], "max_gen_toks": 12}), i) for i, (c, u) in enumerate(zip(contexts, until))]
    outputs = lm.generate_until(requests)
    for context, stop, out in zip(contexts, until, outputs):
        direct = generate(model, tokenizer(context, add_special_tokens=False)["input_ids"], method="streaming",
                          mask_token_id=tokenizer.mask_token_id, window_size=4, entropy_threshold=0.5,
                          max_new_tokens=12, stop_token_ids=[tokenizer.eos_token_id], stop_strings=[stop],
                          tokenizer=tokenizer, fused_refill=refill == "fused")
        text = tokenizer.decode(direct.token_ids, skip_special_tokens=True)
        assert out == text.split(stop)[0] and stop not in out


def test_generate_until_batches_greedy_requests_without_changing_them(model, tokenizer):
    """batch_size > 1: requests sharing their arguments decode in continuous batches; every output
    equals the one-at-a-time output (greedy), whatever the grouping and order."""
    contexts = ["Count from 3 to 9:", "Repeat q w e:", "Count from 10 to 14:", "abc", "Repeat x y:", "7 8"]
    kwargs = [{"until": ["4"], "max_gen_toks": 12}, {"until": ["e"], "max_gen_toks": 12},
              {"until": ["4"], "max_gen_toks": 12}, {"until": ["\n"], "max_gen_toks": 8},
              {"until": ["e"], "max_gen_toks": 12}, {"until": ["4"], "max_gen_toks": 12}]
    requests = [_request("generate_until", (c, k), i) for i, (c, k) in enumerate(zip(contexts, kwargs))]
    one = WeDLMLM(model=model, tokenizer=tokenizer, window_size=4, entropy_threshold=0.5, batch_size=1)
    alone = [one.generate_until([r])[0] for r in requests]
    for batch_size in (2, 4):
        lm = WeDLMLM(model=model, tokenizer=tokenizer, window_size=4, entropy_threshold=0.5, batch_size=batch_size)
        assert lm.generate_until(requests) == alone
        assert lm.generate_until(requests[::-1]) == alone[::-1]


def test_loads_a_checkpoint_directory(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = WeDLMLM.create_from_arg_string(f"pretrained={tmp_path},window_size=4,entropy_threshold=0.3", {"device": "cpu"})
    assert (lm.settings.window_size, lm.settings.entropy_threshold, lm.mask_token_id) == (4, 0.3, tokenizer.mask_token_id)
    request = [_request("loglikelihood", PAIRS[0])]
    assert lm.loglikelihood(request)[0][0] == pytest.approx(brute_force_loglikelihood(model, tokenizer, *PAIRS[0])[0], abs=1e-4)


def test_a_moe_checkpoint_loads_and_scores_as_its_hf_forward(tokenizer, tmp_path):
    """A Qwen3-MoE export (transformers saves its experts one by one and fuses them on load) through
    the loader evaluate.py uses: log-likelihoods in padded batches equal the saved model's own
    unpadded forward, and generation equals the streaming decode of the model that was saved."""
    moe = build_tiny_model(tokenizer, arch="qwen3_moe", seed=2)
    moe.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = WeDLMLM.create_from_arg_string(f"pretrained={tmp_path},window_size=4,entropy_threshold=0.5,batch_size=3",
                                        {"device": "cpu"})
    assert type(lm.model).__name__ == "Qwen3MoeForCausalLM" and lm.mask_token_id == tokenizer.mask_token_id
    expected = [brute_force_loglikelihood(moe, tokenizer, *pair) for pair in PAIRS]
    got = lm.loglikelihood([_request("loglikelihood", pair, i) for i, pair in enumerate(PAIRS)])
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-4)
    (out,) = lm.generate_until([_request("generate_until", (PAIRS[0][0], {"until": ["\n\n"], "max_gen_toks": 12}))])
    direct = generate(moe, tokenizer(PAIRS[0][0], add_special_tokens=False)["input_ids"], method="streaming",
                      window_size=4, entropy_threshold=0.5, max_new_tokens=12, stop_token_ids=[tokenizer.eos_token_id],
                      stop_strings=["\n\n"], tokenizer=tokenizer)
    assert out == tokenizer.decode(direct.token_ids, skip_special_tokens=True).split("\n\n")[0] and out


def test_constructor_errors(model, tokenizer):
    with pytest.raises(ValueError, match="exactly one"):
        WeDLMLM()
    with pytest.raises(ValueError, match="tokenizer"):
        WeDLMLM(model=model)
    with pytest.raises(ValueError, match="method"):
        WeDLMLM(model=model, tokenizer=tokenizer, method="beam")
    with pytest.raises(ValueError, match="refill must be fused"):
        WeDLMLM(model=model, tokenizer=tokenizer, refill="later")


def test_registered_and_runs_local_harness_tasks_offline(model, tokenizer, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    assert get_model("wedlm") is WeDLMLM
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"question": f"What comes after {i}?", "choices": [str(i + 1), str(i + 2), "cat"], "label": i % 3,
             "answer": str(i + 1)} for i in range(6)]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'hf'}\n"
              "test_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n")
    (tmp_path / "mc.yaml").write_text(
        "task: wedlm_tiny_mc\noutput_type: multiple_choice\n" + common
        + "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    (tmp_path / "gen.yaml").write_text(
        "task: wedlm_tiny_gen\noutput_type: generate_until\n" + common
        + "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    lm = WeDLMLM(model=model, tokenizer=tokenizer, batch_size=4, window_size=4)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["wedlm_tiny_mc", "wedlm_tiny_gen"], bootstrap_iters=0, log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
    )
    # multiple choice: accuracy is the share of rows whose gold choice has the highest likelihood
    correct = 0
    for row in rows:
        scores = [brute_force_loglikelihood(model, tokenizer, f"Question: {row['question']}\nAnswer:", " " + c)[0]
                  for c in row["choices"]]
        correct += max(range(3), key=scores.__getitem__) == row["label"]
    assert out["results"]["wedlm_tiny_mc"]["acc,none"] == pytest.approx(correct / len(rows))
    # generation: every response is what the streaming decoder produces for that prompt
    samples = out["samples"]["wedlm_tiny_gen"]
    assert len(samples) == len(rows)
    for sample in samples:
        (prompt, gen_kwargs), = sample["arguments"]
        assert prompt.startswith("Question: What comes after") and gen_kwargs["max_gen_toks"] == 6
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        direct = generate(model, ids, method="streaming", mask_token_id=tokenizer.mask_token_id, window_size=4,
                          entropy_threshold=0.4, max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id],
                          stop_strings=["\n"], tokenizer=tokenizer)
        expected = tokenizer.decode(direct.token_ids, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == expected
    assert (tmp_path / "hf").is_dir()  # the harness's dataset cache stayed inside the test directory
