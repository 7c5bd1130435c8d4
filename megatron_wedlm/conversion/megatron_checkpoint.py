"""Write and read Megatron-Core ``torch_dist`` checkpoints of a converted model.

Writing builds this rank's part of the model as training does (no random init), fills it one
tensor at a time and saves its ``sharded_state_dict``, so keys, shapes and shard metadata are
training's and reshard to any TP/PP. Reading builds no model: :class:`MegatronCheckpointReader`
reads one layer (and expert) of one tensor at a time, from converted and training checkpoints alike.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_wedlm.model.hf_config import ModelArgs
from megatron_wedlm.runtime import cpu as cpu_runtime
from megatron_wedlm.runtime.multiprocess import find_free_port
from megatron_wedlm.runtime.parallel import init_distributed

from .hf_checkpoint import ConversionError
from .layout import tp_local_shard
from .mapping import (
    EMBEDDING,
    OUTPUT_LAYER,
    Combine,
    TensorRule,
    checkpoint_key_variants,
    global_rules,
    layer_rules,
    megatron_shape,
    split_expert_index,
    stacked_dims,
)

#: A full (TP=1 layout) Megatron tensor for a rule, a global layer index (None: not per layer)
#: and a global expert index (None: not per expert).
TensorSource = Callable[[TensorRule, "int | None", "int | None"], torch.Tensor]


@contextlib.contextmanager
def megatron_process_group(
    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1
) -> Iterator[None]:
    """torch.distributed (gloo) and Megatron's groups for a conversion, torn down afterwards.

    Joins a launcher's world, else makes one of its own and restores the environment; keeps what
    existed; without CUDA switches on the CPU runtime for the duration. Experts are split over
    ``expert_model_parallel_size`` ranks, each expert over TP ranks (Megatron's default expert
    TP). A world larger than TP x PP x EP holds data-parallel replicas, which write nothing twice.
    """
    from megatron.core import parallel_state as ps

    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size

    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available() and not cpu_runtime.cpu_runtime_active():
            cpu_runtime.activate_cpu_runtime()
            stack.callback(cpu_runtime.deactivate_cpu_runtime)
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                stack.enter_context(_single_process_env())
            init_distributed(torch.device("cpu"))
            stack.callback(dist.destroy_process_group)
        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_expert_model_parallel_world_size())
            if have != (tp, pp, ep):
                raise RuntimeError(
                    f"Megatron is already initialised with TP x PP x EP = {have[0]} x {have[1]} x {have[2]}, not "
                    f"{tp} x {pp} x {ep}"
                )
        else:
            world = dist.get_world_size()
            if world % (tp * pp * ep):
                raise RuntimeError(
                    f"conversion with TP={tp} x PP={pp} x EP={ep} needs {tp * pp * ep} processes (or a multiple: "
                    f"data-parallel replicas), got {world}"
                )
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
            )
            stack.callback(ps.destroy_model_parallel)
            model_parallel_cuda_manual_seed(0)
        yield


@contextlib.contextmanager
def _single_process_env() -> Iterator[None]:
    """torchrun's variables for a world of one on a free port, restored on exit."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(find_free_port()))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_conversion_model(args: ModelArgs, *, initialize: bool = False):
    """This rank's part of the model ``args`` describes, built as training builds it, in the
    checkpoint's dtype; ``initialize=False`` skips random init (every tensor is overwritten).
    """
    from megatron_wedlm.model.wedlm_model import BuildSettings, build_model_chunks  # imports Megatron-Core

    (model,) = build_model_chunks(args, BuildSettings(params_dtype=args.torch_dtype, initialize=initialize))
    return model


def fill_model(model, args: ModelArgs, source: TensorSource) -> None:
    """Copy every parameter of this rank's model part from ``source``, one tensor at a time.

    Experts: this rank holds experts ``ep_rank * E / EP + local index``, each split over the
    expert-TP group (not the attention's TP group: the two may differ).
    """
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    expert_tp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    experts_per_rank = (args.num_experts or 0) // ps.get_expert_model_parallel_world_size()
    first_expert = ps.get_expert_model_parallel_rank() * experts_per_rank
    filled: set[int] = set()

    def copy(param: torch.Tensor, rule: TensorRule, layer: int | None, expert: int | None = None) -> None:
        full = source(rule, layer, expert)
        rank, size = expert_tp if rule.per_expert else tp
        local = tp_local_shard(full, rule.tp_partition_dim, rank, size, gated=rule.gated)
        if local.shape != param.shape:
            where = f"layer {layer}" + ("" if expert is None else f", expert {expert}")
            raise ConversionError(
                f"{rule.param} ({where}): converted shape {tuple(local.shape)} does not match the "
                f"Megatron parameter {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(local)
        filled.add(id(param))
        del full, local

    top = dict(model.named_parameters())
    for rule in global_rules(args):
        if rule.param in top:
            copy(top[rule.param], rule, None)
    if args.tie_word_embeddings and OUTPUT_LAYER.param in top:
        copy(top[OUTPUT_LAYER.param], EMBEDDING, None)  # last stage's copy of the tied embedding
    by_param = {rule.param: rule for rule in layer_rules(args)}
    for layer in model.decoder.layers:
        global_index = layer.layer_number - 1
        for name, param in layer.named_parameters():
            template, local_expert = split_expert_index(name)
            if template not in by_param:
                raise ConversionError(f"no conversion rule for Megatron parameter decoder.layers.*.{name}")
            expert = None if local_expert is None else first_expert + local_expert
            copy(param, by_param[template], global_index, expert)
    missing = [name for name, p in model.named_parameters() if id(p) not in filled]
    if missing:
        raise ConversionError(f"Megatron parameters left without a source tensor: {missing}")


def save_megatron_checkpoint(model, directory: str | Path, release_model: bool = False) -> None:
    """``dist_checkpointing.save`` of the model's sharded state dict.

    ``release_model=True`` (a writer done with the model) copies ``linear_fc1``'s gate and up views
    layer by layer and frees the fused parameter, so torch_dist's copy of views does not add to the
    peak; those weights are empty afterwards.
    """
    from megatron_wedlm.runtime.megatron_compat import save_torch_dist

    Path(directory).mkdir(parents=True, exist_ok=True)
    sharded = model.sharded_state_dict()
    if release_model:
        _move_views_out_of_parameters(model, sharded)
    save_torch_dist(sharded, str(directory))


def _move_views_out_of_parameters(model, sharded) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)  # what save() would do first; builds the fc1 half-views
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    views: dict[int, list[ShardedTensor]] = {}
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and item.data is not None:
            storage = item.data.untyped_storage()
            if storage.nbytes() != item.data.nbytes:
                views.setdefault(storage.data_ptr(), []).append(item)
    for data_ptr, items in views.items():
        for item in items:
            item.data = item.data.detach().clone()
        if data_ptr in params:
            params[data_ptr].data = torch.empty(0, dtype=params[data_ptr].dtype)


def load_megatron_weights(model, directory: str | Path, strict: bool = True) -> None:
    """Load a converted (or training) checkpoint's weights into a built model of any layout."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    check_torch_dist_dir(directory)
    sharded = model.sharded_state_dict()
    stored = set(dist_checkpointing.load_tensors_metadata(str(directory)))
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and item.key not in stored:
            # The same norm under its other name (local-spec TE alias vs module name).
            item.key = next((k for k in checkpoint_key_variants(item.key) if k in stored), item.key)
    state = dist_checkpointing.load(sharded, str(directory))
    model.load_state_dict(state, strict=strict)


def check_torch_dist_dir(directory: str | Path) -> None:
    meta = Path(directory) / "metadata.json"
    if not meta.is_file():
        raise ConversionError(
            f"{directory} is not a Megatron torch_dist checkpoint (no metadata.json); point --input at the "
            "directory written by hf-to-megatron or at one checkpoint iteration of a training run"
        )
    backend = json.loads(meta.read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise ConversionError(f"{directory} uses the {backend!r} backend; only torch_dist is supported")


def torch_dist_problem(directory: str | Path) -> str | None:
    """Why the tensor files of a ``torch_dist`` checkpoint cannot all be read, or None.

    Checks, from the index and file sizes only, that every data file ``.metadata`` names exists at
    its full length: a truncated ``*.distcp`` otherwise fails as a bare EOFError naming no file.
    """
    from torch.distributed.checkpoint import FileSystemReader  # about 1 s to import

    directory = Path(directory)
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - any unreadable index means the same thing
        return f"{directory / '.metadata'} cannot be read ({type(err).__name__}: {err})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} is truncated ({path.stat().st_size} bytes; the checkpoint's index needs {size})"
    return None


class MegatronCheckpointReader:
    """One Megatron tensor (one layer and expert of it) at a time from a ``torch_dist`` checkpoint."""

    def __init__(self, directory: str | Path, args: ModelArgs) -> None:
        from megatron.core import dist_checkpointing

        check_torch_dist_dir(directory)
        problem = torch_dist_problem(directory)
        if problem is not None:
            raise ConversionError(
                f"the checkpoint {directory} cannot be read: {problem}. It is incomplete or corrupt (an interrupted "
                "copy or save?); use another checkpoint"
            )
        self.directory = str(directory)
        self.args = args
        self.metadata = dist_checkpointing.load_tensors_metadata(self.directory)
        self.prefix = self._model_prefix()
        self._experts: tuple[tuple[str, int | None], torch.Tensor] | None = None  # the last layer's experts

    def _model_prefix(self) -> str:
        """Keys may sit under a prefix when the model is wrapped; find it from the embedding key."""
        candidates = [k[: -len(EMBEDDING.key)] for k in self.metadata if k.endswith(EMBEDDING.key)]
        if not candidates:
            raise ConversionError(f"{self.directory} has no {EMBEDDING.key!r}: not a GPT model checkpoint")
        return min(candidates, key=len)

    def _key(self, rule: TensorRule, layer: int | None) -> tuple[str, bool]:
        """(checkpoint key, whether layers are stacked in it); the rule's own key when absent."""
        if layer is None:
            return self.prefix + rule.key, False
        suffix = rule.key.removeprefix("decoder.layers.")
        stacked = f"{self.prefix}decoder.layers.{suffix}"
        per_layer = f"{self.prefix}decoder.layers.{layer}.{suffix}"  # non-homogeneous layer saves
        for candidate, is_stacked in ((stacked, True), (per_layer, False)):
            for key in checkpoint_key_variants(candidate):
                if key in self.metadata:
                    return key, is_stacked
        return stacked, True

    def read(self, rule: TensorRule, layer: int | None, expert: int | None = None) -> torch.Tensor:
        """The full (TP=1 layout) tensor of ``rule`` for one layer and (global) expert.

        A per-expert rule's experts of one layer are read in one call and kept until another rule
        or layer is asked for: the export asks for them in turn, and one checkpoint read per expert
        (128 x 2 per layer of Qwen3-30B-A3B) would spend its time in the reads' fixed cost.
        """
        if not rule.per_expert:
            return self._load(rule, layer)
        if self._experts is None or self._experts[0] != (rule.key, layer):
            self._experts = ((rule.key, layer), self._load(rule, layer))
        return self._experts[1][expert]

    def _load(self, rule: TensorRule, layer: int | None) -> torch.Tensor:
        """One layer's tensor of ``rule`` (``[experts, ...]`` for a per-expert rule) in one read."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        key, stacked = self._key(rule, layer)
        if key not in self.metadata:
            raise ConversionError(f"tensor {key!r} is missing from the Megatron checkpoint {self.directory}")
        info = self.metadata[key]
        expected = megatron_shape(rule, self.args)
        global_shape = tuple(info.global_shape)
        padded_otherwise = global_shape[1:] == expected[1:] and global_shape[0] >= self.args.vocab_size
        if rule.combine is Combine.VOCAB and padded_otherwise:
            expected = global_shape  # padded for another layout: the rows past vocab_size are dropped later
        lead = stacked_dims(rule, self.args)[0 if stacked else 1:]  # (layers,) if stacked, (experts,) if per expert
        if global_shape != (*lead, *expected):
            raise ConversionError(
                f"tensor {key!r} has shape {global_shape}, expected {(*lead, *expected)} from the model "
                "description (wedlm_model.json)"
            )
        experts = (self.args.num_experts,) if rule.per_expert else ()
        offsets = [(0, layer, lead[0])] if stacked else []  # this layer of the stack; every expert
        target = ShardedTensor.from_rank_offsets(
            key, torch.empty(*(1,) * len(offsets), *experts, *expected, dtype=info.dtype), *offsets
        )
        loaded = dist_checkpointing.load({"t": target}, self.directory, validate_access_integrity=False)["t"]
        return loaded.reshape(*experts, *expected)
