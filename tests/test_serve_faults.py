"""The server fails loudly: a fault in the engine reaches every client, /health and /metrics.

The app runs in this process under uvicorn on a loopback port, so a fault can be put into its
engine: the model's forward raising (a device error), and the engine thread raising outside the
forward (its batch bookkeeping). Real clients (the OpenAI SDK streaming, httpx not streaming) are
in flight when it happens; each must get an error within 5 s, none may hang, and the server must
say it is down (503) rather than queue requests it will never serve, as vLLM does.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from megatron_wedlm.decoding import load_tokenizer, load_wedlm_model  # noqa: E402
from megatron_wedlm.decoding.inputs import eos_token_ids  # noqa: E402
from megatron_wedlm.runtime.multiprocess import find_free_port  # noqa: E402
from megatron_wedlm.serving.app import ServedModel, build_app  # noqa: E402
from megatron_wedlm.serving.engine import ServingEngine  # noqa: E402
from megatron_wedlm.testing.serving import write_tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)
NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("faults") / NAME)


@contextmanager
def in_process_server(model_dir, api_key: str | None = None):
    """A fresh engine and app on a free port; yields ``(url, engine)``."""
    model, tokenizer = load_wedlm_model(model_dir, device="cpu"), load_tokenizer(model_dir)
    engine = ServingEngine(model, tokenizer, max_rows=4, max_queue=16, max_model_len=512, max_window=16)
    served = ServedModel(NAME, tokenizer, {}, eos_token_ids(model, tokenizer))
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, served, api_key=api_key), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(60)


def failed_count(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('wedlm_requests_total{status="failed"}'):
            return float(line.split()[-1])
    raise KeyError("wedlm_requests_total failed")


def fire(url: str, count: int) -> list[concurrent.futures.Future]:
    """``count`` requests of 400 tokens, half streamed through the SDK, half whole through httpx;
    each future gives ``(how it ended, when)``."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def streamed(i: int):
        try:
            for _ in client.completions.create(model=NAME, prompt=f"{i} 2 3", max_tokens=400, stream=True):
                pass
            return "completed", time.monotonic()
        except openai.APIError as error:  # the SSE error event, raised by the SDK
            return f"error: {error}", time.monotonic()

    def whole(i: int):
        reply = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": f"{i} 5 6", "max_tokens": 400},
                           timeout=60)
        return (f"{reply.status_code}: {reply.json()['error']['message']}" if reply.status_code != 200
                else "completed"), time.monotonic()

    pool = concurrent.futures.ThreadPoolExecutor(count)
    return [pool.submit(streamed if i % 2 else whole, i) for i in range(count)]


@pytest.mark.parametrize("where", ["forward", "outside the forward"])
def test_a_fault_reaches_every_client_then_health_and_new_requests_answer_503(model_dir, where):
    with in_process_server(model_dir) as (url, engine):
        assert httpx.get(url + "/health").status_code == 200
        armed, broke = threading.Event(), threading.Event()  # armed once all six are in the engine

        def failing(original, error: Exception):
            def call(*args, **kwargs):
                if armed.is_set():
                    broke.set()
                    raise error
                return original(*args, **kwargs)
            return call

        if where == "forward":  # the transformer the runner calls
            engine.runner.body = failing(engine.runner.body, RuntimeError(
                "CUDA error: an illegal memory access was encountered (injected)"))
        else:
            engine.runner.advance = failing(engine.runner.advance, KeyError("a row index the batch lost (injected)"))
        futures = fire(url, 6)
        deadline = time.monotonic() + 60
        while sum(engine.load()) < 6:
            assert time.monotonic() < deadline, f"the six requests never were in the engine: {engine.load()}"
            time.sleep(0.01)
        armed.set()
        assert broke.wait(60), "the fault never ran"
        broken_at = time.monotonic()
        outcomes = [f.result(timeout=30) for f in futures]
        for outcome, ended in outcomes:
            assert outcome != "completed" and "injected" in outcome, outcome
            assert ended - broken_at < 5.0, f"a client heard of the fault {ended - broken_at:.1f} s after it"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]
        late = httpx.post(url + "/v1/completions", json={"prompt": "1", "max_tokens": 4})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_failed"
        assert failed_count(url) == 6


def test_api_key_unknown_model_and_bad_unicode_are_refused_with_openai_errors(model_dir):
    with in_process_server(model_dir, api_key="s3cret") as (url, _):
        body = {"model": NAME, "prompt": "1 2", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/health").status_code == 200  # probes need no key, as vLLM's
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(**body).usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(**{**body, "model": "gpt-4"})
        # a lone surrogate is legal JSON (an escape) that no SDK sends: raw bodies
        auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
        for path, raw in (("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 4}'),
                          ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}')):
            reply = httpx.post(url + path, content=raw, headers=auth)
            assert reply.status_code == 400 and "lone surrogate" in reply.json()["error"]["message"], reply.text
