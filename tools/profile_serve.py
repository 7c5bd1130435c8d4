#!/usr/bin/env python
"""Where the serving engine's time goes, per step, at each concurrency: the table issue 75 asks for first.

    python tools/profile_serve.py --model HF_DIR [--method ar] [--concurrency 1,16] [--dtype bf16]

The server's engine (:class:`~megatron_wedlm.serving.engine.ServingEngine`, as ``inference/serve.py``
builds it) decodes ``--prompts`` chat prompts of the model's domain (``tools/bench_serve.py``'s
workload) to ``--max-tokens`` each (no stop token), ``c`` requests in flight, each submitted as the last one ends (in-process callbacks:
no HTTP). Timers wrap the engine's parts on its thread, so each phase is wall time on that
thread, summed over the run and divided by its steps:

* model forward: the transformer body and the output layer;
* inputs: the rest of ``ModelRunner.forward`` (token, position and packing tensors, the logits' mask);
* cache: ``ModelRunner.advance`` (commit lengths, move rows, prefix-cache copies);
* sampling: the fill rule over the logits (``batch._choose``);
* commit: the rest of ``decode_step`` (filling windows, committing runs, stop tokens and strings);
* detokenize: the settled tokens and results of each row (``_settled``, ``row_result``);
* events: handing each request its progress (``_deliver``);
* engine: the rest of a step (counters, the lock); idle: the thread outside steps.

The end-to-end tokens/s through HTTP (``tools/bench_vllm.py``, ``tools/bench_serve.py``) over
this in-process figure is what the HTTP server and its event loop cost.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import ROOT, build_workload, model_len  # noqa: E402 - the serving benchmark's workload

PHASES = ("model forward", "inputs", "cache", "sampling", "commit", "detokenize", "events", "engine")


class Timers:
    """Wall seconds per name, for calls on one thread (the engine's); nested names are summed apart."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def build_engine(model_dir: Path, dtype: str, rows: int, length: int):
    from megatron_wedlm.decoding.inputs import load_checkpoint
    from megatron_wedlm.serving.engine import ServingEngine

    model, tokenizer = load_checkpoint(model_dir, device="cpu", dtype=dtype)
    return ServingEngine(model, tokenizer, max_rows=rows, max_queue=64, max_model_len=length), tokenizer


def instrument(engine) -> Timers:
    import megatron_wedlm.decoding.batch as batch_module
    import megatron_wedlm.serving.engine as engine_module

    timers = Timers()
    runner = engine.runner
    timers.wrap(runner, "body", "body")
    timers.wrap(runner, "head", "head")
    timers.wrap(runner, "forward", "runner.forward")
    timers.wrap(runner, "advance", "cache")
    timers.wrap(batch_module, "_choose", "sampling")
    timers.wrap(batch_module, "decode_step", "decode_step")
    timers.wrap(engine, "_settled", "settled")
    timers.wrap(engine_module, "row_result", "row_result")
    timers.wrap(engine, "_deliver", "events")
    timers.wrap(engine, "_step", "step")
    return timers


def phases(timers: Timers) -> dict[str, float]:
    s = timers.seconds
    model = s["body"] + s["head"]
    return {"model forward": model, "inputs": s["runner.forward"] - model, "cache": s["cache"],
            "sampling": s["sampling"], "commit": s["decode_step"] - s["runner.forward"] - s["sampling"],
            "detokenize": s["settled"] + s["row_result"], "events": s["events"],
            "engine": s["step"] - s["cache"] - s["decode_step"] - s["settled"] - s["row_result"] - s["events"]}


def run(engine, prompts: list[list[int]], settings, concurrency: int) -> tuple[float, int]:
    """Every prompt decoded, ``concurrency`` in flight; ``(wall seconds, tokens)``."""
    from megatron_wedlm.serving.engine import Request

    done = threading.Semaphore(0)
    tokens = [0]
    pending = iter(prompts)
    lock = threading.Lock()

    def submit_next() -> None:
        with lock:
            prompt = next(pending, None)
        if prompt is not None:
            engine.submit(Request(prompt, settings, on_event))

    def on_event(event) -> None:
        if isinstance(event, BaseException):
            raise event
        if event.result is not None:
            tokens[0] += len(event.result.token_ids)
            done.release()
            submit_next()

    start = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    for _ in prompts:
        if not done.acquire(timeout=900):
            raise TimeoutError("a request did not finish in 900 s")
    return time.perf_counter() - start, tokens[0]


def main(argv: list[str] | None = None) -> int:
    from megatron_wedlm.decoding.inputs import encode_prompt
    from megatron_wedlm.decoding.settings import DecodeSettings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="an HF directory with a mask token (a WeDLM export)")
    p.add_argument("--method", default="ar", choices=["ar", "streaming", "blockwise"])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    w = build_workload(args.model, args.prompts, args.max_tokens)
    engine, tokenizer = build_engine(args.model, args.dtype, max(concurrency), model_len(args.model, w, []))
    prompts = [encode_prompt(tokenizer, text, w.chat) for text in w.prompts]
    settings = DecodeSettings(method=args.method, max_new_tokens=args.max_tokens,
                              window_size=w.decoding["window_size"], entropy_threshold=w.decoding["entropy_threshold"],
                              distance_penalty=w.decoding["distance_penalty"],
                              stop_token_ids=())  # every reply max_tokens long, as bench_vllm.py's ignore_eos
    timers = instrument(engine)
    engine.start()
    try:
        run(engine, prompts[: max(concurrency)], settings, max(concurrency))  # warm-up
        print(f"{args.model} ({args.dtype}), {args.method}, {len(prompts)} chat prompts, max_tokens {args.max_tokens}; "
              f"ms per step on the engine thread (share of the run's wall time)")
        print("| c | tok/s | steps | rows/step | " + " | ".join(PHASES) + " | idle |")
        print("|---" * (len(PHASES) + 5) + "|")
        for c in concurrency:
            timers.reset()
            rows_before = engine.stats.row_forwards
            wall, tokens = run(engine, prompts, settings, c)
            steps = timers.calls["step"]
            split = phases(timers)
            busy = timers.seconds["step"]
            cells = [f"{1e3 * split[name] / steps:.2f} ({split[name] / wall:.0%})" for name in PHASES]
            rows = (engine.stats.row_forwards - rows_before) / max(1, steps)
            print(f"| {c} | {tokens / wall:.1f} | {steps} | {rows:.1f} | " + " | ".join(cells)
                  + f" | {1e3 * (wall - busy) / steps:.2f} ({(wall - busy) / wall:.0%}) |", flush=True)
    finally:
        engine.shutdown(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
