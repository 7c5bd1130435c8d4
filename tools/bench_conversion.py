#!/usr/bin/env python
"""Peak memory of checkpoint conversion: streaming (the project's) vs load-everything, side by side.

    python tools/bench_conversion.py [--hidden 2048 --layers 16 --ffn 8192 --vocab 32000] [--workdir DIR]

Writes a random Qwen2-shaped bf16 checkpoint (~1.1B parameters, ~2.3 GB with the defaults)
straight to safetensors, then runs each conversion in a fresh process and reports its peak
resident memory (``ru_maxrss``) as a multiple of the model's bytes:

* ``hf-to-megatron``  streaming: HF tensors read one at a time into a Megatron model built
  without random init, then ``dist_checkpointing.save``.
* ``hf-to-megatron (naive)``: every HF shard loaded first (``safetensors.load_file``), then the
  same model fill and save -- what converting from an in-memory ``state_dict`` costs.
* ``megatron-to-hf``  streaming: one layer of one tensor at a time from torch_dist, written
  shard by shard (default 2GB shards, and 500MB shards: a shard is buffered before writing).
* ``megatron-to-hf (naive)``: the Megatron model loaded whole, the full HF state dict built
  in memory, then written.

``after imports`` is the process's memory before it touched any weight (Python, torch,
Megatron, transformers), reported so the ratio can be read both with and without it.
dist_checkpointing writes from forked helper processes that share the parent's pages
copy-on-write; their peak is printed separately and not added.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("hf-to-megatron", "hf-to-megatron-naive", "megatron-to-hf", "megatron-to-hf-500MB", "megatron-to-hf-naive")


def _peak_rss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# --------------------------------------------------------------------------------------------
# The toy checkpoint
# --------------------------------------------------------------------------------------------


def write_toy_checkpoint(
    directory: Path, hidden: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int
) -> int:
    """Random bf16 Qwen2 weights written tensor by tensor; returns the model's bytes."""
    import torch
    from transformers import Qwen2Config

    from megatron_wedlm.conversion.hf_checkpoint import ShardedSafetensorsWriter
    from megatron_wedlm.conversion.mapping import all_hf_names, global_rules, hf_shapes, layer_rules
    from megatron_wedlm.model.hf_config import model_args_from_hf_config
    from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False, dtype="bfloat16",
    )
    args = model_args_from_hf_config(config.to_dict())
    shapes = {}
    for rule in global_rules(args):
        shapes.update(zip(rule.hf_names(None), hf_shapes(rule, args)))
    for layer in range(layers):
        for rule in layer_rules(args):
            shapes.update(zip(rule.hf_names(layer), hf_shapes(rule, args)))
    assert set(shapes) == set(all_hf_names(args))
    writer = ShardedSafetensorsWriter(directory, 2 * 10**9)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    config.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return writer.total_bytes


# --------------------------------------------------------------------------------------------
# Phases (each runs in its own process)
# --------------------------------------------------------------------------------------------


def _naive_hf_to_megatron(hf_dir: Path, out: Path) -> None:
    from safetensors.torch import load_file

    from megatron_wedlm.conversion.mapping import to_megatron
    from megatron_wedlm.conversion.megatron_checkpoint import (
        build_conversion_model, fill_model, megatron_process_group, save_megatron_checkpoint,
    )
    from megatron_wedlm.model.hf_config import model_args_from_hf_config, save_model_args

    args = model_args_from_hf_config(json.loads((hf_dir / "config.json").read_text()), mask_token_id=2)
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))  # the whole HF checkpoint in memory

    def source(rule, layer, expert=None):  # the same conversion math as the streaming path
        return to_megatron(rule, [state[name] for name in rule.hf_names(layer, expert)], args)

    with megatron_process_group():
        model = build_conversion_model(args)
        fill_model(model, args, source)
        save_megatron_checkpoint(model, out)
    save_model_args(args, out)


def _naive_megatron_to_hf(megatron_dir: Path, out: Path) -> None:
    from safetensors.torch import save_file

    from megatron_wedlm.conversion.mapping import EMBEDDING, FINAL_NORM, OUTPUT_LAYER, layer_rules, to_hf
    from megatron_wedlm.conversion.megatron_checkpoint import (
        build_conversion_model, load_megatron_weights, megatron_process_group,
    )
    from megatron_wedlm.model.hf_config import load_model_args

    args = load_model_args(megatron_dir)
    with megatron_process_group():
        model = build_conversion_model(args)
        load_megatron_weights(model, megatron_dir)  # the whole model in memory
        params = dict(model.named_parameters())
        state = {}
        for rule in (EMBEDDING, FINAL_NORM, OUTPUT_LAYER):
            state.update(zip(rule.hf_names(None), to_hf(rule, params[rule.param].detach(), args)))
        for layer in range(args.num_layers):
            for rule in layer_rules(args):
                tensor = params[f"decoder.layers.{layer}.{rule.param}"].detach()
                state.update(zip(rule.hf_names(layer), [t.contiguous() for t in to_hf(rule, tensor, args)]))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone() if v.untyped_storage().nbytes() != v.nbytes else v for k, v in state.items()},
              str(out / "model.safetensors"))


def run_phase(phase: str, workdir: Path) -> dict:
    """Run one conversion; return peak memory numbers."""
    import torch  # noqa: F401  -- counted in the after-imports baseline

    import megatron.core  # noqa: F401
    import transformers  # noqa: F401

    from megatron_wedlm.conversion import convert_hf_to_megatron, convert_megatron_to_hf

    baseline = _current_rss_bytes()
    start = time.perf_counter()
    if phase == "hf-to-megatron":
        convert_hf_to_megatron(workdir / "hf", workdir / "megatron", overwrite=True)
    elif phase == "hf-to-megatron-naive":
        shutil.rmtree(workdir / "megatron-naive", ignore_errors=True)
        _naive_hf_to_megatron(workdir / "hf", workdir / "megatron-naive")
    elif phase == "megatron-to-hf":
        convert_megatron_to_hf(workdir / "megatron", workdir / "export", overwrite=True)
    elif phase == "megatron-to-hf-500MB":
        convert_megatron_to_hf(workdir / "megatron", workdir / "export", overwrite=True, max_shard_size="500MB")
    elif phase == "megatron-to-hf-naive":
        shutil.rmtree(workdir / "export-naive", ignore_errors=True)
        _naive_megatron_to_hf(workdir / "megatron", workdir / "export-naive")
    else:
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
    return {
        "phase": phase,
        "seconds": time.perf_counter() - start,
        "after_imports": baseline,
        "peak": _peak_rss_bytes(),
        "children_peak": _peak_rss_bytes(resource.RUSAGE_CHILDREN),
    }


def _run_in_subprocess(argv: list[str]) -> dict:
    result = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--workdir", help="keep files here (default: a temporary directory, removed)")
    parser.add_argument("--phase", choices=PHASES + ("write",), help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.phase == "write":
        size = write_toy_checkpoint(Path(opts.workdir), opts.hidden, opts.layers, opts.ffn, opts.vocab,
                                    opts.heads, opts.kv_heads)
        print(json.dumps({"model_bytes": size}))
        return
    if opts.phase:
        print(json.dumps(run_phase(opts.phase, Path(opts.workdir))))
        return

    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="wedlm-bench-conv-"))
    try:
        (workdir / "hf").mkdir(parents=True, exist_ok=True)
        shape = ["--hidden", str(opts.hidden), "--layers", str(opts.layers), "--ffn", str(opts.ffn),
                 "--vocab", str(opts.vocab), "--heads", str(opts.heads), "--kv-heads", str(opts.kv_heads)]
        model_bytes = _run_in_subprocess(["--phase", "write", "--workdir", str(workdir / "hf"), *shape])["model_bytes"]
        print(f"toy Qwen2 checkpoint: hidden {opts.hidden}, {opts.layers} layers, ffn {opts.ffn}, vocab {opts.vocab}: "
              f"{model_bytes / 2 / 1e9:.2f}B parameters, {model_bytes / 2**30:.2f} GiB bf16")
        gib = 2**30
        print(f"{'conversion':<24}{'peak RSS':>10}{'peak/model':>12}{'(peak-imports)/model':>22}"
              f"{'after imports':>15}{'writer children':>17}{'time':>8}")
        for phase in PHASES:
            r = _run_in_subprocess(["--phase", phase, "--workdir", str(workdir)])
            print(f"{phase:<24}{r['peak'] / gib:>8.2f}Gi{r['peak'] / model_bytes:>12.2f}"
                  f"{(r['peak'] - r['after_imports']) / model_bytes:>22.2f}{r['after_imports'] / gib:>13.2f}Gi"
                  f"{r['children_peak'] / gib:>15.2f}Gi{r['seconds']:>7.0f}s", flush=True)
    finally:
        if not opts.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
