"""``trainer.backend=deepspeed`` end to end on CPU: real gloo processes, DeepSpeed's CPU accelerator.

One HF checkpoint (tiny Qwen3 whose tokenizer has no mask token, so the data adds one) and one
SFT dataset serve every run. Process launches dominate the cost (imports), so runs are grouped
as phases inside two launches:

* 1 rank: the Megatron path (``run_training`` on the HF -> Megatron conversion of the same
  checkpoint) and the DeepSpeed path, same config, 4 steps each;
* 2 ranks: ZeRO-2 (checkpoints at 2 and 4), ZeRO-2 stopped at step 2 and resumed, ZeRO-3, ZeRO-1.

Everything is fp32, so "the same" below means equal to float32 rounding. Gradient norms are
compared as well as losses: Adam and clipping hide a gradient that is off by a constant factor
from the losses, not from the norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.eval.builtin_tasks import training_pairs
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.testing.checkpoint_files import safetensors_of
from megatron_wedlm.testing.tiny_models import TinyShape, build_tiny_ar_tokenizer, build_tiny_causal_lm
from megatron_wedlm.training.metrics import REQUIRED_KEYS, read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = {"DS_ACCELERATOR": "cpu"}
LAUNCH_TIMEOUT = 420
STEPS = 4
RTOL = 2e-6


def _common(data: dict[str, str]) -> list[str]:
    return [
        f"data.path={data['sft']}", "trainer.task=sft", f"trainer.train_steps={STEPS}", "trainer.device=cpu",
        "data.seq_length=128", "data.micro_batch_size=1", "data.global_batch_size=4", "data.num_workers=0",
        "data.num_streams=4", "wedlm.block_size=8", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
        "optimizer.warmup_steps=1", "logging.progress_bar=false", "model.attention_backend=dense",
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    from megatron_wedlm.conversion import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("ds-data")
    made = make_sft_data(root)
    convert_hf_to_megatron(root / "hf", root / "megatron")
    return {**made, "megatron": str(root / "megatron")}


def make_sft_data(root: Path) -> dict[str, str]:
    """A tiny HF checkpoint (Qwen3, its tokenizer without a mask token) and SFT data prepared with it."""
    tokenizer = build_tiny_ar_tokenizer()
    model = build_tiny_causal_lm("qwen3", TinyShape(num_kv_heads=2, head_dim=16), vocab_size=len(tokenizer),
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    with open(root / "pairs.jsonl", "w") as handle:
        for prompt, completion in training_pairs(64, seed=1):
            handle.write(json.dumps({"prompt": prompt, "response": completion}) + "\n")
    prepare_dataset([root / "pairs.jsonl"], root / "sft", root / "hf",
                    PrepareOptions(task="sft", raw_sft=True, samples_per_shard=8))
    with open(root / "held-out.jsonl", "w") as handle:
        for prompt, completion in training_pairs(16, seed=3):
            handle.write(json.dumps({"prompt": prompt, "response": completion}) + "\n")
    prepare_dataset([root / "held-out.jsonl"], root / "sft-valid", root / "hf",
                    PrepareOptions(task="sft", raw_sft=True, samples_per_shard=8))
    return {"root": str(root), "hf": str(root / "hf"), "sft": str(root / "sft"), "valid": str(root / "sft-valid")}


def _validation(data: dict[str, str]) -> list[str]:
    """Validate every 2 steps (at 2 and 4) on one global batch of held-out rows."""
    return [f"data.valid_path={data['valid']}", "trainer.eval_interval=2", "trainer.eval_iters=1"]


# --------------------------------------------------------------------------------------------
# Workers (module level: spawned ranks import them by name)
# --------------------------------------------------------------------------------------------


def one_rank_worker(common: list[str], data: dict[str, str], out: str) -> None:
    from megatron_wedlm.config import load_config
    from megatron_wedlm.deepspeed_backend import run_deepspeed_sft
    from megatron_wedlm.runtime.parallel import destroy_parallel_state
    from megatron_wedlm.training.loop import run_training

    modes = (("", "wedlm.enabled=true"), ("-ar", "wedlm.enabled=false"))
    for name, mode in modes:
        run_training(load_config(None, [*common, *_validation(data), mode, f"model.init_from={data['megatron']}",
                                        f"trainer.output_dir={out}/megatron{name}", "checkpointing.save_at_end=false"]))
        destroy_parallel_state()  # also ends the process group; DeepSpeed runs keep theirs, so they go last
    for name, mode in modes:
        run_deepspeed_sft(load_config(None, [
            *common, *_validation(data), mode, "trainer.backend=deepspeed", f"model.init_from={data['hf']}",
            f"trainer.output_dir={out}/ds1{name}", "checkpointing.save_at_end=false",
        ]))


def cpu_adam_ready() -> bool:
    """DeepSpeed's CPU Adam (optimizer offload) is prebuilt or already JIT-built (a cold build takes minutes)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    package = Path(spec.origin).parent if spec and spec.origin else None
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    prebuilt = package is not None and any((package / "ops").glob("**/cpu_adam*.so"))
    return prebuilt or any(cache.glob("**/cpu_adam/cpu_adam*.so"))


def two_rank_worker(common: list[str], data: dict[str, str], out: str, offload: bool) -> dict[str, str]:
    from megatron_wedlm.config import load_config
    from megatron_wedlm.deepspeed_backend import run_deepspeed_sft
    from megatron_wedlm.training.loop import NonFiniteLossError
    from megatron_wedlm.training.objective import Objective

    def run(name: str, *extra: str):
        return run_deepspeed_sft(load_config(None, [
            *common, "trainer.backend=deepspeed", f"model.init_from={data['hf']}", f"trainer.output_dir={out}/{name}",
            *extra,
        ]))

    validation = _validation(data)
    run("zero2", *validation, "deepspeed.zero_stage=2", "checkpointing.save_interval=2", "checkpointing.keep_last=3")
    run("resumed", *validation, "deepspeed.zero_stage=2", "trainer.exit_at_step=2", "deepspeed.export_hf=false")
    run("resumed", *validation, "deepspeed.zero_stage=2", "checkpointing.resume=auto")
    run("zero3", *validation, "deepspeed.zero_stage=3", "checkpointing.save_at_end=false")
    run("zero1", *validation, "deepspeed.zero_stage=1", "checkpointing.save_at_end=false")
    if offload:
        run("zero3-offload", *validation, "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
            "deepspeed.offload_params=cpu", "checkpointing.save_at_end=false")

    # Non-finite steps: poison the objective of chosen optimizer steps (2 micro-batches per rank).
    honest, calls = Objective.contribution, [0]

    def poisoned(self, per_slot, batch, normalizer):
        total, loss = honest(self, per_slot, batch, normalizer)
        calls[0] += 1
        step = (calls[0] - 1) // 2 + 1
        return (total * float("nan"), loss) if step in poisoned.bad_steps else (total, loss)

    Objective.contribution = poisoned
    outcome = {}
    try:
        poisoned.bad_steps = (2,)
        run("nonfinite", "checkpointing.save_at_end=false")
        calls[0], poisoned.bad_steps = 0, (1, 2, 3, 4)
        try:
            run("nonfinite-stop", "checkpointing.save_at_end=false", "trainer.max_consecutive_nonfinite=2")
        except NonFiniteLossError as err:
            outcome["stopped"] = str(err)
    finally:
        Objective.contribution = honest
    return outcome


@pytest.fixture(scope="module")
def one_rank(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds-one-rank")
    run_distributed(one_rank_worker, 1, _common(data), data, str(out), env=ENV, timeout_s=LAUNCH_TIMEOUT)
    return out


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds-two-ranks")
    outcomes = run_distributed(two_rank_worker, 2, _common(data), data, str(out), cpu_adam_ready(), env=ENV,
                               timeout_s=LAUNCH_TIMEOUT)
    (out / "outcome.json").write_text(json.dumps(outcomes[0]))
    return out


def _history(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir)}


def _valid_history(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


def _assert_same_run(run: Path, reference: Path, keys=("loss", "mlm_loss", "ar_loss", "grad_norm")) -> None:
    """Every logged number of ``run`` equals ``reference``'s, the validation curve included (both
    validate after steps 2 and 4: the training after a validation shows it changed no state)."""
    for key in keys:
        got, want = _history(run, key), _history(reference, key)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (key, got, want)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=RTOL), f"{run.name} {key} at step {step}"
    for key in ("lr", "masked_tokens", "ar_tokens", "tokens"):
        assert _history(run, key) == _history(reference, key), key
    for key in ("valid/loss", "valid/mlm_loss", "valid/ar_loss"):
        got, want = _valid_history(run, key), _valid_history(reference, key)
        assert sorted(got) == sorted(want) == [2, 4], (key, got, want)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=RTOL), f"{run.name} {key} at step {step}"
    for key in ("valid/masked_tokens", "valid/ar_tokens", "valid/tokens"):
        assert _valid_history(run, key) == _valid_history(reference, key), key


# --------------------------------------------------------------------------------------------
# The two backends, data parallelism, ZeRO stages
# --------------------------------------------------------------------------------------------


def test_deepspeed_and_megatron_backends_train_alike_from_the_same_checkpoint(one_rank):
    """Megatron on the converted weights vs DeepSpeed on the HF directory: every logged number."""
    _assert_same_run(one_rank / "ds1", one_rank / "megatron")
    records = read_metrics(one_rank / "ds1")
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    assert records[0]["lr"] == 0.0 and records[1]["lr"] == pytest.approx(1e-3)  # Megatron's warmup convention


def test_ar_mode_trains_alike_on_both_backends(one_rank):
    """wedlm.enabled=false: memory-stream rows, next-token loss only."""
    _assert_same_run(one_rank / "ds1-ar", one_rank / "megatron-ar")
    assert all(r["masked_tokens"] == 0 and r["loss"] == r["ar_loss"] for r in read_metrics(one_rank / "ds1-ar"))
    validated = [r for r in read_metrics(one_rank / "ds1-ar") if "valid/loss" in r]
    assert validated and all(r["valid/masked_tokens"] == 0 and r["valid/loss"] == r["valid/ar_loss"] for r in validated)


def test_zero2_on_two_ranks_equals_one_rank_with_the_same_global_batch(one_rank, two_ranks):
    _assert_same_run(two_ranks / "zero2", one_rank / "ds1")


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_zero1_and_zero3_equal_zero2(two_ranks, stage):
    _assert_same_run(two_ranks / stage, two_ranks / "zero2")


def test_zero3_with_optimizer_and_parameter_offload_equals_zero2(two_ranks):
    if not (two_ranks / "zero3-offload").exists():
        pytest.skip("DeepSpeed's CPU Adam is not built (DS_BUILD_CPU_ADAM=1 pip install deepspeed, or one JIT build)")
    _assert_same_run(two_ranks / "zero3-offload", two_ranks / "zero2")


# --------------------------------------------------------------------------------------------
# Checkpoints, resume, HF export
# --------------------------------------------------------------------------------------------


def test_stop_and_resume_reproduces_the_uninterrupted_losses(two_ranks):
    resumed = two_ranks / "resumed"
    _assert_same_run(resumed, two_ranks / "zero2", keys=("loss", "mlm_loss", "ar_loss", "grad_norm"))
    state = json.loads((resumed / "checkpoints" / "iter_0000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["layout"] == {"backend": "deepspeed", "world_size": 2}
    assert state["data"]["rows_consumed"] == 8 and state["scheduler"]["num_steps"] == 2
    assert not (resumed / "checkpoints" / "iter_0000002" / "hf").exists()  # export_hf=false for that run


def test_checkpoints_hold_deepspeed_states_and_hf_exports(two_ranks):
    ckpts = two_ranks / "zero2" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004"]
    for step in ("iter_0000002", "iter_0000004"):
        ckpt = ckpts / step
        assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
        shards = sorted(p.name for p in (ckpt / "deepspeed").iterdir())
        assert "mp_rank_00_model_states.pt" in shards and sum("optim_states" in s for s in shards) == 2
        assert json.loads((ckpt / "hf" / "config.json").read_text())["mask_token_id"] == 400


def test_hf_export_holds_the_trained_weights_loads_and_decodes(two_ranks, data):
    from transformers import AutoTokenizer

    from megatron_wedlm.decoding import generate, load_wedlm_model

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    final = two_ranks / "zero2" / "hf"
    exported = safetensors_of(final)
    trained = get_fp32_state_dict_from_zero_checkpoint(str(two_ranks / "zero2" / "checkpoints" / "iter_0000004"),
                                                       tag="deepspeed")
    trained = {k.removeprefix("hf_model."): v for k, v in trained.items()}
    assert sorted(exported) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
    source = safetensors_of(Path(data["hf"]))
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], source["model.layers.0.mlp.up_proj.weight"])
    assert exported["model.embed_tokens.weight"].shape == (512, 32)  # 400 tokens + mask, padded to 128
    zero3 = safetensors_of(two_ranks / "zero3" / "hf")  # gathered from ZeRO-3 partitions
    for name, tensor in exported.items():
        torch.testing.assert_close(zero3[name], tensor, rtol=0, atol=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.mask_token_id == 400
    model = load_wedlm_model(final, device="cpu")
    assert model.config.mask_token_id == 400
    prompt = tokenizer("Count from 3 to 12:")["input_ids"]
    result = generate(model, prompt, method="streaming", window_size=4, max_new_tokens=12)
    assert len(result.token_ids) == 12 and result.num_forwards >= 1
    model.load_state_dict(trained, strict=False)  # the checkpoint's own weights decode the same
    assert generate(model, prompt, method="streaming", window_size=4, max_new_tokens=12).token_ids == result.token_ids


def test_a_non_finite_step_is_skipped_and_too_many_stop_the_run(two_ranks):
    records = {r["step"]: r for r in read_metrics(two_ranks / "nonfinite")}
    clean = {r["step"]: r for r in read_metrics(two_ranks / "zero2")}
    assert [s for s, r in records.items() if r["skipped"]] == [2]
    assert records[2]["grad_norm"] == "nan"  # a string: NaN is not JSON
    for step in (1, 2):  # the poison reaches the gradients only; the reported loss is the true one
        assert records[step]["loss"] == pytest.approx(clean[step]["loss"], rel=RTOL)
    # the skipped step does not advance the schedule: it runs one step behind from then on
    assert records[3]["lr"] == records[2]["lr"] == clean[2]["lr"] and records[4]["lr"] == clean[3]["lr"]
    assert all(isinstance(records[s]["loss"], float) for s in (3, 4))
    stopped = json.loads((two_ranks / "outcome.json").read_text())["stopped"]
    assert "2 consecutive steps (last: 2)" in stopped
    assert [r["step"] for r in read_metrics(two_ranks / "nonfinite-stop")] == [1, 2]


# --------------------------------------------------------------------------------------------
# The engine contract: the loop decides whether a step's update is applied, on both engines
# --------------------------------------------------------------------------------------------


def _watched(engine_class):
    """``engine_class`` recording, per optimizer step, whether the loop asked for the update and
    whether the weights or the optimizer state changed across it."""

    class Watched(engine_class):
        steps: list[dict] = []

        def _torch_optimizer(self):
            return self.base_optimizer if hasattr(self, "base_optimizer") else self.optimizer.optimizer

        def _snapshot(self) -> list[torch.Tensor]:
            module = self.engine.module if hasattr(self, "engine") and self.engine is not None else None
            params = list(module.parameters()) if module is not None else [p for c in self.model for p in c.parameters()]
            # ZeRO-3 keeps each parameter's shard in ds_tensor
            tensors = [getattr(p, "ds_tensor", p).detach().clone() for p in params]
            for state in self._torch_optimizer().state.values():
                tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
            return tensors

        def optimizer_step(self, apply):
            before = self._snapshot()
            update = super().optimizer_step(apply)
            after = self._snapshot()
            changed = len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after))
            Watched.steps.append({"apply": apply, "applied": update.applied, "changed": changed})
            return update

    return Watched


def contract_worker(common: list[str], data: dict[str, str], out: str, names: list[str]) -> dict[str, list[dict]]:
    """The engines of ``names`` with two poisoned steps: at step 2 a NaN gradient (every micro-batch's
    differentiated loss), at step 3 a NaN logged loss with finite gradients, which no optimizer
    overflow check can see."""
    import math

    from megatron_wedlm.config import load_config
    from megatron_wedlm.deepspeed_backend.engine import DeepSpeedEngine
    from megatron_wedlm.training.loop import run_training
    from megatron_wedlm.training.megatron_engine import MegatronEngine
    from megatron_wedlm.training.objective import Objective

    honest_contribution, honest_logged = Objective.contribution, Objective.logged_loss
    calls = {"contribution": 0, "logged": 0}

    def poisoned_contribution(self, per_slot, batch, normalizer):
        total, loss = honest_contribution(self, per_slot, batch, normalizer)
        calls["contribution"] += 1
        step = (calls["contribution"] - 1) // 2 + 1  # 2 micro-batches per rank and step
        return (total * float("nan"), loss) if step == 2 else (total, loss)

    def poisoned_logged(self, summary):
        calls["logged"] += 1  # once per step, on the rank that reports
        return math.nan if calls["logged"] == 3 else honest_logged(self, summary)

    Objective.contribution, Objective.logged_loss = poisoned_contribution, poisoned_logged
    runs = {
        "megatron": (MegatronEngine, [f"model.init_from={data['megatron']}"]),
        "zero2": (DeepSpeedEngine, ["trainer.backend=deepspeed", f"model.init_from={data['hf']}",
                                    "deepspeed.zero_stage=2", "deepspeed.export_hf=false"]),
        "zero3": (DeepSpeedEngine, ["trainer.backend=deepspeed", f"model.init_from={data['hf']}",
                                    "deepspeed.zero_stage=3", "deepspeed.export_hf=false"]),
    }
    seen = {}
    try:
        for name in names:
            engine_class, extra = runs[name]
            calls.update(contribution=0, logged=0)
            cfg = load_config(None, [*common, *extra, f"trainer.output_dir={out}/{name}",
                                     "checkpointing.save_at_end=false"])
            watched = _watched(engine_class)
            watched.steps = []
            run_training(cfg, watched)
            seen[name] = watched.steps
    finally:
        Objective.contribution, Objective.logged_loss = honest_contribution, honest_logged
    return seen


def test_a_non_finite_step_leaves_weights_and_optimizer_state_unchanged_on_both_engines(data, tmp_path):
    # one launch per engine: a DeepSpeed run keeps the process group the Megatron run would end
    launches = [["megatron"], ["zero2", "zero3"]]
    by_rank = [run_distributed(contract_worker, 2, _common(data), data, str(tmp_path), names, env=ENV,
                               timeout_s=LAUNCH_TIMEOUT) for names in launches]
    for rank in range(2):
        seen = {**by_rank[0][rank], **by_rank[1][rank]}
        assert sorted(seen) == ["megatron", "zero2", "zero3"]
        for name, steps in seen.items():
            assert [s["apply"] for s in steps] == [True, False, False, True], (rank, name, steps)
            # the clean steps change the weights (the check can fail); the poisoned ones do not
            assert [s["changed"] for s in steps] == [True, False, False, True], (rank, name, steps)
            assert [s["applied"] for s in steps] == [True, False, False, True], (rank, name, steps)
    for name in ("megatron", "zero2", "zero3"):
        assert [r["step"] for r in read_metrics(tmp_path / name) if r["skipped"]] == [2, 3], name


# --------------------------------------------------------------------------------------------
# Command line and config checks (in process, nothing is launched)
# --------------------------------------------------------------------------------------------


TINY_DS = ROOT / "configs" / "sft" / "tiny_cpu_deepspeed.yaml"


def _sft_command(args: list[str], torchrun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ENV}
    env.pop("MEGATRON_WEDLM_CPU", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if torchrun \
        else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "sft" / "sft_wedlm.py"), *args], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT, env=env, cwd=ROOT)


def test_sft_entry_point_trains_with_deepspeed_under_torchrun(data, two_ranks, tmp_path):
    """The user's command: the YAML selects the backend; step 1 (lr 0) sees the same data and weights."""
    out = tmp_path / "cli"
    proc = _sft_command(["--config", str(TINY_DS), f"model.init_from={data['hf']}", f"data.path={data['sft']}",
                         f"trainer.output_dir={out}", "trainer.train_steps=3", "checkpointing.save_interval=0",
                         "logging.progress_bar=false", "--result-json", str(tmp_path / "result.json")], torchrun=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DeepSpeed ZeRO-2" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 3 and result["checkpoints"] == [str(out / "checkpoints" / "iter_0000003")]
    assert _history(out, "loss")[1] == pytest.approx(_history(two_ranks / "zero2", "loss")[1], rel=RTOL)
    assert json.loads((out / "hf" / "config.json").read_text())["mask_token_id"] == 400


def test_sft_entry_point_checks_the_deepspeed_config_before_starting(capsys):
    from megatron_wedlm.deepspeed_backend.cli import main

    proc = _sft_command(["--config", str(TINY_DS), "--print-config", "deepspeed.zero_stage=3"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zero_stage: 3" in proc.stdout and "backend: deepspeed" in proc.stdout
    proc = _sft_command(["--config", str(ROOT / "configs" / "sft" / "tiny_cpu.yaml"), "trainer.backend=deepspeed"])
    assert proc.returncode == 2 and "model.init_from must name a HF model directory" in proc.stderr
    for override, message in (
        ("parallelism.tp=2", "parallelism.tp"),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
        ("deepspeed.offload_params=cpu", "deepspeed.offload_params"),
        ("model.num_layers=3", "model.num_layers"),
        ("deepspeed.zero_stag=3", "unknown config key 'deepspeed.zero_stag'"),
    ):
        assert main(["--config", str(TINY_DS), override]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bf16 + FlexAttention BlockMask path)")
def test_gpu_bf16_flex_run_follows_the_cpu_fp32_run(data, one_rank, tmp_path):
    """On a GPU: bf16 weights, FlexAttention with the WeDLM BlockMask; losses track the fp32 CPU run."""
    common = [c for c in _common(data) if not c.startswith(("trainer.device", "model.attention_backend"))]
    run_distributed(_gpu_worker, 1, common, data, str(tmp_path), env={"DS_ACCELERATOR": "cuda"},
                    timeout_s=LAUNCH_TIMEOUT)
    got, want = _history(tmp_path / "gpu", "loss"), _history(one_rank / "ds1", "loss")
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=3e-2)


def _gpu_worker(common: list[str], data: dict[str, str], out: str) -> None:
    from megatron_wedlm.config import load_config
    from megatron_wedlm.deepspeed_backend import run_deepspeed_sft

    run_deepspeed_sft(load_config(None, [
        *common, "trainer.backend=deepspeed", f"model.init_from={data['hf']}", f"trainer.output_dir={out}/gpu",
        "trainer.device=cuda", "trainer.precision=bf16", "model.attention_backend=flex", "deepspeed.zero_stage=3",
        "parallelism.recompute=full", "checkpointing.save_at_end=false",
    ]))
