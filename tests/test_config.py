"""Training config: schema + YAML + CLI overrides; typos and bad values fail fast, naming the key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_wedlm.config import (
    ConfigError, check_data_files, config_from_yaml_text, config_to_yaml, load_config, validate_layout,
)
from megatron_wedlm.deepspeed_backend.settings import validate_deepspeed_run
from megatron_wedlm.quickstart import pipeline
from megatron_wedlm.quickstart.pipeline import precision_overrides, stage_precision
from megatron_wedlm.quickstart.settings import PRESETS, load_settings, preset_path, stages_of
from megatron_wedlm.runtime.precision import native_bf16

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"
SHIPPED = sorted((ROOT / "configs" / "pretrain").glob("*.yaml")) + sorted((ROOT / "configs" / "sft").glob("*.yaml"))


def test_yaml_then_overrides_take_precedence():
    cfg = load_config(TINY, ["optimizer.lr=5e-3", "logging.wandb.tags=[a,b]", "parallelism.tp=2"])
    assert cfg.optimizer.lr == 5e-3
    assert cfg.logging.wandb.tags == ["a", "b"]
    assert cfg.parallelism.tp == 2
    assert cfg.model.hidden_size == 64  # from the YAML
    assert cfg.optimizer.adam_beta1 == 0.9  # schema default


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.hiden_size=32", "model.hiden_size"),
        ("optimiser.lr=1e-3", "optimiser"),
        ("logging.wandb.projct=x", "logging.wandb.projct"),
    ],
)
def test_unknown_override_key_is_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY, [override])


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        load_config(TINY, ["model.hiden_size=32"])
    with pytest.raises(ConfigError, match="did you mean 'deepspeed.zero_stage'"):
        load_config(TINY, ["deepspeed.zero_stag=3"])


def test_unknown_yaml_key_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("  block_size: 8", "  blok_size: 8"))
    with pytest.raises(ConfigError, match=r"bad\.yaml.*wedlm\.blok_size"):
        load_config(bad)


@pytest.mark.parametrize(
    "override, named",
    [
        ("optimizer.lr=fast", "optimizer.lr"),
        ("trainer.train_steps=1.5", "trainer.train_steps"),
        ("wedlm.enabled=maybe", "wedlm.enabled"),
    ],
)
def test_wrong_type_is_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY, [override])


@pytest.mark.parametrize(
    "override, named",
    [
        ("wedlm.ratio_mode=token", "wedlm.ratio_mode"),
        ("optimizer.decay_style=cosin", "optimizer.decay_style"),
        ("data.seq_length=8", "data.seq_length"),
        ("optimizer.min_lr=1.0", "optimizer.min_lr"),
        ("parallelism.sequence_parallel=true", "parallelism.sequence_parallel"),
        ("trainer.exit_at_step=99", "trainer.exit_at_step"),
        ("data.global_batch_size=7", "data.global_batch_size"),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
        ("deepspeed.offload_optimizer=nvme", "deepspeed.offload_optimizer"),
        ("deepspeed.offload_params=cpu", "deepspeed.offload_params"),
        ("trainer.eval_interval=0", "trainer.eval_interval"),
        ("trainer.eval_iters=0", "trainer.eval_iters"),
    ],
)
def test_invalid_values_are_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY, [override])


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(TINY, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TINY.with_name("nope.yaml"))


def test_model_from_scratch_needs_architecture():
    with pytest.raises(ConfigError, match="model.num_layers"):
        load_config(None, ["data.path=/x", "model.architecture=qwen2"])


def test_layout_checks_name_the_keys():
    cfg = load_config(TINY, ["parallelism.tp=2"])
    assert validate_layout(cfg, 4) == 2
    with pytest.raises(ConfigError, match="parallelism.tp"):
        validate_layout(cfg, 3)
    with pytest.raises(ConfigError, match="data.num_streams"):
        validate_layout(load_config(TINY, ["data.num_streams=3"]), 2)
    with pytest.raises(ConfigError, match="parallelism.dp"):
        validate_layout(load_config(TINY, ["parallelism.dp=1"]), 2)


TINY_MOE = TINY.with_name("tiny_moe_cpu.yaml")


@pytest.mark.parametrize(
    "config, overrides, named",
    [
        ("dense", ["parallelism.ep=2"], "parallelism.ep"),  # a dense model has no experts to split
        ("moe", ["parallelism.tp=2"], "parallelism.sequence_parallel"),  # Megatron routes per SP shard
        ("moe", ["parallelism.ep=3"], "model.num_experts"),
        ("moe", ["model.moe_load_balancing=sinkhorn"], "model.moe_load_balancing"),
        ("moe", ["model.moe_capacity_factor=0"], "model.moe_capacity_factor"),
        ("moe", ["trainer.backend=deepspeed"], "trainer.backend"),
    ],
)
def test_moe_keys_are_checked_naming_the_key(config, overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(TINY_MOE if config == "moe" else TINY, overrides)


def test_moe_layout_needs_ep_x_etp_to_divide_a_stage():
    cfg = load_config(TINY_MOE, ["parallelism.ep=4"])
    assert validate_layout(cfg, 4) == 4  # experts over 4 of the 4 data-parallel ranks
    with pytest.raises(ConfigError, match="parallelism.ep"):
        validate_layout(cfg, 2)
    cfg = load_config(TINY_MOE, ["parallelism.tp=2", "parallelism.sequence_parallel=true", "parallelism.ep=2"])
    assert validate_layout(cfg, 4) == 2  # ep 2 x etp 2 (= tp) fill the stage's 4 ranks
    with pytest.raises(ConfigError, match="etp"):
        validate_layout(cfg, 2)


def test_resolved_config_round_trips():
    cfg = load_config(TINY, ["optimizer.lr=2e-3", "logging.wandb.tags=[x]"])
    again = config_from_yaml_text(config_to_yaml(cfg))
    assert again == cfg


@pytest.mark.parametrize("path", SHIPPED, ids=[f"{p.parent.name}/{p.name}" for p in SHIPPED])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.trainer.task == path.parent.name
    assert (cfg.trainer.backend == "deepspeed") == ("deepspeed" in path.name)
    if cfg.trainer.backend == "deepspeed":
        validate_deepspeed_run(cfg)
    first_gpu_run = path.name in ("qwen3_0.6b.yaml", "llama3.2_1b.yaml")  # one node of 8 GPUs
    if "qwen" in path.name or first_gpu_run:  # the paper's method settings
        assert cfg.wedlm.enabled and cfg.wedlm.block_size == 32
        assert cfg.optimizer.decay_style == "cosine"
        assert cfg.wedlm.ar_weight > 0
        assert cfg.trainer.precision == "auto"
    if "qwen" in path.name and not first_gpu_run:  # the paper's lr (8B); smaller models take larger steps
        assert cfg.optimizer.lr == 3e-6 and cfg.optimizer.min_lr == 3e-7
    if first_gpu_run:
        assert validate_layout(cfg, 8) == 8 // (cfg.parallelism.tp * cfg.parallelism.pp * cfg.parallelism.cp)


@pytest.mark.parametrize("preset", PRESETS)
def test_quickstart_presets_and_their_training_configs_load(preset):
    """The full preset never runs in CI, so a typo in it would only show on a user's machine."""
    settings = load_settings(preset_path(preset))
    for stage in stages_of(settings):
        task = "sft" if stage == "sft" else "pretrain"
        # what the quickstart adds on the command line: its shards, and the previous stage's (or the
        # converted) checkpoint
        overrides = ["data.path=shards"] + ([] if stage == "ar_pretrain" else ["model.init_from=checkpoint"])
        cfg = load_config(ROOT / getattr(settings, stage).config, overrides, defaults={"trainer": {"task": task}})
        assert cfg.wedlm.enabled == (stage != "ar_pretrain"), stage
        assert cfg.trainer.device == "cpu" and cfg.trainer.train_steps > 0, stage


@pytest.mark.parametrize("section, key, value, message", [
    ("eval", "calibration_tolerance", -0.01, r"eval.calibration_tolerance is a fraction in \[0, 1\)"),
    ("eval", "calibration_tolerance", 1.5, r"eval.calibration_tolerance is a fraction in \[0, 1\)"),
    ("eval", "calibration_min_gain", -0.1, r"eval.calibration_min_gain is a fraction >= 0"),
    ("sft", "precision", "fp16", r"sft.precision must be one of config, fp32, bf16, native, got 'fp16'"),
    ("eval", "precision", "config", r"eval.precision must be one of fp32, bf16, native, got 'config'"),
    ("eval", "stop_fill", "early", r"eval.stop_fill must be one of anywhere, contiguous, got 'early'"),
    ("eval", "tasks", ["counting", "copying", "sorting"], r"eval.tasks \['sorting'\] are not built-in tasks"),
    ("eval", "calibration_examples", 71, r"eval.calibration_examples is 71, but counting has only 70 calibration "
                                         r"prompts: use at most 70"),
    ("eval", "num_examples", 114, r"eval.num_examples is 114, but counting has only 113 test prompts"),
    ("sft", "fp32_train_steps", 100, r"sft.fp32_train_steps is the step count for when precision 'native' falls "
                                     r"back to fp32: .* got 100 with precision 'config'"),
])
def test_quickstart_settings_refuse_values_out_of_range_naming_the_file(tmp_path, section, key, value, message):
    data = yaml.safe_load(preset_path("ci").read_text())
    data.setdefault(section, {})[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=message) as err:
        load_settings(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("setting, wanted", [("config", None), ("fp32", "fp32"), ("bf16", "bf16")])
def test_stage_precision_is_passed_as_the_preset_says(setting, wanted):
    assert stage_precision(setting)[0] == wanted


def test_stage_precision_native_is_bf16_exactly_where_the_cpu_has_bf16_matrix_instructions():
    precision, why = stage_precision("native")
    assert precision == ("bf16" if native_bf16(torch.device("cpu")) else "fp32")
    assert why  # the console says which and why


@pytest.mark.parametrize("native", [True, False])
def test_a_native_stage_trains_its_fp32_step_count_only_where_it_falls_back_to_fp32(monkeypatch, native):
    """A stage sized for bf16 steps would overrun the preset's time on a CPU without native bf16."""
    monkeypatch.setattr(pipeline, "native_bf16_reason", lambda device: "AVX512-BF16" if native else "")
    stage = load_settings(preset_path("smollm")).sft
    assert stage.precision == "native" and stage.fp32_train_steps > 0
    overrides = [o for o, _ in precision_overrides(stage)]
    if native:
        assert overrides == ["trainer.precision=bf16"]
    else:
        assert overrides == ["trainer.precision=fp32", f"trainer.train_steps={stage.fp32_train_steps}"]
    # the config's step count applies with bf16: the fallback count is the smaller one
    cfg = load_config(ROOT / stage.config, ["data.path=shards", "model.init_from=checkpoint"],
                      defaults={"trainer": {"task": "sft"}})
    assert stage.fp32_train_steps < cfg.trainer.train_steps


def test_cli_rejects_a_typo_before_starting(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(TINY), "optimizer.lrr=1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "optimizer.lrr" in proc.stderr and "did you mean 'optimizer.lr'" in proc.stderr


def test_cli_print_config_applies_overrides_and_task(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "sft" / "sft_wedlm.py"), "--config", str(ROOT / "configs/sft/tiny_cpu.yaml"),
         "--print-config", "--resume", "auto", "optimizer.lr=5e-4"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    printed = config_from_yaml_text(proc.stdout)
    assert printed.trainer.task == "sft"
    assert printed.checkpointing.resume == "auto"
    assert printed.optimizer.lr == 5e-4


def test_cli_refuses_a_non_megatron_backend_for_pretraining(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(TINY), "trainer.backend=deepspeed"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2 and "trainer.backend='deepspeed'" in proc.stderr


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """Prepared directories that differ in task, mask token and tokenizer from ``train``."""
    from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
    from megatron_wedlm.testing.tiny_models import build_tiny_ar_tokenizer, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("prepared")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    build_tiny_ar_tokenizer().save_pretrained(str(root / "other-tok"))
    (root / "docs.jsonl").write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    (root / "pairs.jsonl").write_text('{"prompt": "one", "response": "two"}\n')
    out = {name: root / name for name in ("train", "sft", "other-mask", "other-tokenizer")}
    prepare_dataset([root / "docs.jsonl"], out["train"], root / "tok")
    prepare_dataset([root / "pairs.jsonl"], out["sft"], root / "tok", PrepareOptions(task="sft", raw_sft=True))
    prepare_dataset([root / "docs.jsonl"], out["other-tokenizer"], root / "other-tok")
    other = build_tiny_tokenizer()
    other.mask_token = None
    other.save_pretrained(str(root / "tok-no-mask"))
    prepare_dataset([root / "docs.jsonl"], out["other-mask"], root / "tok-no-mask",
                    PrepareOptions(mask_token="<|other_mask|>"))
    return out


def test_validation_defaults():
    cfg = load_config(TINY, [])
    assert (cfg.data.valid_path, cfg.trainer.eval_interval, cfg.trainer.eval_iters) == (None, 1000, 10)


@pytest.mark.parametrize(
    "valid, message",
    [
        ("sft", "holds 'sft' data but this is a pretrain run"),
        ("other-mask", "another tokenizer or mask token"),
        ("other-tokenizer", "another tokenizer"),
    ],
)
def test_valid_path_tokenized_otherwise_than_the_training_data_is_refused_naming_both(prepared, valid, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        check_data_files(load_config(TINY, [f"data.path={prepared['train']}", f"data.valid_path={prepared[valid]}"]))
    assert f"data.valid_path={prepared[valid]}" in str(err.value)
    if valid != "sft":
        assert f"data.path={prepared['train']}" in str(err.value)


def test_valid_path_of_the_same_tokenization_loads_and_a_saved_config_rereads_without_it(prepared, tmp_path):
    cfg = load_config(TINY, [f"data.path={prepared['train']}", f"data.valid_path={prepared['train']}"])
    check_data_files(cfg)
    assert cfg.data.valid_path == str(prepared["train"])
    gone = load_config(TINY, [f"data.path={prepared['train']}", f"data.valid_path={tmp_path / 'moved'}"])
    assert config_from_yaml_text(config_to_yaml(gone)).data.valid_path == str(tmp_path / "moved")


def test_valid_path_auto_reads_the_held_out_part_prepare_data_wrote_and_nothing_without_it(tmp_path):
    """The 8B configs say ``data.valid_path: auto``, so the README's ``--valid-fraction`` split is
    validated on; data prepared without one trains without validation, and the run says so."""
    from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
    from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "document {i} of twenty"}}\n' for i in range(20)))
    prepare_dataset([tmp_path / "docs.jsonl"], tmp_path / "split", tmp_path / "tok", PrepareOptions(valid_fraction=0.3))
    prepare_dataset([tmp_path / "docs.jsonl"], tmp_path / "whole", tmp_path / "tok")
    split = load_config(TINY, [f"data.path={tmp_path / 'split'}", "data.valid_path=auto"])
    assert split.data.valid_path == str(tmp_path / "split" / "valid")
    assert load_config(TINY, [f"data.path={tmp_path / 'whole'}", "data.valid_path=auto"]).data.valid_path is None
    assert config_from_yaml_text(config_to_yaml(split)).data.valid_path == split.data.valid_path  # saved resolved
    for path in ("pretrain/qwen3_8b.yaml", "pretrain/qwen2.5_7b.yaml", "sft/qwen3_8b.yaml"):
        assert yaml.safe_load((ROOT / "configs" / path).read_text())["data"]["valid_path"] == "auto", path


def test_an_online_wandb_run_without_credentials_is_refused_before_it_starts(tmp_path):
    """A batch job would fail inside wandb.init after its queue time; the entry point says what
    to do at once. WANDB_MODE wins over the config, as wandb's users expect, and a netrc entry
    (what `wandb login` writes) or WANDB_API_KEY lets it start."""
    from megatron_wedlm.training.wandb_auth import has_wandb_credentials, wandb_refusal

    cfg = load_config(TINY, ["logging.wandb.enabled=true"])
    bare = {"HOME": str(tmp_path)}
    assert "wandb login" in wandb_refusal(cfg, bare) and "WANDB_MODE=offline" in wandb_refusal(cfg, bare)
    assert wandb_refusal(cfg, {**bare, "WANDB_MODE": "offline"}) is None
    assert wandb_refusal(load_config(TINY, ["logging.wandb.enabled=true", "logging.wandb.mode=offline"]), bare) is None
    assert wandb_refusal(cfg, {**bare, "WANDB_API_KEY": "k" * 40}) is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert has_wandb_credentials(bare) and wandb_refusal(cfg, bare) is None
    assert not has_wandb_credentials({**bare, "WANDB_BASE_URL": "https://wandb.example.com"})  # another host's key

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path / "nobody")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(TINY),
         "logging.wandb.enabled=true", f"trainer.output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 2 and "no W&B credentials" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_reader_never_sees_a_half_written_config_while_the_next_job_rewrites_it(tmp_path):
    """Each job of a chain writes the run's config.yaml as it starts, while ``--follow`` reads it
    every poll: a truncate-and-write showed a reader half a file (9 of 44 reads failed), so the
    evaluation job died between the chain's jobs. The write is a rename; every read parses."""
    import threading
    import time

    from megatron_wedlm.config.loading import save_config

    cfg = load_config(TINY, ["data.path=/data"])
    path = save_config(cfg, tmp_path / "config.yaml")
    stop = threading.Event()
    writes = 0

    def rewrite() -> None:
        nonlocal writes
        while not stop.is_set():
            save_config(cfg, path)
            writes += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    # A count of reads overlapping a count of writes, not a time window: a loaded machine slows
    # both, and the check is that no read in the overlap fails.
    reads, deadline = 0, time.monotonic() + 120
    try:
        while (reads < 40 or writes < 40) and time.monotonic() < deadline:
            assert config_from_yaml_text(path.read_text()) == cfg
            reads += 1
    finally:
        stop.set()
        writer.join()
    assert reads >= 40 and writes >= 40, (reads, writes)
