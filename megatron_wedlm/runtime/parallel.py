"""Set up and tear down torch.distributed and Megatron's ``parallel_state`` for one layout; entry
points, tests and tools all use :func:`initialize_parallel_state`, so tests set up what trains.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_wedlm.runtime.cpu import activate_cpu_runtime
from megatron_wedlm.runtime.multiprocess import find_free_port, make_checkpoint_manager_die_with_rank


@dataclass
class ParallelConfig:
    """Model-parallel layout; the data-parallel size is whatever the world size leaves over."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1  # MoE: experts split over this many ranks (of DP x CP)
    expert_tensor_parallel_size: int | None = None  # MoE: TP inside each expert; None: the TP size


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits once the groups exist."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def batched_p2p_supported() -> bool:
    """Whether Megatron's batched pipeline p2p (``config.batch_p2p_comm``) is safe: not under gloo,
    which matches messages in posting order, so with two interleaved pipeline ranks activations and
    gradients of one shape cross and losses go silently wrong from the third micro-batch."""
    return torch.cuda.is_available()


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> the local CUDA device when there is one, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the process group of torchrun's environment (RANK, WORLD_SIZE, MASTER_*); without those
    variables, a world of one, so ``python script.py`` and ``torchrun`` share one path."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())
    if "megatron.core" in sys.modules:  # a Megatron rank (importing it only for this costs seconds)
        make_checkpoint_manager_die_with_rank()  # a rank killed with -9 must not leave it behind
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def initialize_parallel_state(
    config: ParallelConfig, device: str = "auto", seed: int = 1234
) -> ParallelLayout:
    """Create the process group (if needed) and Megatron's model-parallel groups, and seed the RNGs;
    on CPU (only) the CPU runtime is activated, which Megatron needs there. Raises ``ValueError``
    for a layout the world size cannot hold."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    make_checkpoint_manager_die_with_rank()  # also when the process group already existed
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        activate_cpu_runtime()
    init_distributed(torch_device)
    world = dist.get_world_size()
    model_parallel = (
        config.tensor_model_parallel_size
        * config.pipeline_model_parallel_size
        * config.context_parallel_size
    )
    if world % model_parallel != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP x PP x CP = "
            f"{config.tensor_model_parallel_size} x {config.pipeline_model_parallel_size} x "
            f"{config.context_parallel_size}; launch a multiple of {model_parallel} processes"
        )
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    expert_world = world // config.pipeline_model_parallel_size
    if expert_world % (ep * etp):
        raise ValueError(
            f"expert parallelism EP x ETP = {ep} x {etp} does not divide the {expert_world} ranks of each "
            f"pipeline stage (world {world} / PP {config.pipeline_model_parallel_size}); launch a multiple of "
            f"{ep * etp * config.pipeline_model_parallel_size} processes or lower EP"
        )
    if config.sequence_parallel and config.tensor_model_parallel_size == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)
    return current_layout(torch_device)


def current_layout(device: torch.device | None = None) -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")),
    )


def destroy_parallel_state() -> None:
    """Tear down Megatron's groups and the process group, leaving the process reusable."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
