"""bf16 training on CPU: Megatron's mixed precision (bf16 weights and activations, fp32 main
parameters, gradients reduced in fp32) on the same Megatron path as a GPU run, 2 real gloo
ranks, the tiny CPU config. What it must keep: the fp32 run's losses up to bf16 rounding, the
bf16 weights being the rounded fp32 main parameters after every update, and an exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.runtime.precision import native_bf16, native_bf16_reason
from megatron_wedlm.training.loop import bf16_enabled, precision_name
from megatron_wedlm.training.metrics import read_metrics
from test_training import LAUNCH_TIMEOUT, TINY, TINY_SFT, _base, _train, data  # noqa: F401  (data: the fixture)

STEPS = 12


def _main_and_model_params(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 main parameter, bf16 model parameter) pairs of this rank's shard of the
    distributed optimizer (Megatron's ``shard_fp32_from_float16_groups`` and the model
    parameter ranges they were cut from)."""
    pairs = []
    for opt in engine.optimizer.chained_optimizers:
        for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                param_range = opt._get_model_param_range_map(model_param)["param"]
                pairs.append((main_param, model_param.detach().view(-1)[param_range.start:param_range.end]))
    return pairs


def bf16_worker(data_dir: str, root: str) -> dict:
    from megatron_wedlm.training.loop import result_dict, run_training
    from megatron_wedlm.training.megatron_engine import MegatronEngine

    out = Path(root)
    fp32 = _train(str(TINY), [*_base(data_dir, out / "fp32"), f"trainer.train_steps={STEPS}"])
    cfg = load_config(str(TINY), [*_base(data_dir, out / "bf16"), f"trainer.train_steps={STEPS}",
                                  "trainer.precision=bf16", "checkpointing.save_interval=6", "checkpointing.keep_last=0"])
    built = []

    class Kept(MegatronEngine):  # the engine run_training builds, kept for its model and optimizer
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    bf16 = result_dict(run_training(cfg, Kept))
    engine = built[0]
    pairs = _main_and_model_params(engine)
    resumed = _train(str(TINY), [*_base(data_dir, out / "resumed"), f"trainer.train_steps={STEPS}",
                                 "trainer.precision=bf16", "checkpointing.save_interval=0",
                                 f"checkpointing.resume={out / 'bf16' / 'checkpoints' / 'iter_0000006'}"])
    return {
        "fp32": fp32, "bf16": bf16, "resumed": resumed,
        "model_dtypes": sorted({str(p.dtype) for chunk in engine.model for p in chunk.parameters()}),
        "main_dtypes": sorted({str(main.dtype) for main, _ in pairs}),
        "main_elements": sum(main.numel() for main, _ in pairs),
        "weights_are_rounded_main": all(torch.equal(main.to(torch.bfloat16), model) for main, model in pairs),
        "main_off_bf16_grid": sum(int((main != main.to(torch.bfloat16).float()).sum()) for main, _ in pairs),
    }


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("bf16")
    return run_distributed(bf16_worker, 2, data["pretrain"], str(root), timeout_s=LAUNCH_TIMEOUT)[0], root


def test_bf16_on_cpu_tracks_the_fp32_run(runs):
    result, _ = runs
    fp32, bf16 = result["fp32"]["losses"], result["bf16"]["losses"]
    assert sorted(bf16) == sorted(fp32) == list(range(1, STEPS + 1))
    # same data, same init: the two runs differ only by bf16 rounding, which grows with the steps
    for step in range(1, STEPS + 1):
        assert abs(bf16[step] - fp32[step]) <= 0.02 * fp32[step], (step, bf16[step], fp32[step])
    assert bf16[1] != fp32[1]  # the bf16 run did compute in bf16
    assert sum(bf16[s] for s in range(STEPS - 2, STEPS + 1)) < sum(bf16[s] for s in range(1, 4)) - 1.0


def test_bf16_weights_are_the_rounded_fp32_main_parameters(runs):
    result, _ = runs
    assert result["model_dtypes"] == ["torch.bfloat16"] and result["main_dtypes"] == ["torch.float32"]
    assert result["main_elements"] > 0
    assert result["weights_are_rounded_main"]
    # the main parameters keep what bf16 cannot hold: updates below a weight's bf16 spacing
    # accumulate there instead of being lost
    assert result["main_off_bf16_grid"] > result["main_elements"] // 2


def test_bf16_resume_from_a_checkpoint_continues_exactly(runs):
    result, root = runs
    assert result["resumed"]["start_step"] == 6 and result["resumed"]["final_step"] == STEPS
    straight = result["bf16"]["losses"]
    assert [result["resumed"]["losses"][s] for s in range(7, STEPS + 1)] == [straight[s] for s in range(7, STEPS + 1)]
    first = read_metrics(root / "bf16")[0]
    assert first["step"] == 1


def test_precision_rules():
    cpu = torch.device("cpu")
    cfg = load_config(str(TINY), ["trainer.precision=auto"])
    assert bf16_enabled(cfg, cpu) is False
    cfg = load_config(str(TINY), ["trainer.precision=bf16"])
    assert bf16_enabled(cfg, cpu) is True
    name = precision_name(True, cpu)
    assert name.startswith("bf16") and (("native: " in name) == native_bf16(cpu))
    assert precision_name(False, cpu) == "fp32"
    # the DeepSpeed engine has no CPU bf16 path: refused, naming what to use
    cfg = load_config(str(TINY_SFT), ["trainer.precision=bf16", "trainer.backend=deepspeed"])
    with pytest.raises(ConfigError, match="Megatron engine"):
        bf16_enabled(cfg, cpu)


def test_native_bf16_follows_the_cpu_flags():
    flags = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_bf16(torch.device("cpu")) == flags
    assert native_bf16_reason(torch.device("meta")) is None
