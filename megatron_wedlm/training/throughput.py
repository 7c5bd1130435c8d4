"""Throughput as Megatron-LM reports it: model FLOPs per step, TFLOP/s and MFU per device, peak memory.

FLOPs are counted from what the model processes, the same way for WeDLM and AR rows
(``docs/training.md``, "Throughput", has the formula): every real slot through every projection,
the MLP (a MoE token: its router and its ``moe_topk`` experts, not all of them) and the output
layer, plus ``12 * L * q`` per (query, key) pair the attention rule allows
(:func:`~megatron_wedlm.data.attention_rule.allowed_keys_per_query`). A WeDLM row of S slots holds
S/2 data tokens, so tokens/s and FLOPs are both logged. Recomputation is not counted (model FLOPs).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from megatron_wedlm.data.attention_rule import count_allowed_pairs

if TYPE_CHECKING:
    from megatron_wedlm.data.dual_stream import DualStreamBatch
    from megatron_wedlm.model.hf_config import ModelArgs

__all__ = ["ModelShape", "PEAK_TFLOPS", "batch_flops", "default_peak_tflops", "max_over_ranks", "peak_memory_gib",
           "peak_tflops_of"]

# Dense bf16 tensor-core peaks per device, TFLOP/s (vendor data sheets; SXM parts unless named).
PEAK_TFLOPS = {
    "A100": 312.0,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "H200": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "L40S": 362.1,
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the FLOP count needs."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # the SwiGLU width a token goes through (MoE: moe_topk experts x their width)
    query_width: int  # attention heads x head dim
    key_value_width: int  # query groups x head dim
    output_rows: int  # rows of the output layer the model computes (Megatron: the padded vocabulary)
    router_width: int = 0  # MoE: the experts each token's router scores

    @classmethod
    def from_model_args(cls, args: ModelArgs, output_rows: int | None = None) -> "ModelShape":
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.moe_topk * args.moe_ffn_hidden_size if args.is_moe else args.ffn_hidden_size,
            query_width=args.num_attention_heads * args.head_dim,
            key_value_width=args.num_query_groups * args.head_dim,
            output_rows=args.padded_vocab_size if output_rows is None else output_rows,
            router_width=args.num_experts if args.is_moe else 0,
        )

    def flops_per_slot(self) -> int:
        """Forward + backward FLOPs of the token-wise parts (projections, router, SwiGLU MLP, output layer)."""
        h, q, kv = self.hidden_size, self.query_width, self.key_value_width
        per_layer = h * (q + 2 * kv) + q * h + h * self.router_width + 3 * h * self.ffn_hidden_size
        return 6 * (self.num_layers * per_layer + h * self.output_rows)

    def flops_per_pair(self) -> int:
        """Forward + backward FLOPs of one allowed (query, key) pair: QK^T and the weighted sum of V."""
        return 12 * self.num_layers * self.query_width


def batch_flops(shape: ModelShape, batches: Sequence[DualStreamBatch]) -> float:
    """Model FLOPs (forward + backward) of training on ``batches``."""
    slots = sum(int((~batch.is_padding).sum()) for batch in batches)
    pairs = sum(int(count_allowed_pairs(batch.attention_metadata()).sum()) for batch in batches)
    return float(shape.flops_per_slot() * slots + shape.flops_per_pair() * pairs)


def default_peak_tflops(device: torch.device, bf16: bool) -> float | None:
    """The bf16 dense peak of a known GPU (None on CPU, for fp32 runs and for unknown devices)."""
    if device.type != "cuda" or not bf16:
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


def peak_tflops_of(device_name: str) -> float | None:
    """The :data:`PEAK_TFLOPS` entry a CUDA device name matches, longest name first ("H100 PCIe"
    before "H100", "GH200" before "H200"); None for a device not in the table."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_TFLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA max allocated on a GPU, peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """Each of ``values``, the largest over all ranks (one all-reduce for all of them)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
