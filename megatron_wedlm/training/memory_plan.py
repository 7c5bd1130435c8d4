"""What a run holds per GPU, from its config alone: the figures ``--dry-run`` prints.

``plan_run(cfg, world_size)`` resolves the model and checks the layout as training does, then
counts without building anything (``q`` = heads x head dim ``d``, ``k`` = groups x ``d``, ``V`` the
padded vocabulary, ``F`` the MLP width, ``t`` = tp, ``u`` bytes per value, ``s`` the rank's slots
``seq_length / cp``, ``b`` the micro-batch):

* **Parameters** per layer ``2h + h(q + 2k) + qh + 3hF`` (``+ q + 2k`` with QKV bias, ``+ 2d``
  with q/k norms), the final norm ``h``, the embedding ``Vh`` and an untied output layer ``Vh``.
  A MoE layer (``E`` experts of width ``I``, top ``K``) has a router ``Eh`` and ``E`` SwiGLU
  experts ``3hI`` in place of ``3hF``; a token goes through ``K`` of them (the active parameters).
* **Weights, gradients, optimizer state** of the busiest rank (:func:`rank_parameters`; the output
  layer sits on the last stage also when tied and ``pp > 1``; a rank holds ``E / ep`` experts per
  layer, each split over ``etp``, and the whole router), in the bytes the Megatron engine
  allocates: weights 2 (bf16) or 4; gradients 4; Adam 12 with bf16 (master + two moments), 8 with
  fp32, SGD one moment fewer; split by the distributed optimizer over ``dp x cp``, the experts'
  over their data-parallel ranks ``world / (pp x ep x etp)``.
* **Activations** per micro-batch and layer (:func:`layer_activation_bytes`), counted tensor by
  tensor as Korthikanti et al. (2022, §4) count a GPT-3 layer, for this layer (RMSNorm, GQA,
  SwiGLU, no dropout, no ``s x s`` matrix in the kernel)::

      u s b [4h / t_sp  +  (3q + 3k + 4F) / t]  +  4 s b a / t  (+ s S b with the dense backend)

  (``t_sp``: ``t`` with sequence parallelism, else 1; ``4 s b a``: the fp32 log-sum-exp; the dense
  backend's boolean mask over the whole row ``S``). CP adds the gathered keys and values
  ``2 u S b k / t``; ``recompute=selective`` drops the log-sum-exp and mask; ``recompute=full``
  keeps each chunk's input ``u s b h / t_sp`` and one chunk's full activations. A MoE layer
  replaces the MLP's ``u s b 4F / t`` by the router's ``9 E`` bytes per token (fp32 routing and
  balancing-loss scores, the routing map) and, per routed copy of a token, the expert's input and
  SwiGLU (``u (h + 5 I / e)``, ``e`` = etp: the copies are gathered over the etp ranks)::

      s b / t_sp [9 E + u K e c (h + 5 I / e)]

  (``c``: the capacity factor, the most a rank's experts take over the even share; dropless: 1,
  which assumes even routing).
* **At the peak**, stage ``r`` holds ``min(pp - r, m)`` micro-batches under 1F1B, and Megatron's
  warm-up count ``2 (pp - r - 1) + (v - 1) pp + 1`` chunks of ``1/v`` of its layers when
  interleaved. The last stage adds one micro-batch's logits over its labelled slots ``N``:
  ``6 N V / t`` in bf16 (logits and the fp32 softmax), ``4 N V / t`` in fp32; ``N`` is ``3/4 s`` for
  WeDLM with the AR loss, ``1/4 s`` without, ``s`` for AR (an upper bound for SFT).

Not counted: the CUDA context, communication and allocator buffers, one operation's transients.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_wedlm.config.schema import ConfigError, TrainConfig, training_data_dir, validate_layout
from megatron_wedlm.data.manifest import MANIFEST_FILE
from megatron_wedlm.model.attention_backends import resolve_attention_backend
from megatron_wedlm.model.hf_config import ModelArgs, find_model_args_file, load_model_args

from .model_setup import resolve_model_args
from .run_data import read_run_manifest

__all__ = [
    "Layout", "MemoryPerGPU", "ParameterCount", "RankParameters", "RunPlan", "describe_plan",
    "layer_activation_bytes", "layer_parameters", "parameter_count", "plan_run", "rank_parameters",
]

GIB = 1024**3
_GRAD_BYTES = 4  # Megatron DDP with grad_reduce_in_fp32=True (training/optimization.py: wrap_ddp)
_MOMENTS = {"adam": 2, "sgd": 1}  # optimizer state tensors per parameter (Megatron's SGD has momentum)
# bytes a MoE router keeps per token and expert: fp32 routing scores, fp32 balancing-loss scores, the routing map
_ROUTER_BYTES = 4 + 4 + 1
# values an expert's SwiGLU keeps per routed token and unit of its width: fc1's output (2), silu's
# output, the gated product (kept by the multiplication with the routing weight), fc2's input
_EXPERT_SWIGLU_VALUES = 5


@dataclass(frozen=True)
class ParameterCount:
    """The model's parameters: ``embedding`` = input embedding (+ untied output layer); of the
    non-embedding ones, ``experts`` are MoE experts' weights, ``active_experts`` those one token uses."""

    embedding: int
    non_embedding: int
    experts: int = 0
    active_experts: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding

    @property
    def active(self) -> int:
        """Parameters one token goes through: all but the experts it is not routed to."""
        return self.total - self.experts + self.active_experts


@dataclass(frozen=True)
class RankParameters:
    """Parameters on one rank, apart by how they are reduced: ``dense`` over dp x cp, ``experts``
    over the expert-data-parallel ranks (their optimizer state is split over those groups)."""

    dense: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` processes split the run and a step's batch."""

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    virtual_pp: int | None
    ep: int  # expert parallel: each MoE layer's experts split over ep ranks
    etp: int  # tensor parallel inside each expert
    micro_batch_size: int  # rows per micro-batch
    global_batch_size: int  # rows per step
    microbatches_per_rank: int  # gradient accumulation steps: global / (micro x dp)
    tokens_per_row: int  # document tokens a row holds (a WeDLM row: seq_length / 2)
    seq_length: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.tokens_per_row

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard (Megatron's expert data parallel): world / (pp x ep x etp)."""
        return self.world_size // (self.pp * self.ep * self.etp)


@dataclass(frozen=True)
class MemoryPerGPU:
    """Bytes held by the busiest rank (``stage``: ``first``, ``last`` or ``only``)."""

    stage: str
    parameters: int  # parameters on that rank
    expert_parameters: int  # of them, MoE experts' weights
    weights: int
    gradients: int
    optimizer: int
    layer_activations: int  # what one micro-batch keeps in that stage's layers
    microbatches_in_flight: float  # micro-batches whose layer activations the stage holds at once
    logits: int  # one micro-batch's logits and softmax (last stage)
    recompute_working: int  # the activations of one chunk while it is recomputed (recompute=full)

    @property
    def activations(self) -> int:
        """Held at the peak."""
        return int(self.microbatches_in_flight * self.layer_activations) + self.logits + self.recompute_working

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class RunPlan:
    """Everything ``--dry-run`` prints, computed by :func:`plan_run`."""

    model: ModelArgs
    model_source: str  # where the description came from, in words
    parameters: ParameterCount
    layout: Layout
    memory: MemoryPerGPU
    bf16: bool
    device: str
    attention_backend: str  # resolved for the device
    optimizer_shards: int  # ranks the dense optimizer state is split over (1: not split)
    expert_optimizer_shards: int  # ranks the experts' optimizer state is split over
    train_steps: int


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------


def _widths(args: ModelArgs) -> tuple[int, int]:
    """(query width q, key/value width k per K or V): heads x head dim, groups x head dim."""
    return args.num_attention_heads * args.head_dim, args.num_query_groups * args.head_dim


def _expert_weights(args: ModelArgs, experts: int, etp: int = 1) -> int:
    """``experts`` SwiGLU experts (fc1 ``2I x h``, fc2 ``h x I``), each split over ``etp`` ranks."""
    return experts * 3 * args.hidden_size * args.moe_ffn_hidden_size // etp


def layer_parameters(args: ModelArgs, tp: int = 1, ep: int = 1, etp: int | None = None) -> RankParameters:
    """One transformer layer's parameters on one rank: attention and a dense MLP split over ``tp``,
    norms and a MoE router replicated (each TP rank routes its own tokens), ``E / ep`` experts each
    split over ``etp`` (default ``tp``, Megatron's)."""
    h = args.hidden_size
    q, k = _widths(args)
    sharded = h * (q + 2 * k) + q * h + (q + 2 * k if args.add_qkv_bias else 0)
    replicated = 2 * h + (2 * args.head_dim if args.qk_layernorm else 0)
    if not args.is_moe:
        return RankParameters(dense=(sharded + 3 * h * args.ffn_hidden_size) // tp + replicated)
    router = args.num_experts * h
    return RankParameters(dense=sharded // tp + replicated + router,
                          experts=_expert_weights(args, args.num_experts // ep, etp or tp))


def parameter_count(args: ModelArgs) -> ParameterCount:
    """The whole model's parameters: what ``sum(p.numel())`` of the built model gives; a MoE
    token's active ones count ``moe_topk`` experts per layer."""
    rows = args.padded_vocab_size * args.hidden_size
    embedding = rows * (1 if args.tie_word_embeddings else 2)
    layer = layer_parameters(args)
    non_embedding = args.num_layers * layer.total + args.hidden_size  # + the final norm
    active = args.num_layers * _expert_weights(args, args.moe_topk) if args.is_moe else 0
    return ParameterCount(embedding=embedding, non_embedding=non_embedding, experts=args.num_layers * layer.experts,
                          active_experts=active)


def _stage_layers(args: ModelArgs, pp: int) -> int:
    return math.ceil(args.num_layers / pp)


def rank_parameters(
    args: ModelArgs, tp: int, pp: int, ep: int = 1, etp: int | None = None
) -> dict[str, RankParameters]:
    """Parameters on one rank of the first and of the last pipeline stage (``only`` when pp = 1)."""
    layer, count = layer_parameters(args, tp, ep, etp), _stage_layers(args, pp)
    rows = args.padded_vocab_size * args.hidden_size // tp
    output = rows if (not args.tie_word_embeddings or pp > 1) else 0
    dense, experts = count * layer.dense, count * layer.experts
    if pp == 1:
        return {"only": RankParameters(dense + rows + output + args.hidden_size, experts)}
    return {"first": RankParameters(dense + rows, experts),
            "last": RankParameters(dense + output + args.hidden_size, experts)}


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------


def layer_activation_bytes(
    args: ModelArgs,
    seq_length: int,
    micro_batch_size: int,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    attention_backend: str = "flex",
    bytes_per_value: int = 2,
    etp: int | None = None,
    capacity_factor: float | None = None,
) -> int:
    """Bytes one layer keeps for its backward, for one micro-batch (the module docstring's formula);
    ``recompute='full'`` is counted by :func:`plan_run` from this figure and the layer's input.
    A MoE layer's experts are counted at the even share of routed tokens (dropless), or at
    ``capacity_factor`` times it, the most a rank's experts take."""
    h, u, b = args.hidden_size, bytes_per_value, micro_batch_size
    q, k = _widths(args)
    s = seq_length // cp
    t_sp = tp if sequence_parallel else 1
    mlp = 0 if args.is_moe else 4 * args.ffn_hidden_size
    kept = u * s * b * (4 * h // t_sp + (3 * q + 3 * k + mlp) // tp)
    if args.is_moe:
        e = etp or tp
        copies = args.moe_topk * e * (capacity_factor or 1)  # per token: k experts' inputs, gathered over etp
        swiglu = _EXPERT_SWIGLU_VALUES * args.moe_ffn_hidden_size / e
        kept += int(s * b / t_sp * (_ROUTER_BYTES * args.num_experts + u * copies * (h + swiglu)))
    if cp > 1:
        kept += u * seq_length * b * 2 * k // tp  # keys and values gathered from the whole row
    if recompute != "selective":
        kept += 4 * s * b * args.num_attention_heads // tp  # fp32 log-sum-exp
        if attention_backend == "dense":
            kept += s * seq_length * b  # the boolean mask
    return kept


def _labelled_share(cfg: TrainConfig) -> float:
    """Expected share of a row's slots that carry a label (and go through the output layer)."""
    if not cfg.wedlm.enabled:
        return 1.0
    return (0.5 if cfg.wedlm.ar_weight > 0 else 0.0) + 0.25


def _microbatches_in_flight(pp: int, virtual_pp: int | None, microbatches: int, stage: int) -> float:
    """Micro-batches whose activations pipeline stage ``stage`` holds at once, in whole-stage units:
    Megatron's warm-up forwards of that stage, plus the one in its steady state."""
    if virtual_pp is None:
        return float(min(pp - stage, microbatches))
    chunks = min(2 * (pp - stage - 1) + (virtual_pp - 1) * pp + 1, microbatches * virtual_pp)
    return chunks / virtual_pp


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


def _planned_model(cfg: TrainConfig, dtype: str) -> tuple[ModelArgs, str]:
    """The model training would build, and where its description came from; needs no data (the
    vocabulary comes from the checkpoint, the config or, when here, the data's manifest)."""
    cfg = copy.deepcopy(cfg)  # model.init_from may be cleared below
    m = cfg.model
    found = find_model_args_file(m.init_from) if m.init_from is not None else None
    stored = load_model_args(found) if found is not None else None
    if found is not None:
        source = f"{found} (the config's model keys checked against it)"
    else:
        missing = [f"model.{key}" for key in ("architecture", "num_layers", "hidden_size", "ffn_hidden_size",
                                              "num_attention_heads") if getattr(m, key) is None]
        if missing:
            where = (f"model.init_from={m.init_from} has no wedlm_model.json here" if m.init_from
                     else "no model.init_from")
            raise ConfigError(f"--dry-run cannot describe the model: {where} and {', '.join(missing)} are not set; "
                              "run it where the checkpoint is, or give them as key=value")
        source = "the config's model keys"
        if m.init_from is not None:
            source += f" (model.init_from={m.init_from} is not here: not read, not checked)"
            m.init_from = None  # described as a model built from these keys
    if (Path(training_data_dir(cfg) or "") / MANIFEST_FILE).is_file():
        manifest = read_run_manifest(cfg)
    else:
        vocab = m.vocab_size if m.vocab_size is not None else (stored.vocab_size if stored else None)
        if vocab is None:
            raise ConfigError(
                "--dry-run needs the vocabulary size: model.vocab_size is not set and neither model.init_from nor "
                "the data's manifest.json is here; pass model.vocab_size=N (the checkpoint's embedding rows, "
                "e.g. 151936 for Qwen3)")
        mask = stored.mask_token_id if stored is not None and stored.mask_token_id is not None else 0
        manifest = {"mask_token_id": mask, "tokenizer_length": vocab}  # what the data would have to match
    return resolve_model_args(cfg, manifest, dtype), source


def plan_run(cfg: TrainConfig, world_size: int) -> RunPlan:
    """The plan of ``cfg`` on ``world_size`` processes; ConfigError where training would refuse
    the layout or could not describe the model. Builds nothing, touches no device."""
    from .loop import bf16_enabled  # the precision rule; imports Megatron-Core

    if cfg.trainer.backend != "megatron":
        raise ConfigError(f"--dry-run plans the Megatron engine; trainer.backend={cfg.trainer.backend!r} "
                          "(DeepSpeed ZeRO) is not planned")
    device = torch.device("cpu" if cfg.trainer.device == "cpu" else "cuda")  # auto: the GPUs the run is for
    bf16 = bf16_enabled(cfg, device)
    args, source = _planned_model(cfg, "bfloat16" if bf16 else "float32")
    dp = validate_layout(cfg, world_size)
    p, d = cfg.parallelism, cfg.data
    layout = Layout(
        world_size=world_size, tp=p.tp, pp=p.pp, cp=p.cp, dp=dp, virtual_pp=p.virtual_pp, ep=p.ep, etp=p.etp or p.tp,
        micro_batch_size=d.micro_batch_size, global_batch_size=d.global_batch_size,
        microbatches_per_rank=d.global_batch_size // (d.micro_batch_size * dp),
        tokens_per_row=d.seq_length // 2 if cfg.wedlm.enabled else d.seq_length, seq_length=d.seq_length,
    )
    backend = resolve_attention_backend(cfg.model.attention_backend, device)
    distributed = cfg.optimizer.use_distributed_optimizer
    shards = (dp * p.cp if distributed else 1, layout.expert_dp if distributed else 1)
    memory = _busiest_rank(cfg, args, layout, bf16, backend, shards)
    return RunPlan(model=args, model_source=source, parameters=parameter_count(args), layout=layout, memory=memory,
                   bf16=bf16, device=device.type, attention_backend=backend, optimizer_shards=shards[0],
                   expert_optimizer_shards=shards[1], train_steps=cfg.trainer.train_steps)


def _busiest_rank(cfg: TrainConfig, args: ModelArgs, layout: Layout, bf16: bool, backend: str,
                  shards: tuple[int, int]) -> MemoryPerGPU:
    """The rank with the most bytes; ``shards``: the ranks the dense and the experts' optimizer
    state are split over."""
    p = cfg.parallelism
    u = 2 if bf16 else 4
    state_bytes = _MOMENTS[cfg.optimizer.name] * 4 + (4 if bf16 else 0)  # + the fp32 master copy
    per_layer = layer_activation_bytes(
        args, layout.seq_length, layout.micro_batch_size, tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel,
        recompute=p.recompute, attention_backend=backend, bytes_per_value=u, etp=layout.etp,
        capacity_factor=cfg.model.moe_capacity_factor,
    )
    layers = _stage_layers(args, p.pp)
    slots = layout.seq_length // p.cp * layout.micro_batch_size
    logit_bytes = u + 4 if bf16 else 4  # fp32: the softmax is computed in the logits' own storage
    logits = int(logit_bytes * _labelled_share(cfg) * slots * args.padded_vocab_size / p.tp)
    if p.recompute == "full":
        layer_input = u * slots * args.hidden_size // (p.tp if p.sequence_parallel else 1)
        kept = math.ceil(layers / p.recompute_num_layers) * layer_input
        working = min(p.recompute_num_layers, layers) * per_layer  # one chunk recomputed at a time
    else:
        kept, working = layers * per_layer, 0
    best: MemoryPerGPU | None = None
    for stage, count in rank_parameters(args, p.tp, p.pp, layout.ep, layout.etp).items():
        flight = _microbatches_in_flight(p.pp, p.virtual_pp, layout.microbatches_per_rank,
                                         p.pp - 1 if stage == "last" else 0)
        optimizer = (math.ceil(state_bytes * count.dense / shards[0])
                     + math.ceil(state_bytes * count.experts / shards[1]))
        memory = MemoryPerGPU(
            stage=stage, parameters=count.total, expert_parameters=count.experts, weights=u * count.total,
            gradients=_GRAD_BYTES * count.total, optimizer=optimizer, layer_activations=kept,
            microbatches_in_flight=flight,
            logits=logits if stage in ("last", "only") else 0, recompute_working=working,
        )
        if best is None or memory.total > best.total:
            best = memory
    assert best is not None
    return best


# ---------------------------------------------------------------------------------------------
# what --dry-run prints
# ---------------------------------------------------------------------------------------------


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{value / 2**20:.1f} MiB"


def _count(value: float) -> str:
    return f"{value / 1e9:.2f}B" if value >= 1e8 else f"{value / 1e6:.2f}M" if value >= 1e5 else f"{value:,.0f}"


def describe_plan(plan: RunPlan, cfg: TrainConfig) -> str:
    """The dry run's report: model, parameters, layout, tokens, then memory per GPU line by line."""
    a, n, lay, mem = plan.model, plan.parameters, plan.layout, plan.memory
    p = cfg.parallelism
    vpp = f" (virtual_pp {lay.virtual_pp})" if lay.virtual_pp else ""
    row = (f"a WeDLM row of {lay.seq_length} slots holds {lay.tokens_per_row}" if cfg.wedlm.enabled
           else f"an AR row holds {lay.seq_length}")
    moments = _MOMENTS[cfg.optimizer.name]
    state = (f"{cfg.optimizer.name}: {'fp32 master copy + ' if plan.bf16 else ''}{moments} fp32 "
             f"moment{'s' if moments > 1 else ''}, {4 * moments + (4 if plan.bf16 else 0)} bytes/parameter, "
             + (f"split over dp x cp = {plan.optimizer_shards}" if plan.optimizer_shards > 1 else "not split"))
    if a.is_moe and cfg.optimizer.use_distributed_optimizer:
        state += f", the experts' over expert-dp {plan.expert_optimizer_shards}"
    recompute = p.recompute + (f" ({p.recompute_num_layers} layer(s) per chunk)" if p.recompute == "full" else "")
    stage = {"only": "", "first": ", first pipeline stage", "last": ", last pipeline stage"}[mem.stage]
    unit = "GPU" if plan.device == "cuda" else "process"
    parts = [f"layers {_gib(mem.layer_activations)} per micro-batch x {mem.microbatches_in_flight:g} in flight"]

    parts += [f"logits {_gib(mem.logits)}"] if mem.logits else []
    parts += [f"a recomputed chunk {_gib(mem.recompute_working)}"] if mem.recompute_working else []
    if a.is_moe:
        capacity = cfg.model.moe_capacity_factor
        parts += [f"experts on {a.moe_topk} copies of each token, " + (
            f"at most capacity factor {capacity:g} x the even share" if capacity else "dropless: routed evenly")]
    mlp = (f"{a.num_experts} experts x ffn {a.moe_ffn_hidden_size} (top-{a.moe_topk})" if a.is_moe
           else f"ffn {a.ffn_hidden_size}")
    experts = [] if not a.is_moe else [
        f"experts: {a.num_experts} per layer over ep {lay.ep} ({a.num_experts // lay.ep} per rank), each over etp "
        f"{lay.etp}; expert-dp {lay.expert_dp} = world {lay.world_size} / (pp {lay.pp} x ep {lay.ep} x etp {lay.etp})"]
    active = (f" ({n.experts:,} in experts); active per token {n.active:,} ({_count(n.active)}: {a.moe_topk} of "
              f"{a.num_experts} experts per layer)" if a.is_moe else "")
    in_experts = f", {mem.expert_parameters:,} in experts" if a.is_moe else ""
    return "\n".join([
        f"model: {a.architecture}, {a.num_layers} layers, hidden {a.hidden_size}, {mlp}, "
        f"{a.num_attention_heads} heads / {a.num_query_groups} KV groups x head_dim {a.head_dim}, vocab {a.vocab_size} "
        f"({a.padded_vocab_size} rows), {'tied' if a.tie_word_embeddings else 'untied'} embeddings; "
        f"from {plan.model_source}",
        f"parameters: {n.total:,} ({_count(n.total)}) = {n.embedding:,} embedding + {n.non_embedding:,} non-embedding"
        + active,
        f"layout: world {lay.world_size} = tp {lay.tp} x pp {lay.pp}{vpp} x cp {lay.cp} x dp {lay.dp}; "
        f"micro-batch {lay.micro_batch_size}, global batch {lay.global_batch_size} rows, "
        f"{lay.microbatches_per_rank} gradient accumulation steps (micro-batches per rank per step)",
        *experts,
        f"tokens: {lay.tokens_per_step:,} per step ({lay.global_batch_size} rows x {lay.tokens_per_row}: {row}); "
        f"{plan.train_steps} steps = {_count(lay.tokens_per_step * plan.train_steps)} tokens",
        f"memory per {unit} ({'bf16' if plan.bf16 else 'fp32'} on {plan.device}, {plan.attention_backend} attention, "
        f"recompute {recompute}, sequence_parallel {str(p.sequence_parallel).lower()}; busiest rank{stage}: "
        f"{mem.parameters:,} parameters{in_experts}):",
        f"  weights      {_gib(mem.weights)}  ({mem.weights // mem.parameters} bytes/parameter)",
        f"  gradients    {_gib(mem.gradients)}  (fp32 gradient buffer, {_GRAD_BYTES} bytes/parameter)",
        f"  optimizer    {_gib(mem.optimizer)}  ({state})",
        f"  activations  {_gib(mem.activations)}  ({', '.join(parts)}; an estimate: "
        "megatron_wedlm/training/memory_plan.py)",
        f"  total        {_gib(mem.total)}  (plus the CUDA context, communication buffers and fragmentation)",
    ])
