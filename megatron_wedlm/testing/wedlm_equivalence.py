"""Does a parallel layout train the WeDLM model exactly as one process does? Workers that answer.

The recipe of :mod:`.gpt_equivalence` on training's own path: ``build_model_chunks``, ``wrap_ddp``
and the Megatron engine's ``forward_backward_step``/``forward_only_step``, gradients read from
DDP's ``main_grad`` after ``finalize_model_grads`` (what an optimizer consumes).
:func:`reference_worker` saves weights and a step's losses and gradients at TP=PP=1;
:func:`layouts_worker` runs several layouts in one launch, checks that evaluation leaves the
gradients as they were, and reassembles them; :func:`optimizer_worker` runs a few Adam steps.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_wedlm.data import RowFormat, build_dual_stream_batch, stack_dual_stream_batches
from megatron_wedlm.model import global_loss_normalizer, reduce_loss_reports
from megatron_wedlm.model.hf_config import ModelArgs
from megatron_wedlm.model.moe import take_router_losses
from megatron_wedlm.training.megatron_engine import forward_backward_step, forward_only_step
from megatron_wedlm.training.objective import Objective
from megatron_wedlm.training.optimization import wrap_ddp

from .gpt_equivalence import TinyShape, gather_full, grads_into_params, init_layout, load_sharded, save_sharded

if TYPE_CHECKING:
    from megatron_wedlm.model.wedlm_model import BuildSettings, ModelChunks


@dataclass
class TinyWeDLMSpec(TinyShape):
    """A small Qwen-shaped WeDLM model and the dual-stream data it is tested on; the defaults switch
    on every feature at once (GQA, QK-norm, QKV bias, rope base, packing, SFT prompt, padding)."""

    mask_token_id: int = 127
    qk_layernorm: bool = True
    add_qkv_bias: bool = True
    tied_embeddings: bool = False
    rotary_base: float = 1000.0
    attention_backend: str = "dense"
    dense_tile_size: int = 16  # small, so the dense backend's empty-tile skipping is exercised
    block_size: int = 4
    row_length: int = 64  # physical slots per row (2L per document + padding)
    micro_batch_size: int = 2
    global_microbatches: int = 2  # over all data-parallel ranks
    ar_weight: float = 1.0
    mlm_weighting: str = "inverse_ratio"
    seed: int = 1234
    doc_lengths: list = field(default_factory=lambda: [[13, 11], [20, 12], [9, 7, 14], [32]])
    prompt_lengths: list = field(default_factory=lambda: [[3, 0], [0, 0], [0, 4, 0], [5]])
    num_experts: int | None = None  # set: a Qwen3-MoE (top-moe_topk of num_experts experts per layer)
    moe_topk: int = 2
    moe_ffn_hidden_size: int = 32
    moe_aux_loss_coeff: float = 1e-2  # larger than training's 1e-3 so its gradient shows in every check
    moe_z_loss_coeff: float | None = None  # Megatron averages it per SP/CP shard: exact at EP x PP only

    def to_dict(self) -> dict:
        return asdict(self)

    def model_args(self) -> ModelArgs:
        """The model description of this spec (rows of ``row_length`` slots hold positions below it)."""
        architecture = "qwen3" if self.qk_layernorm else "qwen2" if self.add_qkv_bias else "llama"
        moe = {}
        if self.num_experts is not None:
            architecture = "qwen3_moe"
            moe = dict(num_experts=self.num_experts, moe_topk=self.moe_topk, moe_ffn_hidden_size=self.moe_ffn_hidden_size)
        return ModelArgs(
            **self.shape_fields(), architecture=architecture, max_position_embeddings=self.row_length,
            rope_theta=self.rotary_base, qk_layernorm=self.qk_layernorm, add_qkv_bias=self.add_qkv_bias,
            tie_word_embeddings=self.tied_embeddings, mask_token_id=self.mask_token_id, **moe,
        )

    def build_settings(self, sequence_parallel: bool = False, recompute: str | None = None) -> BuildSettings:
        """How a layout builds this spec's model: fp32 on CPU, init std 0.05 (larger than training's
        0.02, so that gradient differences between layouts stand out of rounding)."""
        from megatron_wedlm.model.moe import MoESettings
        from megatron_wedlm.model.wedlm_model import BuildSettings  # imports Megatron-Core

        options = {"tile_size": self.dense_tile_size} if self.attention_backend == "dense" else {}
        return BuildSettings(
            sequence_parallel=sequence_parallel, recompute=recompute or "none", init_method_std=0.05,
            attention_backend=self.attention_backend, backend_options=options,
            moe=MoESettings(aux_loss_coeff=self.moe_aux_loss_coeff, z_loss_coeff=self.moe_z_loss_coeff),
        )


def make_global_batch(spec: TinyWeDLMSpec, step: int = 0) -> list:
    """``global_microbatches`` stacked dual-stream micro-batches ``[micro_batch_size, row_length]``."""
    g = torch.Generator().manual_seed(spec.seed * 1000 + step)
    batches = []
    row = 0
    for _ in range(spec.global_microbatches):
        rows = []
        for _ in range(spec.micro_batch_size):
            lengths = spec.doc_lengths[row % len(spec.doc_lengths)]
            prompts = spec.prompt_lengths[row % len(spec.prompt_lengths)]
            docs = [torch.randint(0, spec.mask_token_id, (n,), generator=g) for n in lengths]
            rows.append(build_dual_stream_batch(docs, RowFormat(spec.block_size, spec.mask_token_id), g,
                                                prompt_lengths=prompts))
            row += 1
        batches.append(stack_dual_stream_batches(rows, pad_to=spec.row_length))
    return batches


def build_model(spec: TinyWeDLMSpec, sequence_parallel: bool = False, recompute: str | None = None) -> ModelChunks:
    """This rank's model chunks for the current Megatron layout, built by training's own build."""
    from megatron_wedlm.model.wedlm_model import build_model_chunks  # imports Megatron-Core

    return build_model_chunks(spec.model_args(), spec.build_settings(sequence_parallel, recompute))


def _engine_step(step_function, ddp_model: list, spec: TinyWeDLMSpec, batches: list):
    """``step_function`` (the Megatron engine's ``forward_backward_step`` or ``forward_only_step``)
    over this rank's micro-batches; the global loss summary on the last stage, None elsewhere."""
    normalizer = global_loss_normalizer(batches, spec.mlm_weighting)
    objective = Objective(ar_weight=spec.ar_weight, mlm_weighting=spec.mlm_weighting)
    reports = step_function(ddp_model, batches, normalizer, objective, spec.row_length, spec.micro_batch_size)
    router = take_router_losses(len(batches))  # collective: before any rank returns
    if reports is None:
        return None
    return {**asdict(reduce_loss_reports(reports, spec.ar_weight)), **router}


def train_step(ddp_model: list, spec: TinyWeDLMSpec, batches: list):
    """One forward/backward by the Megatron engine's own step (``ddp_model``: as ``wrap_ddp`` wraps)."""
    return _engine_step(forward_backward_step, ddp_model, spec, batches)


def eval_step(ddp_model: list, spec: TinyWeDLMSpec, batches: list):
    """The Megatron engine's forward-only evaluation, as a run's validation does it."""
    return _engine_step(forward_only_step, ddp_model, spec, batches)


EVAL_BATCH = 1  # make_global_batch's step of the evaluated batch (the training step's is 0)


def _local_microbatches(spec: TinyWeDLMSpec, step: int = 0) -> list:
    from megatron.core import parallel_state as ps

    batches = make_global_batch(spec, step)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if len(batches) % dp:
        raise ValueError(f"{len(batches)} micro-batches cannot be split over {dp} data-parallel ranks")
    per_rank = len(batches) // dp
    return batches[rank * per_rank:(rank + 1) * per_rank]


def _named_grads(model: ModelChunks) -> dict[str, torch.Tensor]:
    (chunk,) = model  # TP=PP=1: one chunk
    return {name: p.main_grad.detach().clone().float() for name, p in chunk.named_parameters()}


def reference_worker(specs: dict[str, dict], root: str) -> dict[str, dict]:
    """TP=PP=1 on one rank: save weights to ``root/<name>/weights``; loss and grads per spec."""
    out = {}
    for name, spec_dict in specs.items():
        spec = TinyWeDLMSpec(**spec_dict)
        init_layout(1, 1, spec.seed)
        model = build_model(spec)
        save_sharded(model, os.path.join(root, name, "weights"))
        ddp = wrap_ddp(model, False)
        summary = train_step(ddp, spec, _local_microbatches(spec))
        evaluation = eval_step(ddp, spec, _local_microbatches(spec, EVAL_BATCH))
        out[name] = {"summary": summary, "eval": evaluation, "grads": _named_grads(model)}
    return out


def layouts_worker(specs: dict[str, dict], root: str, layouts: list[dict]) -> dict[str, dict]:
    """Run each layout ``{name, spec, tp, pp, vpp, cp, ep, etp, sp, recompute}`` on this launch's ranks; per
    layout, this rank's loss summary (None off the last stage) and, on rank 0, the full gradients."""
    out = {}
    for layout in layouts:
        spec = TinyWeDLMSpec(**specs[layout["spec"]])
        tp, pp, sp = layout.get("tp", 1), layout.get("pp", 1), layout.get("sp", False)
        init_layout(tp, pp, spec.seed, sp, cp=layout.get("cp", 1), vpp=layout.get("vpp"), ep=layout.get("ep", 1),
                    etp=layout.get("etp"))
        model = build_model(spec, sequence_parallel=sp, recompute=layout.get("recompute"))
        load_sharded(model, os.path.join(root, layout["spec"], "weights"))
        ddp = wrap_ddp(model, False)
        summary = train_step(ddp, spec, _local_microbatches(spec))
        grads = [p.main_grad.clone() for chunk in model for p in chunk.parameters()]
        evaluation = eval_step(ddp, spec, _local_microbatches(spec, EVAL_BATCH))
        kept = all(torch.equal(g, p.main_grad) for g, p in zip(grads, (p for c in model for p in c.parameters())))
        grads_dir = os.path.join(root, "grads-" + layout["name"])
        for chunk in model:
            grads_into_params(chunk, use_main_grad=True)
        save_sharded(model, grads_dir)
        dist.barrier()
        full = gather_full(lambda: build_model(spec)[0], spec.seed, grads_dir)
        out[layout["name"]] = {"summary": summary, "eval": evaluation, "eval_kept_grads": kept,
                               "grads": full if dist.get_rank() == 0 else None}
        dist.barrier()
    return out


def optimizer_worker(spec_dict: dict, weights_dir: str, distributed_optimizer: bool, steps: int) -> list:
    """``steps`` Adam steps at TP=PP=1 with DP = world size; the global loss of every step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    spec = TinyWeDLMSpec(**spec_dict)
    init_layout(1, 1, spec.seed)
    model = build_model(spec)
    load_sharded(model, weights_dir)
    ddp = wrap_ddp(model, distributed_optimizer)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-3, weight_decay=0.01, clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32,
        ),
        ddp,
    )
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        summary = train_step(ddp, spec, _local_microbatches(spec, step % 2))
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (grad norm {grad_norm})")
        losses.append({**summary, "grad_norm": float(grad_norm)})
    return losses
