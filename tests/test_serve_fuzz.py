"""Requests generated from the server's own OpenAPI schema, sent to a real server: none may get a 500.

Hypothesis builds bodies for ``/v1/completions`` and ``/v1/chat/completions`` from the schema
FastAPI publishes (so a field added to the API is fuzzed without touching this file): each field
either a value of its declared type or an odd one (a wrong type, huge and negative numbers, NaN,
lone surrogates and other odd Unicode, deep nesting), plus unknown fields and bodies that are not
objects at all. Every reply must be an OpenAI error object (4xx) or a valid response, streamed
or not, and the server must be up and serving at the end. ``WEDLM_FUZZ_REQUESTS`` sets how many
(CI's default keeps the file near a minute; the issue's 2,000 were run by hand, docs/results.md).
"""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from megatron_wedlm.testing.serving import ServerProcess, write_tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)
REQUESTS = int(os.environ.get("WEDLM_FUZZ_REQUESTS", "250"))
KEY = "fuzz-key"
PATHS = ("/v1/completions", "/v1/chat/completions")

TEXT = st.text(st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "\u202e\u0301\ufeff", "\U0001f600" * 20, "x" * 5000, "<|mask|>", "<|im_end|>"])
NUMBER = (st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 1e308, -0.0]))
# nesting deeper than Python's own parser takes: a placeholder that raw() writes out as brackets
DEEP = st.integers(1, 100_000).map(lambda depth: f"@@deep{depth}@@")
ODD = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                   max_leaves=12) | DEEP


def raw(body) -> str:
    """The JSON text sent: NaN and lone surrogates (as escapes) are what clients may send, and the
    deep-nesting placeholders become that many brackets."""
    text = json.dumps(body, allow_nan=True)
    return re.sub(r'"@@deep(\d+)@@"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text)


def resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def of_type(schema: dict, spec: dict) -> st.SearchStrategy:
    """A value of the declared type (near and past its bounds)."""
    schema = resolve(schema, spec)
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([of_type(s, spec) for s in schema[key]])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum", -10)), schema.get("maximum", 300)
        return st.integers(int(low) - 3, int(high) + 3)
    if kind == "number":
        return st.floats(-3, 3, allow_nan=False)
    if kind == "string":
        return TEXT
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(of_type(schema.get("items", {}), spec), max_size=3)
    if kind == "object" and "properties" in schema:
        return body_of(schema, spec)
    if kind == "object":
        return st.dictionaries(TEXT, ODD, max_size=2)
    return ODD


def body_of(schema: dict, spec: dict) -> st.SearchStrategy:
    """Half the bodies have fields of their declared types only (so many are served, and the
    decoding paths run on odd but valid input); half mix in odd values and unknown fields."""
    schema = resolve(schema, spec)

    def bodies(odd: bool) -> st.SearchStrategy:
        fields = {name: of_type(s, spec) | ODD if odd else of_type(s, spec)
                  for name, s in schema["properties"].items() if odd or name != "model"}
        required = {name: fields.pop(name) for name in schema.get("required", []) if name in fields}
        known = st.fixed_dictionaries(required, optional=fields)
        extra = st.dictionaries(st.text(max_size=8), ODD, max_size=1) if odd else st.just({})
        return st.tuples(known, extra).map(lambda kv: {**kv[1], **kv[0]})

    return bodies(False) | bodies(True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("fuzz") / "tiny")
    with ServerProcess(model, "--max-model-len", "48", "--max-rows", "4", "--served-model-name", "tiny",
                       "--api-key", KEY, log=tmp_path_factory.mktemp("logs") / "server.log") as process:
        yield process


def check_reply(reply: httpx.Response, streamed: bool) -> None:
    assert reply.status_code < 500, f"{reply.status_code}: {reply.text[:500]}"
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        return
    if streamed and reply.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), reply.text[-500:]
        for event in events[:-1]:
            assert "choices" in json.loads(event)
        return
    body = reply.json()
    assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body


def test_generated_requests_never_get_a_500_and_the_server_stays_up(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    bodies = {path: body_of(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
                            spec) for path in PATHS}
    request = st.sampled_from(PATHS).flatmap(lambda path: st.tuples(st.just(path), bodies[path] | ODD))
    sent: list[int] = []
    http = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})

    @settings(max_examples=REQUESTS, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request)
    def one(case):
        path, body = case
        reply = http.post(path, content=raw(body), headers={"Content-Type": "application/json"})
        sent.append(reply.status_code)
        check_reply(reply, isinstance(body, dict) and body.get("stream") is True)

    one()
    http.close()
    assert len(sent) >= REQUESTS * 0.9 and 200 in sent and 400 in sent, sorted(set(sent))
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "1 2", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    print(f"{len(sent)} requests: " + ", ".join(f"{s}: {sent.count(s)}" for s in sorted(set(sent))))
