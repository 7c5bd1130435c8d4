"""CPU runtime for Megatron-Core: the one place that redirects Megatron's CUDA assumptions (current
device, RNG tracker, ``device="cuda"`` factories, synchronize, CUDA tensor-type checks) so its real
models, schedules and optimizers run on CPU with gloo.

It activates only explicitly (:func:`activate_cpu_runtime`, or ``MEGATRON_WEDLM_CPU=1`` through
:func:`activate_from_env`; importing changes nothing), never where CUDA is available, and only on
the Megatron-Core releases whose lines each patch names; every patch replaces something that
cannot work on a CPU-only torch, so nothing that works on CPU changes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .megatron_compat import SUPPORTED_RELEASES, megatron_core_version

#: Megatron-Core releases whose source lines the patches below were checked against. Each
#: ``Patch.sites`` names its lines in every one of them; ``tests/test_cpu_runtime.py`` reads those
#: lines in the installed release and fails when one no longer holds what the patch redirects.
TESTED_MEGATRON_CORE_VERSIONS: tuple[str, ...] = SUPPORTED_RELEASES

ENV_VAR = "MEGATRON_WEDLM_CPU"
UNTESTED_OVERRIDE_ENV_VAR = "MEGATRON_WEDLM_ALLOW_UNTESTED_MCORE"


class CpuRuntimeError(RuntimeError):
    """Raised when the CPU runtime cannot (or must not) be activated."""


@dataclass(frozen=True)
class Patch:
    """One redirection: ``owner.attribute`` is replaced by ``replacement`` while the runtime is on.

    ``sites`` maps each tested Megatron-Core release to the lines the patch exists for, as
    ``"path:line,line; path:line"`` with paths under ``megatron/core/``; every such line matches
    the regular expression ``marker`` (what the patch redirects), which a test checks against the
    installed release. A release that needs no such line has ``""``, and the patch is not applied
    there.
    """

    owner: Any
    attribute: str
    replacement: Any
    why: str
    marker: str
    sites: dict[str, str]

    def sites_in(self, version: str) -> list[tuple[str, int]]:
        """The (path under megatron/core, line number) pairs this patch covers in ``version``."""
        pairs = []
        for entry in filter(str.strip, self.sites[version].split(";")):
            path, lines = entry.strip().rsplit(":", 1)
            pairs.extend((path, int(line)) for line in lines.split(","))
        return pairs


_applied: list[tuple[Patch, Any]] = []


def cpu_runtime_active() -> bool:
    return bool(_applied)


def check_megatron_core_version(allow_untested: bool = False) -> str:
    """Return the installed Megatron-Core version, or raise if the patches were not checked on it."""
    version = megatron_core_version()
    if version in TESTED_MEGATRON_CORE_VERSIONS or allow_untested:
        return version
    raise CpuRuntimeError(
        f"megatron-core {version} is untested by megatron_wedlm's CPU runtime (tested: "
        f"{', '.join(TESTED_MEGATRON_CORE_VERSIONS)}); install one of those, or set "
        f"{UNTESTED_OVERRIDE_ENV_VAR}=1 to try anyway and re-run tests/test_cpu_runtime.py."
    )


# --------------------------------------------------------------------------------------------
# Replacements
# --------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int)  # a bare index means a CUDA ordinal in torch's factories


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class _TorchWithCpuFactories(types.ModuleType):
    """``torch`` as seen by one Megatron module, with ``device="cuda"`` factories mapped to CPU.

    Patching ``torch.zeros`` globally would touch every library in the process; installing this
    proxy as the ``torch`` global of the few Megatron modules that hard-code ``device="cuda"``
    keeps the change local to them.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_current_device() -> str:
    return "cpu"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _CpuEvent:
    """An event on the CPU's stream: already reached (CPU ops are synchronous)."""

    wait = record = synchronize = staticmethod(_noop)

    @staticmethod
    def query() -> bool:
        return True


class _CpuStream:
    """The one stream of a CPU: every wait is already satisfied (CPU ops are synchronous)."""

    wait_event = wait_stream = synchronize = staticmethod(_noop)

    @staticmethod
    def record_event(*_args: Any, **_kwargs: Any) -> _CpuEvent:
        return _CpuEvent()


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(*_args: Any, **_kwargs: Any) -> _CpuStream:
    return _CPU_STREAM


def _cpu_stream_context(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_rng_tracker_class(base: type) -> type:
    """Megatron's RNG tracker with the CPU generator standing in for the CUDA one.

    Megatron keeps named CUDA generator states (data-parallel, model-parallel, expert) and swaps
    them in with ``fork()``. On CPU the device generator *is* the CPU default generator, so the
    same states are kept for it. The stock ``fork`` also warns when the CPU state changes inside
    a fork, which is the expected case here, so ``fork`` is rewritten without that check.
    """

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the desired {name}"
                    )
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


@contextlib.contextmanager
def _cpu_float_tensors_report_cuda_type() -> Iterator[None]:
    """While active, ``t.type()`` of a CPU tensor answers with its ``torch.cuda.*`` name.

    Megatron's optimizers classify parameters by ``param.type() == 'torch.cuda.FloatTensor'``;
    on CPU the same parameters answer ``'torch.FloatTensor'`` and are rejected.
    """
    original = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any):
        result = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and self.device.type == "cpu":
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    if isinstance(fn, classmethod):
        inner = fn.__func__

        @functools.wraps(inner)
        def class_wrapper(cls: Any, *args: Any, **kwargs: Any) -> Any:
            with _cpu_float_tensors_report_cuda_type():
                return inner(cls, *args, **kwargs)

        return classmethod(class_wrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cpu_float_tensors_report_cuda_type():
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _cpu_tensors_ignore_cuda_moves() -> Iterator[None]:
    """While active, ``t.cuda()`` on a CPU tensor returns the tensor itself (no CUDA to move to)."""
    original = torch.Tensor.cuda

    def stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any):
        if self.device.type == "cpu":
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.cuda = stay_on_cpu  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _without_cuda_moves(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_ignore_cuda_moves():
            return fn(*args, **kwargs)

    return wrapper


def _patches() -> list[Patch]:
    """Every patch, in the order it is applied: device calls, RNG, ``device="cuda"`` factories, CUDA type checks."""
    return [*_device_patches(), *_rng_patches(), *_cuda_factory_patches(), *_cuda_type_patches(), *_moe_patches()]


def _device_patches() -> list[Patch]:
    """``torch.cuda`` calls for the current device, its stream and synchronisation."""
    return [
        Patch(torch.cuda, "current_device", _cpu_current_device,
              "tensors and buffers created on device=torch.cuda.current_device()",
              r"torch\.cuda\.current_device\(\)", {
                  "0.16.1": "tensor_parallel/layers.py:261,552,597,873,1197; tensor_parallel/mappings.py:91,141,181; "
                            "transformer/attention.py:430; models/common/embeddings/rotary_pos_embedding.py:162; "
                            "models/gpt/gpt_model.py:415; distributed/param_and_grad_buffer.py:783,800,806; "
                            "optimizer/distrib_optimizer.py:791",
                  "0.19.2": "tensor_parallel/layers.py:305,647,708,1000,1363; tensor_parallel/mappings.py:95,145,185; "
                            "transformer/attention.py:530; models/common/embeddings/rotary_pos_embedding.py:162; "
                            "models/gpt/gpt_model.py:452; distributed/param_and_grad_buffer.py:1162,1180,1186; "
                            "optimizer/distrib_optimizer.py:998",
              }),
        Patch(torch.cuda, "synchronize", _noop,
              "CPU ops are synchronous; torch.cuda.synchronize raises without CUDA",
              r"torch\.cuda\.synchronize\(", {
                  "0.16.1": "parallel_state.py:198,933; distributed/distributed_data_parallel.py:588,611",
                  "0.19.2": "parallel_state.py:216,1035; distributed/distributed_data_parallel.py:649,672",
              }),
        Patch(torch.cuda, "current_stream", _cpu_current_stream,
              "the grad all-reduce first waits on the current stream for CUDA-graph replays (0.19), and "
              "the MoE alltoall dispatcher copies its splits to the host on a side stream "
              "(torch.cuda.current_stream raises without CUDA)",
              r"torch\.cuda\.current_stream\(\)", {
                  "0.16.1": "transformer/moe/token_dispatcher.py:871,873",
                  "0.19.2": "distributed/param_and_grad_buffer.py:632; transformer/moe/token_dispatcher.py:922,924",
              }),
        Patch(torch.cuda, "stream", _cpu_stream_context,
              "the MoE alltoall dispatcher enters its side stream to copy the splits to the host",
              r"torch\.cuda\.stream\(", {
                  "0.16.1": "transformer/moe/token_dispatcher.py:874",
                  "0.19.2": "transformer/moe/token_dispatcher.py:925",
              }),
    ]


def _rng_patches() -> list[Patch]:
    """The device generator and Megatron's CUDA RNG tracker, served by the CPU generator."""
    import megatron.core.tensor_parallel.random as mcore_random

    return [
        Patch(torch.cuda, "manual_seed", torch.manual_seed,
              "model_parallel_cuda_manual_seed and the tracker's add seed the device generator",
              r"torch\.cuda\.manual_seed\(", {
                  "0.16.1": "tensor_parallel/random.py:237,422",
                  "0.19.2": "tensor_parallel/random.py:305,490",
              }),
        Patch(torch.cuda, "get_rng_state", _cpu_get_rng_state,
              "the tracker's add and the rerun state machine read the device generator",
              r"torch\.cuda\.get_rng_state\(", {
                  "0.16.1": "tensor_parallel/random.py:235,238; rerun_state_machine.py:957",
                  "0.19.2": "tensor_parallel/random.py:303,306; rerun_state_machine.py:979",
              }),
        Patch(torch.cuda, "set_rng_state", _cpu_set_rng_state,
              "the rerun state machine restores the device generator",
              r"torch\.cuda\.set_rng_state\(", {
                  "0.16.1": "rerun_state_machine.py:970",
                  "0.19.2": "rerun_state_machine.py:992",
              }),
        Patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state,
              "tracker fork, activation recompute and the checkpointed RNG state",
              r"_get_cuda_rng_state\(", {
                  "0.16.1": "tensor_parallel/random.py:41,250,273,447",
                  "0.19.2": "tensor_parallel/random.py:104,318,341,528",
              }),
        Patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state,
              "a lazy CUDA call that is a silent no-op on CPU",
              r"_set_cuda_rng_state\(", {
                  "0.16.1": "tensor_parallel/random.py:72,240,255,277,457",
                  "0.19.2": "tensor_parallel/random.py:135,308,323,345,538",
              }),
        Patch(mcore_random, "CudaRNGStatesTracker",
              _make_cpu_rng_tracker_class(mcore_random.CudaRNGStatesTracker),
              "the tracker class that initialize_rng_tracker instantiates",
              r"CudaRNGStatesTracker\b", {
                  "0.16.1": "tensor_parallel/random.py:161,315",
                  "0.19.2": "tensor_parallel/random.py:229,383",
              }),
    ]


def _cuda_factory_patches() -> list[Patch]:
    """Modules that build tensors with ``device="cuda"`` see a ``torch`` whose factories make them on the CPU."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.grad_scaler as grad_scaler
    import megatron.core.optimizer.optimizer as mcore_optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.utils as transformer_utils
    import megatron.core.utils as mcore_utils

    cpu_torch = _TorchWithCpuFactories()
    cuda_factory = r"device=[\"']cuda[\"']"
    return [
        Patch(schedules, "torch", cpu_torch,
              "total_num_tokens counters built on device='cuda'", cuda_factory, {
                  "0.16.1": "pipeline_parallel/schedules.py:596,983,2138",
                  "0.19.2": "pipeline_parallel/schedules.py:749,1121,2292",
              }),
        Patch(mcore_utils, "torch", cpu_torch,
              "local_multi_tensor_l2_norm (the grad norm without apex) builds its result on 'cuda'",
              cuda_factory, {
                  "0.16.1": "utils.py:1207",
                  "0.19.2": "utils.py:1332",
              }),
        Patch(transformer_utils, "torch", cpu_torch,
              "get_default_causal_mask (local attention) builds its mask on 'cuda'", cuda_factory, {
                  "0.16.1": "transformer/utils.py:35,40",
                  "0.19.2": "transformer/utils.py:39,44",
              }),
        Patch(mcore_optimizer, "torch", cpu_torch,
              "found_inf, scale and grad-norm-group buffers (and FP32Optimizer's scale) on 'cuda'",
              cuda_factory, {
                  "0.16.1": "optimizer/optimizer.py:473,481,485,907",
                  "0.19.2": "optimizer/optimizer.py:315,690,698,702,1249",
              }),
        Patch(grad_scaler, "torch", cpu_torch,
              "loss-scale buffers on 'cuda'", cuda_factory, {
                  "0.16.1": "optimizer/grad_scaler.py:15,88,91,94",
                  "0.19.2": "optimizer/grad_scaler.py:20,111,114,117",
              }),
        Patch(clip_grads, "torch", cpu_torch,
              "grad-norm and zero-count buffers on 'cuda'", cuda_factory, {
                  "0.16.1": "optimizer/clip_grads.py:90,103,115,174,207",
                  "0.19.2": "optimizer/clip_grads.py:96,108,112,180,231",
              }),
    ]


def _cuda_type_patches() -> list[Patch]:
    """Code that checks for ``torch.cuda.FloatTensor`` or moves weights with ``.cuda()``."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return [
        Patch(clip_grads, "clip_grad_by_total_norm_fp32",
              _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32),
              "it asserts every grad is a 'torch.cuda.FloatTensor'",
              r"torch\.cuda\.FloatTensor'", {
                  "0.16.1": "optimizer/clip_grads.py:167",
                  "0.19.2": "optimizer/clip_grads.py:174",
              }),
        Patch(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups",
              _with_cuda_type_names(
                  distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
              ),
              "it sorts parameters by param.type() == 'torch.cuda.FloatTensor'",
              r"torch\.cuda\.FloatTensor'", {
                  "0.16.1": "optimizer/distrib_optimizer.py:420",
                  "0.19.2": "optimizer/distrib_optimizer.py:466",
              }),
        Patch(LanguageModule, "setup_embeddings_and_output_layer",
              _without_cuda_moves(LanguageModule.__dict__["setup_embeddings_and_output_layer"]),
              "weight.data.cuda() before the all-reduce that copies tied embeddings to the last "
              "pipeline stage", r"\.cuda\(\)", {
                  "0.16.1": "models/common/language_module/language_module.py:244",
                  "0.19.2": "models/common/language_module/language_module.py:307",
              }),
    ]


def _cpu_splits_as_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``maybe_move_tensor_to_cpu`` for tensors already on the CPU: numpy when asked."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _gather_uneven_over_gloo(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``_gather_along_first_dim`` whose uneven case (``output_split_sizes``) pads every part to
    the longest, as gloo's all_gather needs equal sizes; the even case is the original."""

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


def _reduce_scatter_uneven_over_gloo(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``_reduce_scatter_along_first_dim`` whose uneven case (``input_split_sizes``) all-reduces
    and keeps this rank's rows, as gloo has no list reduce_scatter; the even case is the original."""

    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start: start + sizes[group.rank()]].contiguous()

    return reduce_scatter


def _moe_patches() -> list[Patch]:
    """What the MoE layers need on CPU: no Transformer Engine, and gloo for uneven collectives."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    return [
        Patch(mappings, "_gather_along_first_dim", _gather_uneven_over_gloo(mappings._gather_along_first_dim),
              "expert tensor parallelism gathers each rank's routed tokens, a different count per rank, "
              "and gloo's all_gather needs equal sizes", r"torch\.distributed\.all_gather\(output_tensor_list", {
                  "0.16.1": "tensor_parallel/mappings.py:150",
                  "0.19.2": "tensor_parallel/mappings.py:154",
              }),
        Patch(mappings, "_reduce_scatter_along_first_dim",
              _reduce_scatter_uneven_over_gloo(mappings._reduce_scatter_along_first_dim),
              "its gradient reduce-scatters those uneven parts, and gloo has no list reduce_scatter",
              r"torch\.distributed\.reduce_scatter\(output, input_tensor_list", {
                  "0.16.1": "tensor_parallel/mappings.py:193",
                  "0.19.2": "tensor_parallel/mappings.py:197",
              }),
        Patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _CPU_STREAM,
              "the alltoall dispatcher creates its device-to-host stream when first built unless one is set "
              "(torch.cuda.Stream raises without CUDA; replacing that class would break annotations using it)",
              r"torch\.cuda\.Stream\(\)", {
                  "0.16.1": "transformer/moe/token_dispatcher.py:445",
                  "0.19.2": "transformer/moe/token_dispatcher.py:469",
              }),
        Patch(token_dispatcher, "maybe_move_tensor_to_cpu", _cpu_splits_as_numpy,
              "it turns the all-to-all split sizes into numpy only when they are on a GPU; as CPU "
              "tensors, all_to_all_single refuses them", r"as_numpy=True", {
                  "0.16.1": "transformer/moe/token_dispatcher.py:880,883,886",
                  "0.19.2": "transformer/moe/token_dispatcher.py:931,934,937",
              }),
        Patch(moe_utils, "te_general_gemm", None,
              "0.16 defines it only when Transformer Engine imports, yet the router's gating GEMM reads it",
              r"te_general_gemm is not None", {
                  "0.16.1": "transformer/moe/moe_utils.py:1192,1225",
                  "0.19.2": "",
              }),
    ]


def _patch_importers_of_clip_fn() -> list[Patch]:
    """Modules that imported ``clip_grad_by_total_norm_fp32`` by name need the wrapped one too."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer

    wrapped = clip_grads.clip_grad_by_total_norm_fp32
    return [
        Patch(mcore_optimizer, "clip_grad_by_total_norm_fp32", wrapped,
              "MegatronOptimizer.clip_grad_norm calls the name it imported",
              r"clip_grad_by_total_norm_fp32\(", {
                  "0.16.1": "optimizer/optimizer.py:215,1324",
                  "0.19.2": "optimizer/optimizer.py:410,420,1906,1916",
              }),
    ]


def activate_cpu_runtime(allow_untested_version: bool | None = None) -> None:
    """Make Megatron-Core run on CPU (gloo). Idempotent; refuses on a machine with CUDA."""
    if cpu_runtime_active():
        return
    if torch.cuda.is_available():
        raise CpuRuntimeError(
            "CUDA is available: megatron_wedlm's CPU runtime is only for CPU-only machines and "
            "must not alter Megatron-Core on a GPU. Unset MEGATRON_WEDLM_CPU / do not call "
            "activate_cpu_runtime() on GPU nodes."
        )
    if allow_untested_version is None:
        allow_untested_version = os.environ.get(UNTESTED_OVERRIDE_ENV_VAR) == "1"
    version = check_megatron_core_version(allow_untested_version)
    # In two passes: the second reads the clip function the first one wrapped.
    for patches in (_patches, _patch_importers_of_clip_fn):
        for patch in patches():
            # An untested release gets every patch: each replaces only what cannot run on a CPU.
            if version not in patch.sites or patch.sites_in(version):
                _apply(patch)
    # Megatron may have created a tracker of the stock class before activation.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.initialize_rng_tracker(force_reset=True)


_MISSING = object()  # the attribute did not exist before its patch


def _apply(patch: Patch) -> None:
    original = getattr(patch.owner, patch.attribute, _MISSING)
    if isinstance(patch.owner, type):
        original = patch.owner.__dict__[patch.attribute]
    setattr(patch.owner, patch.attribute, patch.replacement)
    _applied.append((patch, original))


def deactivate_cpu_runtime() -> None:
    """Undo every patch (in reverse order). Used by tests that activate in-process."""
    while _applied:
        patch, original = _applied.pop()
        if original is _MISSING:
            delattr(patch.owner, patch.attribute)
        else:
            setattr(patch.owner, patch.attribute, original)


def applied_patches() -> list[Patch]:
    return [patch for patch, _ in _applied]


def activate_from_env() -> bool:
    """Activate when ``MEGATRON_WEDLM_CPU=1``; return whether the runtime is active."""
    if os.environ.get(ENV_VAR) == "1":
        activate_cpu_runtime()
    return cpu_runtime_active()
