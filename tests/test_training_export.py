"""A training checkpoint decodes straight from training: a real 4-rank TP2 x PP2 tiny run (gloo
processes), then ``inference/evaluate.py --model`` on its run directory against the same
evaluation of its ``megatron-to-hf`` export, which needs no ``--tokenizer``."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_wedlm.conversion import ConversionError, convert_hf_to_megatron, convert_megatron_to_hf
from megatron_wedlm.runtime.hf_local import tokenizer_files_in
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.training.checkpoint_index import complete_checkpoints
from megatron_wedlm.training.hf_export import TrainingCheckpointError, load_checkpoint, training_checkpoint
from test_conversion import make_hf_dir, safetensors_of
from test_training import LAUNCH_TIMEOUT, ROOT, TINY, _base, _train, data  # noqa: F401


def tp2_pp2_worker(pretrain: str, out: str) -> dict:
    """Three steps at TP=2 x PP=2 (DP=1), a checkpoint after steps 2 and 3."""
    return _train(str(TINY), [*_base(pretrain, Path(out)), "parallelism.tp=2", "parallelism.pp=2",
                              "trainer.train_steps=3", "checkpointing.save_interval=2"])


@pytest.fixture(scope="module")
def tp2_pp2_run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2pp2") / "run"
    run_distributed(tp2_pp2_worker, 4, data["pretrain"], str(out), timeout_s=LAUNCH_TIMEOUT)
    return out


def _evaluate(model: Path, out: Path) -> dict:
    spec = importlib.util.spec_from_file_location("wedlm_evaluate_cli", ROOT / "inference" / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--model", str(model), "--tasks", "counting,copying", "--num-examples", "3",
                     "--methods", "streaming,ar", "--taus", "0.4", "--max-new-tokens", "12", "--device", "cpu",
                     "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "report.json").read_text())


def _generate(model: Path) -> dict:
    spec = importlib.util.spec_from_file_location("wedlm_generate_cli", ROOT / "inference" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli.main(["--model", str(model), "--prompt", "count: 1 2 3", "--max-new-tokens", "10", "--device", "cpu",
                     "--no-stop-at-eos", "--json"])


def _decoded(report: dict) -> tuple[list, list]:
    """What decoding produced, without wall-clock times."""
    counts = [(r["task"], r["method"], r["tau"], r["num_examples"], r["num_correct"], r["generated_tokens"],
               r["forwards"], r["slots"]) for r in report["results"]]
    samples = [(s["task"], s["method"], s["uid"], s["completion"], s["new_tokens"], s["forwards"])
               for s in report["samples"]]
    return counts, samples


def test_checkpoint_carries_the_tokenizer_and_exports_without_one(tp2_pp2_run, tmp_path):
    checkpoints = complete_checkpoints(tp2_pp2_run / "checkpoints")
    assert [step for step, _ in checkpoints] == [2, 3]
    newest = checkpoints[-1][1]
    assert {f.name for f in tokenizer_files_in(newest)} >= {"tokenizer.json", "tokenizer_config.json"}
    convert_megatron_to_hf(newest, tmp_path / "export")  # no tokenizer_dir given
    assert tokenizer_files_in(tmp_path / "export")


def test_convert_checkpoint_exports_a_run_directory_as_its_newest_checkpoint(tp2_pp2_run, tmp_path):
    spec = importlib.util.spec_from_file_location("convert_checkpoint_cli", ROOT / "tools" / "convert_checkpoint.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["megatron-to-hf", "--input", str(tp2_pp2_run), "--output", str(tmp_path / "from_run")]) == 0
    convert_megatron_to_hf(tp2_pp2_run / "checkpoints" / "iter_0000003", tmp_path / "from_iter")
    from_run, from_iter = safetensors_of(tmp_path / "from_run"), safetensors_of(tmp_path / "from_iter")
    assert from_run.keys() == from_iter.keys() and all(torch.equal(from_run[k], from_iter[k]) for k in from_iter)
    assert tokenizer_files_in(tmp_path / "from_run")


def test_tp2_pp2_checkpoint_evaluates_exactly_as_its_hf_export(tp2_pp2_run, tmp_path):
    newest = complete_checkpoints(tp2_pp2_run / "checkpoints")[-1][1]
    assert training_checkpoint(tp2_pp2_run) == newest  # a run directory stands for its newest checkpoint
    convert_megatron_to_hf(newest, tmp_path / "export")
    from_run = _evaluate(tp2_pp2_run, tmp_path / "from_run")
    from_export = _evaluate(tmp_path / "export", tmp_path / "from_export")
    counts, samples = _decoded(from_run)
    assert (counts, samples) == _decoded(from_export)
    assert len(samples) == 2 * 2 * 3 and any(s[4] > 0 for s in samples)


def test_generate_from_an_iteration_directory_equals_generate_from_its_export(tp2_pp2_run, tmp_path):
    newest = complete_checkpoints(tp2_pp2_run / "checkpoints")[-1][1]
    convert_megatron_to_hf(newest, tmp_path / "export")
    from_checkpoint, from_export = _generate(newest), _generate(tmp_path / "export")
    assert len(from_checkpoint["token_ids"]) == 10
    assert (from_checkpoint["token_ids"], from_checkpoint["forwards"]) == (from_export["token_ids"], from_export["forwards"])


def load_in_a_launch_worker(run: str) -> dict[str, torch.Tensor]:
    """A rank of a 2-process launch loads the run's newest checkpoint (its export runs in a process of its own)."""
    model, _ = load_checkpoint(run, device="cpu")
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_ranks_of_a_launch_load_the_checkpoint_as_its_export(tp2_pp2_run, tmp_path):
    newest = complete_checkpoints(tp2_pp2_run / "checkpoints")[-1][1]
    convert_megatron_to_hf(newest, tmp_path / "export")
    expected, _ = load_checkpoint(tmp_path / "export", device="cpu")
    for loaded in run_distributed(load_in_a_launch_worker, 2, str(tp2_pp2_run), timeout_s=LAUNCH_TIMEOUT):
        assert loaded.keys() == expected.state_dict().keys()
        assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.state_dict().items())


def test_a_checkpoint_without_a_tokenizer_asks_for_one(tp2_pp2_run, tmp_path):
    old = tmp_path / "iter_0000003"
    shutil.copytree(complete_checkpoints(tp2_pp2_run / "checkpoints")[-1][1], old)
    for file in tokenizer_files_in(old):
        file.unlink()
    with pytest.raises(ConversionError, match="--tokenizer"):
        convert_megatron_to_hf(old, tmp_path / "export")


def test_an_unfinished_save_is_refused_with_what_to_do(tmp_path):
    partial = tmp_path / "checkpoints" / "iter_0000004"
    partial.mkdir(parents=True)
    with pytest.raises(TrainingCheckpointError, match="not a complete checkpoint"):
        training_checkpoint(partial)
    with pytest.raises(TrainingCheckpointError, match="no complete checkpoint yet"):
        training_checkpoint(tmp_path)


def test_a_converted_torch_dist_directory_loads_with_the_original_weights(tmp_path):
    """What hf-to-megatron writes is a --model too; the mask token it adds is the one new embedding row."""
    original, _ = make_hf_dir(tmp_path / "hf", "qwen2", tied=False)
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron")
    assert training_checkpoint(tmp_path / "megatron") == tmp_path / "megatron"
    assert training_checkpoint(tmp_path / "hf") is None
    loaded, tokenizer = load_checkpoint(tmp_path / "megatron", device="cpu")
    assert loaded.config.mask_token_id == tokenizer.mask_token_id
    state = loaded.state_dict()
    for name, tensor in original.state_dict().items():
        assert torch.equal(state[name][: tensor.shape[0]], tensor), name
