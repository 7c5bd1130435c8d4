#!/usr/bin/env python
"""Serve a WeDLM checkpoint behind the OpenAI API, with continuous batching.

Example::

    python inference/serve.py --model /ckpt/wedlm-8b-instruct --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

``--model`` is an HF export, a training checkpoint (``iter_N``) or a run directory (its newest
complete checkpoint), as for ``evaluate.py``. Endpoints: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true``: one server-sent event per forward's commit),
``/health``, ``/metrics`` (Prometheus) and a page at ``/`` that shows each forward's commit.
Per request: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, and
WeDLM's ``method`` (streaming, blockwise, ar), ``window_size``, ``entropy_threshold``,
``distance_penalty``; the model's ``generation_config.json`` gives the defaults.

Up to ``--max-rows`` requests are decoded together; ``--max-queue`` more wait, and beyond that a
request is answered 429 with ``Retry-After``. Prompts that start alike (a system prompt, few-shot
examples, a chat's earlier turns) reuse the keys/values of their common prefix, up to
``--prefix-cache-gib`` (``--no-prefix-cache``: off). SIGTERM (or Ctrl-C) finishes the requests in flight,
then exits. ``--api-key`` (or ``$WEDLM_API_KEY``) makes ``/v1/*`` require ``Authorization: Bearer
KEY``; a request naming another model than ``--served-model-name`` is answered 404. If the engine
fails, every request in it gets an error naming the cause and ``/health`` answers 503: restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_wedlm.decoding.inputs import DTYPES, eos_token_ids
from megatron_wedlm.decoding.options import describe, resolve_decoding_settings
from megatron_wedlm.serving.app import ServedModel, build_app
from megatron_wedlm.serving.engine import ServingEngine
from megatron_wedlm.training.hf_export import load_checkpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF checkpoint directory, or a Megatron training checkpoint (iter_N) or run directory")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the directory's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-rows", type=int, default=16, help="requests decoded together (the batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; more are answered 429")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generation a request may hold; sizes the KV cache "
                        "(default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--max-window", type=int, default=64, help="the widest window_size a request may ask for")
    p.add_argument("--prefix-cache-gib", type=float, default=1.0,
                   help="memory for prompt prefixes' keys/values kept across requests, on the model's device "
                        "(automatic prefix caching, docs/serving.md); least recently used blocks are evicted")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt from its first token")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="max_tokens of a request that gives none (capped by the context left)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--api-key", default=os.environ.get("WEDLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $WEDLM_API_KEY; unset: open). "
                        "A server on a cluster node is reachable by everyone on its network")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import uvicorn  # the serve extra: pip install -e ".[serve]"

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, tokenizer = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    defaults, sources = resolve_decoding_settings({}, args.model)
    print(f"decoding defaults: {describe(defaults, sources)}", file=sys.stderr)
    positions = getattr(model.config, "max_position_embeddings", None) or 4096
    max_model_len = args.max_model_len or min(positions, 4096)
    if max_model_len > positions:
        raise SystemExit(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings={positions}")
    prefix_cache_bytes = 0 if args.no_prefix_cache else max(0, int(args.prefix_cache_gib * 2**30))
    print(f"prefix cache: {f'{args.prefix_cache_gib:g} GiB' if prefix_cache_bytes else 'off'}", file=sys.stderr)
    engine = ServingEngine(model, tokenizer, max_rows=args.max_rows, max_queue=args.max_queue,
                           max_model_len=max_model_len, max_window=args.max_window,
                           prefix_cache_bytes=prefix_cache_bytes)
    served = ServedModel(name=args.served_model_name or Path(args.model).resolve().name, tokenizer=tokenizer,
                         defaults=defaults, stop_token_ids=eos_token_ids(model, tokenizer),
                         default_max_tokens=args.max_tokens)
    uvicorn.run(build_app(engine, served, api_key=args.api_key), host=args.host, port=args.port,
                log_level=args.log_level)


if __name__ == "__main__":
    main()
