"""The serving engine: one long-lived batch that requests join and leave between forwards.

A lock, a thread and events around :class:`~megatron_wedlm.decoding.batch.RowBatch`: a
request's row is built at submit, joins at the next step and leaves when it ends or is
cancelled; AR requests are next-token rows of the same batch. The KV cache is allocated once
and a full queue is refused (:class:`QueueFull`). ``on_event`` runs on the engine thread per
forward that decided tokens for a request, and at its end; a raising callback fails its own
request only. An error the batch cannot contain fails every request with
:class:`EngineFailed` and refuses later ones (docs/serving.md). Counters change under the
lock, before the event they count is sent.
"""

from __future__ import annotations

import itertools
import math
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from megatron_wedlm.decoding.batch import CANCELLED, RowBatch, RowPlan, check_settings, row_result, start_row
from megatron_wedlm.decoding.checks import with_default_stops
from megatron_wedlm.decoding.model_runner import ModelRunner, packs_rows
from megatron_wedlm.decoding.prefix_cache import PrefixCache
from megatron_wedlm.decoding.result import GenerationResult
from megatron_wedlm.decoding.settings import AUTOREGRESSIVE, DecodeSettings
from megatron_wedlm.decoding.state import RowState

log = logging.getLogger(__name__)

FAILED = "failed"


class QueueFull(Exception):
    """The waiting queue is full; ``retry_after`` (seconds) is the engine's guess of when a place frees."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server's queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The engine finishes the requests it has and takes no new ones."""


class EngineFailed(RuntimeError):
    """The engine thread stopped on an error; no request can be served until a restart."""


@dataclass(frozen=True)
class Progress:
    """What one forward did for a request: the tokens it decided (a prefix of the final reply),
    its forwards so far, and its result once ended.
    """

    tokens: list[int]
    forwards: int
    result: GenerationResult | None = None


@dataclass
class Request:
    """One generation of ``prompt`` with ``settings``; ``seed`` seeds its own sampler.

    ``on_event`` receives :class:`Progress`, or the exception that failed it.
    """

    prompt: list[int]
    settings: DecodeSettings
    on_event: Callable[[Progress | BaseException], None]
    seed: int | None = None
    id: int = -1
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    sent: int = 0  # tokens reported so far
    counted: int = 0  # committed tokens counted in the engine's stats so far


@dataclass
class EngineStats:
    """Counters for ``/metrics``, changed under the engine's lock, read without it."""

    requests: dict[str, int] = field(default_factory=lambda: {"finished": 0, CANCELLED: 0, FAILED: 0, "refused": 0})
    tokens: int = 0  # generated tokens, all requests
    row_forwards: int = 0  # forwards summed over rows: tokens / row_forwards = tokens per forward
    forwards: int = 0  # batch forwards
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) per forward
    finishes: deque = field(default_factory=lambda: deque(maxlen=1024))  # when requests finished


class ServingEngine:
    """Continuous batching over ``model`` (an SDPA HF model, eval mode) in a background thread.

    ``max_rows`` decoded together, ``max_queue`` waiting, ``max_model_len`` positions per row,
    ``max_window`` the widest window, ``prefix_cache_bytes`` (0: none). :meth:`start` once,
    :meth:`shutdown` at the end.
    """

    def __init__(self, model, tokenizer, *, max_rows: int = 16, max_queue: int = 64, max_model_len: int = 2048,
                 max_window: int = 64, prefix_cache_bytes: int = 0):
        if not packs_rows(model):
            raise ValueError("the server decodes rows of different lengths in one packed forward: load the model "
                             "with attn_implementation='sdpa'")
        if max_rows < 1 or max_queue < 0:
            raise ValueError(f"max_rows must be >= 1 and max_queue >= 0, got {max_rows} and {max_queue}")
        self.model, self.tokenizer = model, tokenizer
        self.max_rows, self.max_queue, self.max_model_len, self.max_window = max_rows, max_queue, max_model_len, max_window
        self.mask_id = check_settings(model, DecodeSettings())
        # a row holds its prompt and generation (max_model_len) plus the widest input of one forward
        # prompt prefixes' keys/values kept across requests, up to prefix_cache_bytes (0: none)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.runner = ModelRunner(model, self.mask_id, max_rows, capacity=max_model_len + 2 * max_window,
                                  record_steps=False, prefix_cache=self.prefix_cache)
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self.batch = RowBatch(self.runner, max_rows, tokenizer, lock=self._cond)  # its rows' owners: Requests
        self._shared_plans: dict[DecodeSettings, RowPlan] = {}  # greedy plans, shared by equal settings
        self._ids = itertools.count()
        self._running = 0
        self._stopping = False
        self._failure: EngineFailed | None = None
        self._jobs: deque[tuple[Callable[[], object], Future]] = deque()  # run_between_steps
        self._thread = threading.Thread(target=self._run, name="wedlm-engine", daemon=True)

    # ---- called from the server's threads ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def check(self, prompt: list[int], settings: DecodeSettings) -> None:
        """Raise ValueError, naming the limit, when a request does not fit this engine."""
        if len(prompt) + settings.max_new_tokens > self.max_model_len:
            raise ValueError(f"{len(prompt)} prompt tokens + {settings.max_new_tokens} new tokens exceed the server's "
                             f"max_model_len={self.max_model_len}")
        if settings.method != AUTOREGRESSIVE and settings.window_size > self.max_window:
            raise ValueError(f"window_size {settings.window_size} exceeds the server's max_window={self.max_window}")

    @property
    def failure(self) -> EngineFailed | None:
        """Why the engine can serve nothing more, else None."""
        if self._failure is None and self._thread.ident is not None and not self._thread.is_alive() \
                and not self._stopping:
            return EngineFailed("the engine thread is no longer running")
        return self._failure

    def submit(self, request: Request) -> Request:
        """Queue ``request``; ValueError when it does not fit or suit the model, and
        :class:`QueueFull`, :class:`ShuttingDown` or :class:`EngineFailed` instead of holding it.
        """
        self.check(request.prompt, request.settings)
        settings = with_default_stops(request.settings, self.model, self.tokenizer)
        with self._cond:
            self._refuse_when_closed()
            if len(self.batch.waiting) >= self.max_queue + max(0, self.max_rows - self._running):
                self.stats.requests["refused"] += 1
                raise QueueFull(self._retry_after())
            request.id = next(self._ids)
            row = start_row(self.model, request.id, request.prompt, self._plan(settings, request.seed), self.mask_id,
                            owner=request)
            self.batch.add(row)
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop decoding ``request`` (its client went away); its row is freed at the next step."""
        with self._cond:
            request.cancelled = True
            if self.batch.cancel(request.id):
                self.stats.requests[CANCELLED] += 1

    def run_between_steps(self, job: Callable[[], object]) -> Future:
        """Run ``job`` on the engine thread between steps; its future holds its result or error."""
        future: Future = Future()
        with self._cond:
            self._refuse_when_closed()
            self._jobs.append((job, future))
            self._cond.notify()
        return future

    def _refuse_when_closed(self) -> None:
        """(Under the lock.) Raise what a new request or job gets from a closed engine."""
        failure = self.failure
        if failure is not None:
            raise failure
        if self._stopping:
            raise ShuttingDown("the server is shutting down")

    def load(self) -> tuple[int, int]:
        """``(rows decoding, requests waiting)``."""
        return self._running, len(self.batch.waiting)

    def tokens_per_second(self, seconds: float = 10.0) -> float:
        """Generated tokens per second over the last ``seconds``."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.stats.recent) if now - t <= seconds]
        return sum(n for _, n in recent) / seconds if recent else 0.0

    def shutdown(self, timeout: float | None = None) -> None:
        """Take no new requests, finish those queued and running, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _retry_after(self) -> int:
        """Seconds until the queue has room, at the pace requests finished lately."""
        now = time.perf_counter()
        finishes = [t for t in list(self.stats.finishes) if now - t <= 60.0]
        if len(finishes) < 2 or now - finishes[0] <= 0:
            return 1
        per_second = len(finishes) / (now - finishes[0])
        return max(1, min(60, math.ceil((len(self.batch.waiting) - self.max_queue + 1) / per_second)))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        """The thread: :meth:`_loop`, and on any error it did not contain, :meth:`_fail_all`."""
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - reported to every client, then the thread ends
            log.exception("the serving engine stopped on an error; every request fails")
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        failure = EngineFailed(f"the serving engine stopped: {type(error).__name__}: {error}")
        failure.__cause__ = error
        with self._cond:
            self._failure = failure
            doomed = [row.owner for row in self.batch.clear()]
            jobs = [future for _, future in self._jobs]
            self._jobs.clear()
            self._running = 0
            self.stats.requests[FAILED] += len(doomed)
        for request in doomed:
            self._deliver(request, failure)
        for future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(failure)

    def _loop(self) -> None:
        with torch.inference_mode(), self.runner:
            while self._wait_for_work():
                self._run_jobs()
                if self.batch:
                    self._step()

    def _wait_for_work(self) -> bool:
        """Block while there is nothing to do; False once shutting down with nothing left."""
        with self._cond:
            while not self.batch and not self._jobs:
                if self._stopping:
                    return False
                self._cond.wait()
            return True

    def _run_jobs(self) -> None:
        """The jobs queued before this step (:meth:`run_between_steps`); later ones wait for the next."""
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
        for job, future in jobs:
            if future.set_running_or_notify_cancel():  # False: its request has gone
                try:
                    future.set_result(job())
                except Exception as error:  # noqa: BLE001 - the job's own request fails, the engine goes on
                    future.set_exception(error)

    def _plan(self, settings: DecodeSettings, seed: int | None) -> RowPlan:
        """(Under the lock.) A sampled request's own plan; greedy ones share a plan per settings."""
        if not settings.greedy:  # its own generator, so its draws do not depend on its neighbours
            seed = int(torch.randint(2**62, (1,))) if seed is None else seed
            return RowPlan(settings, self.tokenizer, torch.Generator(device=self.model.device).manual_seed(seed))
        plan = self._shared_plans.get(settings)
        if plan is None:
            if len(self._shared_plans) >= 256:
                self._shared_plans.clear()
            plan = self._shared_plans[settings] = RowPlan(settings, self.tokenizer)
        return plan

    def _step(self) -> None:
        # a failing forward stops the engine (:meth:`_run`): the device or the cache may be left in
        # any state, so no later step could be trusted (vLLM's engine is dead after one too)
        ended = self.batch.step()
        live = self.batch.live  # the rows of this step's forward, those that finished in it included
        now = time.perf_counter()
        events: list[tuple[RowState, Request, Progress]] = []
        made = 0
        for row in live:
            request = row.owner
            made += len(row.emitted) - request.counted
            request.counted = len(row.emitted)
            result = row_result(row, now - request.submitted, self.tokenizer) if row.finished else None
            settled = result.token_ids if result else self._settled(row)
            if len(settled) == request.sent and result is None:
                continue
            events.append((row, request, Progress(settled[request.sent:], row.forwards, result)))
            request.sent = len(settled)
        with self._cond:  # counted before the events go out: a client that has its reply sees it counted
            stats = self.stats
            self._running = self.batch.running()
            stats.requests[CANCELLED] += sum(row.stop_reason == CANCELLED for row in ended)
            if live:
                stats.forwards += 1
                stats.row_forwards += len(live)
                stats.tokens += made
                stats.recent.append((now, made))
            for row, _, _ in events:
                if row.finished:
                    stats.requests["finished"] += 1
                    stats.finishes.append(now)
        for row, request, event in events:
            if not self._deliver(request, event):
                row.stop_reason = row.stop_reason or FAILED
                self._count(FAILED)
                if event.result is not None:
                    self._count("finished", -1)

    def _count(self, status: str, n: int = 1) -> None:
        with self._cond:
            self.stats.requests[status] += n

    def _settled(self, row: RowState) -> list[int]:
        """The row's tokens that can no longer change: those committed and the run its next forward
        commits, up to a stop token (a live row's run holds no stop string).
        """
        return row.emitted + row.committable(row.plan.policy.commit_count(row))

    def _deliver(self, request: Request, event: Progress | BaseException) -> bool:
        try:
            request.on_event(event)
            return True
        except Exception:  # noqa: BLE001 - a failing client fails its own request only
            log.exception("request %d: its event handler failed; the request is dropped", request.id)
            return False
