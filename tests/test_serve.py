"""The OpenAI-compatible server (inference/serve.py), driven over loopback by real clients.

Every generation is compared with the one-at-a-time decode of the same checkpoint in this process
(``megatron_wedlm.decoding.generate``; AR: HF ``generate``), so batching, streaming and the HTTP
layer are checked to change nothing. Faults (killed clients, a full queue, SIGTERM, bad requests)
are provoked for real against a server process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import pydantic  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from megatron_wedlm.decoding import DecodeSettings, generate, load_tokenizer, load_wedlm_model  # noqa: E402
from megatron_wedlm.decoding.inputs import encode_prompt, eos_token_ids  # noqa: E402
from megatron_wedlm.serving.openai_api import BadRequest, CompletionRequest  # noqa: E402
from megatron_wedlm.testing.serving import ServerProcess, write_tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["1 2 3", "def add(a, b):\n    return", "The quick brown fox", "7", "for i in range(10):", "A. B. C.",
           "assert add(1, 2) == 3", "Problem: Solution:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def local(model_dir):
    """The same checkpoint in this process, for the reference decodes."""
    model = load_wedlm_model(model_dir, device="cpu")
    return model, load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with ServerProcess(model_dir, "--max-rows", "6", "--max-queue", "32", "--max-model-len", "1024",
                       log=log) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(local, prompt: str, chat: bool = False, **settings):
    """The one-at-a-time decode the server must reproduce (its defaults: built-in, EOS stops)."""
    model, tokenizer = local
    settings = DecodeSettings(**{"stop_token_ids": eos_token_ids(model, tokenizer), **settings})
    return generate(model, encode_prompt(tokenizer, prompt, chat), settings, tokenizer=tokenizer)


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_models_health_and_page(server, model_dir):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [model_dir.name]
    assert models["data"][0]["max_model_len"] == 1024
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert "<script>" in httpx.get(server.url + "/").text


@pytest.mark.parametrize("method", ["streaming", "blockwise", "ar"])
def test_sdk_replies_equal_the_one_at_a_time_decode(client, local, method):
    expected = reference(local, PROMPTS[1], method=method, max_new_tokens=24, window_size=4)
    reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24,
                                      extra_body={"method": method, "window_size": 4})
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == expected.num_generated
    assert reply.usage.model_extra["forwards"] == expected.num_forwards
    assert reply.choices[0].finish_reason == ("stop" if expected.stop_reason == "stop_token" else "length")

    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"method": method, "window_size": 4}))
    commits = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in commits) == expected.text
    # one chunk per forward that committed tokens, with the tokens it committed
    assert sum(c.model_extra["wedlm"]["tokens"] for c in commits) == expected.num_generated
    assert len({c.model_extra["wedlm"]["forward"] for c in commits}) == len(commits)
    assert chunks[-1].usage.completion_tokens == expected.num_generated


def test_chat_streamed_and_not_equals_the_chat_template_decode(client, local):
    expected = reference(local, "hello there", chat=True, max_new_tokens=16)
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(encode_prompt(local[1], "hello there", chat=True))
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    # vLLM's ignore_eos, as benchmarks send it: max_tokens tokens, whatever the stop tokens
    unstopped = reference(local, "hello there", chat=True, max_new_tokens=16, stop_token_ids=())
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == unstopped.text and reply.usage.completion_tokens == 16


def test_sixteen_concurrent_streams_each_equal_their_one_at_a_time_decode(client, local, server):
    jobs = [(PROMPTS[i % len(PROMPTS)], ["streaming", "blockwise", "ar"][i % 3], 3 + i % 4, 20 + 3 * i)
            for i in range(16)]
    texts: dict[int, str] = {}

    def run(i: int) -> None:
        prompt, method, window, tokens = jobs[i]
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens, stream=True,
                                           extra_body={"method": method, "window_size": window})
        texts[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(texts) == list(range(16))
    for i, (prompt, method, window, tokens) in enumerate(jobs):
        assert texts[i] == reference(local, prompt, method=method, window_size=window, max_new_tokens=tokens).text, i
    wait_for(lambda: metric(server, "wedlm_running_rows") == 0)


def test_a_moe_checkpoint_is_served_as_it_decodes_alone(tmp_path):
    """The exported tiny Qwen3-MoE behind inference/serve.py: concurrent greedy requests of every
    method, streamed or not, share the server's forwards, and each reply equals the one-at-a-time
    decode of the same checkpoint (its experts route each token alone)."""
    moe_dir = write_tiny_chat_model(tmp_path / "tiny-moe", arch="qwen3_moe")
    local_moe = (load_wedlm_model(moe_dir, device="cpu"), load_tokenizer(moe_dir))
    assert type(local_moe[0]).__name__ == "Qwen3MoeForCausalLM"
    jobs = [(PROMPTS[i], ["streaming", "blockwise", "ar"][i % 3], 3 + i % 3, 12 + 2 * i, i % 2 == 0) for i in range(6)]
    replies: dict[int, tuple[str, int]] = {}
    with ServerProcess(moe_dir, "--max-rows", "3", "--max-queue", "8", "--max-model-len", "1024",
                       log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def run(i: int) -> None:
            prompt, method, window, tokens, stream = jobs[i]
            kw = dict(model="tiny-moe", prompt=prompt, max_tokens=tokens,
                      extra_body={"method": method, "window_size": window})
            if stream:
                commits = [c for c in client.completions.create(stream=True, **kw) if c.choices]
                replies[i] = ("".join(c.choices[0].text for c in commits),
                              sum(c.model_extra["wedlm"]["tokens"] for c in commits))
            else:
                reply = client.completions.create(**kw)
                replies[i] = (reply.choices[0].text, reply.usage.completion_tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert metric(server, "wedlm_row_forwards_total") > metric(server, "wedlm_forwards_total")  # rows shared them
    assert sorted(replies) == list(range(len(jobs)))
    for i, (prompt, method, window, tokens, _) in enumerate(jobs):
        expected = reference(local_moe, prompt, method=method, window_size=window, max_new_tokens=tokens)
        assert replies[i] == (expected.text, expected.num_generated), (i, method)


def test_a_seed_makes_sampling_reproducible_whatever_the_batch(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=1.0,
                                          seed=seed).choices[0].text

    alone = sample(7)
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda k=k: together.__setitem__(k, sample(7 if k == 0 else 100 + k)))
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together[0] == alone
    assert len({alone, together[1], together[2], together[3]}) > 1  # other seeds draw other replies


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 4, "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "max_tokens": 4, "method": "magic"}, "method"),
    ({"prompt": "hi", "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 4, "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": 4, "logprobs": 21}, "logprobs"),  # 0 to 20: test_serve_logprobs.py
    ({"prompt": "hi", "max_tokens": 2000}, "max_tokens"),
    ({"prompt": "x " * 1100, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 4, "window_size": 500}, None),
])
def test_bad_requests_answer_400_with_an_openai_error(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("field, neutral, refused", [
    ("presence_penalty", 0.0, 0.5), ("frequency_penalty", 0, -1.0), ("logit_bias", {}, {"42": 5.0}),
    ("n", 1, 2), ("best_of", 1, 2), ("suffix", "", "x"),  # logprobs and echo are served: test_serve_logprobs.py
])
def test_fields_this_server_cannot_honour_pass_only_at_their_neutral_value(field, neutral, refused):
    """What docs/serving.md says: lm-evaluation-harness sends penalties of 0 and must be served;
    any other value is refused naming the reason, not silently ignored."""
    CompletionRequest(prompt="hi", **{field: neutral}).check_supported()
    with pytest.raises(BadRequest, match="not supported"):
        CompletionRequest(prompt="hi", **{field: refused}).check_supported()


def test_a_field_openai_does_not_have_is_refused_even_at_a_neutral_value():
    with pytest.raises(pydantic.ValidationError, match="repetition_penalty"):
        CompletionRequest(prompt="hi", repetition_penalty=1.0)


def test_bad_json_and_the_sdk_see_400(server, client):
    response = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="Extra inputs"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"windowsize": 4})


CLIENT = """
import sys, httpx
with httpx.stream("POST", sys.argv[1] + "/v1/completions", timeout=120,
                  json={"prompt": "1 2 3", "max_tokens": 900, "stream": True, "method": "ar"}) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("chunk", flush=True)
"""


def test_clients_killed_mid_stream_free_their_rows(server, client, local):
    cancelled = metric(server, "wedlm_requests_total", status="cancelled")
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, server.url], stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    for process in clients:
        assert process.stdout.readline().strip() == "chunk"  # streaming has begun
    for process in clients:
        process.kill()
        process.wait()
    wait_for(lambda: metric(server, "wedlm_requests_total", status="cancelled") == cancelled + 3)
    wait_for(lambda: metric(server, "wedlm_running_rows") == 0)
    expected = reference(local, PROMPTS[0], max_new_tokens=12)
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12).choices[0].text == expected.text


def test_metrics_count_requests_and_tokens(server, client):
    before = {name: metric(server, name) for name in ("wedlm_generated_tokens_total", "wedlm_row_forwards_total")}
    finished = metric(server, "wedlm_requests_total", status="finished")
    replies = [client.completions.create(model="tiny", prompt=p, max_tokens=10) for p in PROMPTS[:3]]
    tokens = sum(r.usage.completion_tokens for r in replies)
    forwards = sum(r.usage.model_extra["forwards"] for r in replies)
    assert metric(server, "wedlm_generated_tokens_total") - before["wedlm_generated_tokens_total"] == tokens
    assert metric(server, "wedlm_row_forwards_total") - before["wedlm_row_forwards_total"] == forwards
    assert metric(server, "wedlm_requests_total", status="finished") == finished + 3
    assert metric(server, "wedlm_queue_depth") == 0


def _stream_lines(url: str, body: dict, out: list, key: int) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            out.append((key, response.status_code, response.headers.get("retry-after"),
                        [line for line in response.iter_lines() if line]))
    except httpx.HTTPError as error:
        out.append((key, None, None, [repr(error)]))


def test_a_full_queue_answers_429_with_retry_after(model_dir, tmp_path):
    with ServerProcess(model_dir, "--max-rows", "1", "--max-queue", "1", "--max-model-len", "1024",
                       log=tmp_path / "server.log") as process:
        body = {"prompt": "1 2 3", "max_tokens": 300, "stream": True, "method": "ar"}
        out: list = []
        threads = [threading.Thread(target=_stream_lines, args=(process.url, body, out, k)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = sorted(status for _, status, _, _ in out)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
        for _, status, retry_after, lines in out:
            if status == 429:
                assert int(retry_after) >= 1
                assert json.loads(lines[0])["error"]["type"] == "rate_limit_error"
            else:
                assert lines[-1] == "data: [DONE]"
        assert metric(process, "wedlm_requests_total", status="refused") == statuses.count(429)


def test_sigterm_finishes_the_requests_in_flight_then_exits(model_dir, tmp_path, local):
    process = ServerProcess(model_dir, "--max-rows", "2", "--max-queue", "4", "--max-model-len", "1024",
                            log=tmp_path / "server.log").__enter__()
    try:
        body = {"prompt": "1 2 3", "max_tokens": 400, "stream": True, "method": "ar",
                "stream_options": {"include_usage": True}}
        out: list = []
        threads = [threading.Thread(target=_stream_lines, args=(process.url, body, out, k)) for k in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: metric(process, "wedlm_generated_tokens_total") > 0)
        process.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        # uvicorn finishes, then re-raises the signal it caught, as a process killed by it would end
        assert process.process.wait(60) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in process.log_text()
    finally:
        process.stop()
    expected = reference(local, "1 2 3", method="ar", max_new_tokens=400)
    assert len(out) == 3
    for _, status, _, lines in out:
        assert status == 200 and lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == expected.num_generated


def test_an_exception_in_one_request_fails_that_request_only(model_dir, local):
    """In process: a request whose event handler raises fails alone, ones that do not fit are refused
    as they are submitted; the requests beside them finish with their one-at-a-time decodes."""
    from megatron_wedlm.serving.engine import Request, ServingEngine

    model, tokenizer = load_wedlm_model(model_dir, device="cpu"), local[1]  # the engine's own copy
    # max_model_len beyond the model's 1024 positions: the CLI refuses it, here it lets a row fail as it starts
    engine = ServingEngine(model, tokenizer, max_rows=3, max_queue=8, max_model_len=2048, max_window=8)
    engine.start()
    outcomes: dict[int, list] = {}
    done = threading.Semaphore(0)

    def handler(key: int, explode: bool = False):
        def on_event(event):
            outcomes.setdefault(key, []).append(event)
            if explode and len(outcomes[key]) == 2:
                raise RuntimeError("the client's connection broke")
            if isinstance(event, BaseException) or event.result is not None:
                done.release()
        return on_event

    settings = DecodeSettings(max_new_tokens=30, window_size=4, stop_token_ids=eos_token_ids(model, tokenizer))
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS[:4]]
    engine.submit(Request(prompts[0], settings, handler(0)))
    engine.submit(Request(prompts[1], settings, handler(1, explode=True)))
    with pytest.raises(ValueError, match="max_window"):  # refused before it is queued
        engine.submit(Request(prompts[2], DecodeSettings(window_size=64), handler(2)))
    # a prompt beyond the model's positions passes the server's max_model_len; its row is refused as it is built
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.submit(Request(list(range(5)) * 220, DecodeSettings(max_new_tokens=8, window_size=4), handler(2)))
    engine.submit(Request(prompts[3], settings, handler(3)))
    # no stop ids given: the engine stops at the model's EOS, as generate() does
    engine.submit(Request(prompts[0], DecodeSettings(max_new_tokens=30, window_size=4), handler(4)))
    for _ in range(3):
        assert done.acquire(timeout=60)
    wait_for(lambda: engine.load() == (0, 0))
    engine.shutdown()
    assert 2 not in outcomes
    assert len(outcomes[1]) == 2 and outcomes[1][-1].result is None  # dropped at its failing event
    assert engine.stats.requests["failed"] == 1
    for key, prompt in ((0, PROMPTS[0]), (3, PROMPTS[3]), (4, PROMPTS[0])):
        result = outcomes[key][-1].result
        assert result.token_ids == reference(local, prompt, max_new_tokens=30, window_size=4).token_ids
        assert sum((event.tokens for event in outcomes[key]), []) == result.token_ids
