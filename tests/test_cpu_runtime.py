"""The CPU runtime: activation rules and the RNG tracker it installs."""

from pathlib import Path

import pytest
import torch

from megatron_wedlm.runtime import cpu
from megatron_wedlm.runtime.multiprocess import run_distributed


def test_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cpu.CpuRuntimeError, match="CUDA is available"):
        cpu.activate_cpu_runtime()
    assert not cpu.cpu_runtime_active()


def test_refuses_untested_megatron_core_version(monkeypatch):
    monkeypatch.setattr(cpu, "megatron_core_version", lambda: "0.99.0")
    monkeypatch.delenv(cpu.UNTESTED_OVERRIDE_ENV_VAR, raising=False)
    with pytest.raises(cpu.CpuRuntimeError) as err:
        cpu.activate_cpu_runtime()
    message = str(err.value)
    assert "\n" not in message
    assert "0.99.0" in message and cpu.UNTESTED_OVERRIDE_ENV_VAR in message
    assert all(version in message for version in ("0.16.1", "0.19.2"))
    assert not cpu.cpu_runtime_active()


def test_env_var_is_the_only_implicit_switch(monkeypatch):
    monkeypatch.delenv(cpu.ENV_VAR, raising=False)
    assert cpu.activate_from_env() is False
    assert not cpu.cpu_runtime_active()


def _all_patches() -> list[cpu.Patch]:
    return [*cpu._patches(), *cpu._patch_importers_of_clip_fn()]


def test_every_patch_names_its_lines_in_every_tested_release():
    for patch in _all_patches():
        assert sorted(patch.sites) == sorted(cpu.TESTED_MEGATRON_CORE_VERSIONS), patch.attribute
        assert any(patch.sites_in(version) for version in cpu.TESTED_MEGATRON_CORE_VERSIONS), patch.attribute


def test_the_named_lines_hold_what_each_patch_redirects_in_the_installed_release():
    """Read every line a patch names for the installed release from Megatron-Core's own source:
    a line that moved, or no longer does what the patch redirects, fails here (in each CI leg)."""
    import re

    import megatron.core

    version = cpu.check_megatron_core_version()
    core = Path(megatron.core.__file__).parent
    checked = 0
    for patch in _all_patches():
        for path, number in patch.sites_in(version):
            lines = (core / path).read_text().splitlines()
            assert number <= len(lines), f"{path}:{number} is past the end ({patch.attribute})"
            line = lines[number - 1]
            assert re.search(patch.marker, line), f"{version} {path}:{number} lacks {patch.marker!r}: {line!r}"
            checked += 1
    assert checked >= 60


def test_version_is_the_release_not_the_checkout_suffix(monkeypatch):
    """megatron.core.__version__ carries the commit of the git tree its files sit in."""
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.16.1+deadbee")
    assert "+" not in cpu.megatron_core_version()
    assert cpu.megatron_core_version() in cpu.TESTED_MEGATRON_CORE_VERSIONS


def test_activate_and_deactivate_restore_megatron():
    import megatron.core.pipeline_parallel.schedules as schedules

    original_current_device = torch.cuda.current_device
    original_schedules_torch = schedules.torch
    cpu.activate_cpu_runtime()
    try:
        assert torch.cuda.current_device() == "cpu"
        assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
        version = cpu.megatron_core_version()
        applied = [(p.owner, p.attribute) for p in cpu.applied_patches()]
        assert applied == [(p.owner, p.attribute) for p in _all_patches() if p.sites_in(version)]
        assert (torch.cuda, "current_stream") in applied or version == "0.16.1"
        # the optimizer module calls the clip function it imported by name: the wrapped one
        import megatron.core.optimizer.clip_grads as clip_grads
        import megatron.core.optimizer.optimizer as mcore_optimizer

        assert mcore_optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
        assert clip_grads.clip_grad_by_total_norm_fp32.__wrapped__ is not None
    finally:
        cpu.deactivate_cpu_runtime()
    assert torch.cuda.current_device is original_current_device
    assert schedules.torch is original_schedules_torch


def rng_worker(seed: int) -> dict:
    """Seed Megatron's RNG the standard way and draw inside and outside tracker forks."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_wedlm.runtime.parallel import ParallelConfig, initialize_parallel_state

    initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=2), device="cpu", seed=seed)
    tracker = get_cuda_rng_tracker()
    default_before = torch.rand(3)
    with tracker.fork():
        model_parallel_a = torch.rand(3)
    default_after = torch.rand(3)
    with tracker.fork():
        model_parallel_b = torch.rand(3)
    with tracker.fork("data-parallel-rng"):
        data_parallel = torch.rand(3)
    return {
        "default": torch.cat([default_before, default_after]),
        "mp": torch.cat([model_parallel_a, model_parallel_b]),
        "dp": data_parallel,
    }


def test_rng_tracker_is_deterministic_and_split_like_megatron():
    first = run_distributed(rng_worker, 2, 7, timeout_s=120)
    second = run_distributed(rng_worker, 2, 7, timeout_s=120)
    for a, b in zip(first, second):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    rank0, rank1 = first
    # Megatron's contract: the model-parallel stream differs across TP ranks ...
    assert not torch.equal(rank0["mp"], rank1["mp"])
    # ... while the default and data-parallel streams agree within the TP group.
    assert torch.equal(rank0["default"], rank1["default"])
    assert torch.equal(rank0["dp"], rank1["dp"])
    # A fork resumes its own stream and leaves the default stream where it was.
    assert not torch.equal(rank0["mp"][:3], rank0["mp"][3:])
    torch.manual_seed(7)
    assert torch.equal(rank0["default"], torch.rand(6))
