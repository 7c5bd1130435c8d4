"""Training entry points end to end on CPU, with real processes (torchrun and gloo ranks).

The tiny config (2 layers, hidden 64) on built-in low-entropy data; every run is 2 processes.
Process launches dominate the cost (importing Megatron), so there are four: the command line
through torchrun (the reference run), a checkpoint conversion, a run killed while saving, and
one ``run_distributed`` launch whose ranks run the remaining trainings one after another as
phases; the tests then check the phases' results.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_wedlm.config import ConfigError, config_from_yaml_text, load_config
from megatron_wedlm.data.prepare import prepare_dataset, read_manifest
from megatron_wedlm.data.webdataset_loader import TrainDataIterator, loader_spec_from_manifest
from megatron_wedlm.eval.builtin_tasks import training_corpus, training_pairs
from megatron_wedlm.runtime.multiprocess import DistributedLaunchError, run_distributed
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer
from megatron_wedlm.training.checkpointing import complete_checkpoints
from megatron_wedlm.training.metrics import REQUIRED_KEYS, read_metrics
from megatron_wedlm.training.model_setup import resolve_model_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"
TINY_SFT = ROOT / "configs" / "sft" / "tiny_cpu.yaml"
LAUNCH_TIMEOUT = 420


# --------------------------------------------------------------------------------------------
# Data and launch helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("data")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(400, seed=0):
            f.write(json.dumps({"text": doc}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for prompt, completion in training_pairs(256, seed=1):
            f.write(json.dumps({"prompt": prompt, "response": completion}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "pretrain", root / "tok", samples_per_shard=50)
    prepare_dataset([root / "pairs.jsonl"], root / "sft", root / "tok", task="sft", raw_sft=True, samples_per_shard=32)
    return {"pretrain": str(root / "pretrain"), "sft": str(root / "sft")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """A random Qwen2 HF model shaped like the tiny config, converted to torch_dist, and data
    tokenized with its tokenizer (``model.init_from``)."""
    root = tmp_path_factory.mktemp("init")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, "qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    model.save_pretrained(str(root / "hf"))
    tok.save_pretrained(str(root / "hf"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "hf-to-megatron",
         "--input", str(root / "hf"), "--output", str(root / "mcore")],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(64, seed=2):
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([root / "corpus.jsonl"], root / "data", root / "hf", samples_per_shard=8)
    return {"hf": model, "mcore": str(root / "mcore"), "data": str(root / "data")}


def _init_from_overrides(mcore: str, data_dir: str, out: Path) -> list[str]:
    return [*_base(data_dir, out), f"model.init_from={mcore}", "wedlm.enabled=false", "trainer.train_steps=3",
            "optimizer.warmup_steps=0"]


def _base(data_dir: str, out: Path, progress_bar: bool = False) -> list[str]:
    return [f"data.path={data_dir}", f"trainer.output_dir={out}", f"logging.progress_bar={str(progress_bar).lower()}"]


def torchrun(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MEGATRON_WEDLM_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}


def assert_loss_decreases(history: dict[int, float]) -> None:
    steps = sorted(history)
    first = sum(history[s] for s in steps[:5]) / 5
    last = sum(history[s] for s in steps[-5:]) / 5
    assert last < first - 1.0, f"loss did not decrease: first 5 mean {first:.3f}, last 5 mean {last:.3f}"


def wandb_history_keys(run_file: Path) -> tuple[set[str], int, dict]:
    """Keys of every history record in an offline ``run-*.wandb`` file, how many records, and the
    run record (project, name, group, tags).

    The file is a LevelDB-style log (wandb's transaction log): a 7-byte header, then 32 KiB
    blocks of records ``crc32(4) length(2) type(1) payload``, payloads being wandb ``Record``
    protobufs (type 1 = whole record, 2/3/4 = first/middle/last fragment).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pieces, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            payloads.append(pieces)
    keys: set[str] = set()
    count, run = 0, {}
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "history":
            count += 1
            keys.update(item.key or "/".join(item.nested_key) for item in record.history.item)
        elif which == "run":
            run = {"project": record.run.project, "name": record.run.display_name,
                   "group": record.run.run_group, "tags": list(record.run.tags)}
    return keys, count, run


# --------------------------------------------------------------------------------------------
# torchrun: the real command line
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    """30 steps, DP=2, through torchrun and pretrain_wedlm.py, with wandb offline."""
    out = tmp_path_factory.mktemp("run") / "uninterrupted"
    proc = torchrun("pretrain/pretrain_wedlm.py", [
        "--config", str(TINY), *_base(data["pretrain"], out, progress_bar=True),
        "checkpointing.save_interval=10", "checkpointing.keep_last=2",
        "logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.group=tests",
        "logging.wandb.tags=[tiny,ci]", "logging.wandb.name=tiny-dp2",
    ])
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def test_dp2_loss_decreases_and_everything_is_recorded(uninterrupted):
    records = read_metrics(uninterrupted)
    assert [r["step"] for r in records] == list(range(1, 31))
    for record in records:
        assert set(REQUIRED_KEYS) <= set(record)
        assert record["masked_tokens"] > 0 and record["tokens_per_sec"] > 0 and not record["skipped"]
    assert_loss_decreases(losses(uninterrupted))
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(3e-3)  # warmup 2, then peak
    assert records[-1]["lr"] == pytest.approx(3e-4, rel=0.05)  # cosine down to min_lr

    # resolved config saved with the run and with every checkpoint; keep_last=2
    run_config = (uninterrupted / "config.yaml").read_text()
    cfg = config_from_yaml_text(run_config)
    assert cfg.parallelism.dp == 2 and cfg.model.vocab_size is not None
    kept = complete_checkpoints(uninterrupted / "checkpoints")
    assert [step for step, _ in kept] == [20, 30]
    for _, path in kept:
        assert (path / "config.yaml").read_text() == run_config
        assert json.loads((path / "wedlm_model.json").read_text())["num_layers"] == 2
        assert (path / "metadata.json").is_file()
    assert (uninterrupted / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"

    # the console progress bar: steps done / total, loss, tokens per second, ETA
    console = (uninterrupted / "stderr.txt").read_text()
    assert "30/30" in console and "loss=" in console and "tok_s=" in console and "<00:00" in console


def test_wandb_offline_run_holds_the_logged_keys(uninterrupted):
    runs = list((uninterrupted / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    [run_file] = runs[0].glob("run-*.wandb")
    keys, count, run = wandb_history_keys(run_file)
    assert count == 30
    assert set(REQUIRED_KEYS) - {"step"} <= keys
    assert run == {"project": "megatron-wedlm", "name": "tiny-dp2", "group": "tests", "tags": ["tiny", "ci"]}


# --------------------------------------------------------------------------------------------
# run_distributed: a crash during a save, then every other training as phases of one launch
# --------------------------------------------------------------------------------------------


def _train(config: str, overrides: list[str]) -> dict:
    from megatron_wedlm.training.loop import result_dict, run_training

    return result_dict(run_training(load_config(config, overrides)))


def crash_worker(data_dir: str, out: str) -> None:
    """Rank 0 is SIGKILLed while saving step 10: after every rank wrote its shards, before the
    checkpoint is made visible."""
    from megatron_wedlm.training import checkpointing

    original = checkpointing.CheckpointManager.publish

    def publish(self, partial, final):
        if final.name == "iter_0000010":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, partial, final)

    checkpointing.CheckpointManager.publish = publish
    _train(str(TINY), [*_base(data_dir, Path(out)), "checkpointing.save_interval=5"])


@pytest.fixture(scope="module")
def crashed(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("crash") / "run"
    with pytest.raises(DistributedLaunchError):
        run_distributed(crash_worker, 2, data["pretrain"], str(out), timeout_s=LAUNCH_TIMEOUT)
    ckpts = out / "checkpoints"
    return {
        "dir": out,
        "complete": [s for s, _ in complete_checkpoints(ckpts)],
        "partial_has_shards": (ckpts / "iter_0000010.partial" / "metadata.json").is_file(),
        "losses": losses(out),
    }


def _nonfinite_phase(data_dir: str, out: Path) -> str | None:
    """NaN outputs at step 3 alone, then steps 6, 7, 8 in a row (max_consecutive_nonfinite=3);
    2 micro-batches per rank and step."""
    from megatron_wedlm.training.loop import NonFiniteLossError
    from megatron_wedlm.training.objective import Objective

    honest, calls = Objective.contribution, [0]

    def poisoned(self, per_slot_ce, batch, normalizer):
        calls[0] += 1
        step = (calls[0] - 1) // 2 + 1
        return honest(self, per_slot_ce * float("nan") if step in (3, 6, 7, 8) else per_slot_ce, batch, normalizer)

    Objective.contribution = poisoned
    try:
        _train(str(TINY), [*_base(data_dir, out), "trainer.train_steps=20"])
        return None
    except NonFiniteLossError as err:
        return str(err)
    finally:
        Objective.contribution = honest


def phases_worker(pretrain: str, sft: str, root: str, crashed_dir: str, mcore: str, init_data: str) -> dict:
    root_path = Path(root)
    out: dict = {}
    # stop at 15, resume (what --resume auto sets) -- compared with the torchrun run
    stopped = root_path / "stopped"
    out["stopped"] = _train(str(TINY), [*_base(pretrain, stopped), "trainer.exit_at_step=15"])
    out["stopped_checkpoints"] = [s for s, _ in complete_checkpoints(stopped / "checkpoints")]
    out["resumed"] = _train(str(TINY), [*_base(pretrain, stopped), "checkpointing.resume=auto"])
    # TP=2 for 30 steps (checkpoint at 15), TP=1 (DP=2) resumed from it, PP=2 for 30 steps
    tp2 = root_path / "tp2"
    out["tp2"] = _train(str(TINY), [*_base(pretrain, tp2), "parallelism.tp=2", "checkpointing.save_interval=15"])
    out["tp1"] = _train(str(TINY), [
        *_base(pretrain, root_path / "tp1"), f"checkpointing.resume={tp2 / 'checkpoints' / 'iter_0000015'}",
        "trainer.exit_at_step=20",
    ])
    out["pp2"] = _train(str(TINY), [*_base(pretrain, root_path / "pp2"), "parallelism.pp=2"])
    # after the crash: resume picks the last complete checkpoint
    out["after_crash"] = _train(str(TINY), [*_base(pretrain, Path(crashed_dir)), "checkpointing.resume=auto",
                                            "trainer.exit_at_step=7", "checkpointing.save_interval=5"])
    # SFT from the pretraining run's last checkpoint (model.init_from a training checkpoint)
    out["sft"] = _train(str(TINY_SFT), [*_base(sft, root_path / "sft"), "trainer.train_steps=12",
                                        f"model.init_from={stopped / 'checkpoints' / 'iter_0000030'}"])
    out["ar"] = _train(str(TINY), [*_base(pretrain, root_path / "ar"), "wedlm.enabled=false", "trainer.train_steps=20"])
    out["nonfinite_error"] = _nonfinite_phase(pretrain, root_path / "nonfinite")
    out["init_from"] = _train(str(TINY), _init_from_overrides(mcore, init_data, root_path / "init_from"))
    return out


@pytest.fixture(scope="module")
def phases(data, crashed, converted, tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("phases")
    result = run_distributed(
        phases_worker, 2, data["pretrain"], data["sft"], str(root), str(crashed["dir"]),
        converted["mcore"], converted["data"], timeout_s=LAUNCH_TIMEOUT,
    )[0]
    return result, root


def test_stop_at_15_and_resume_reproduces_steps_16_to_30(uninterrupted, phases):
    result, root = phases
    assert result["stopped"]["final_step"] == 15 and result["stopped_checkpoints"] == [10, 15]
    assert result["resumed"]["start_step"] == 15 and result["resumed"]["final_step"] == 30
    resumed, reference = losses(root / "stopped"), losses(uninterrupted)
    assert sorted(resumed) == list(range(1, 31))
    # bit-identical: same data rows, masks, weights, optimizer moments and step counters
    assert [resumed[s] for s in range(16, 31)] == [reference[s] for s in range(16, 31)]


def test_tp2_and_pp2_train_and_tp2_checkpoint_resumes_with_tp1(phases):
    result, root = phases
    tp2 = {int(k): v for k, v in result["tp2"]["losses"].items()}
    assert_loss_decreases(tp2)
    assert_loss_decreases({int(k): v for k, v in result["pp2"]["losses"].items()})
    tp1 = result["tp1"]
    assert tp1["start_step"] == 15 and tp1["final_step"] == 20
    for step in range(16, 21):  # the same trajectory under the new layout (fp32 reduction order only)
        assert tp1["losses"][step] == pytest.approx(tp2[step], abs=1e-5)
    saved = config_from_yaml_text((root / "tp1" / "config.yaml").read_text())
    assert saved.parallelism.tp == 1 and saved.parallelism.dp == 2


def test_killed_save_leaves_the_previous_checkpoint_loadable(crashed, phases):
    assert crashed["complete"] == [5]  # the step-10 save never became visible
    assert crashed["partial_has_shards"]  # although every shard had been written
    assert sorted(crashed["losses"]) == list(range(1, 11))
    result, _ = phases
    resumed = result["after_crash"]
    assert resumed["start_step"] == 5
    assert [resumed["losses"][s] for s in (6, 7)] == [crashed["losses"][6], crashed["losses"][7]]
    ckpts = crashed["dir"] / "checkpoints"
    assert not (ckpts / "iter_0000010.partial").exists()  # the next save cleaned it up
    assert [s for s, _ in complete_checkpoints(ckpts)] == [5, 7]


def test_sft_trains_with_the_same_loop(phases):
    _, root = phases
    records = read_metrics(root / "sft")
    assert len(records) == 12 and all(r["masked_tokens"] > 0 for r in records)
    # started from the pretrained weights: a random init starts near ln(vocab) = ln(512) = 6.2
    assert records[0]["loss"] < 4.5
    assert sum(r["loss"] for r in records[-3:]) < sum(r["loss"] for r in records[:3])
    assert config_from_yaml_text((root / "sft" / "config.yaml").read_text()).trainer.task == "sft"


def test_ar_mode_is_plain_next_token_training(phases):
    _, root = phases
    records = read_metrics(root / "ar")
    assert all(r["masked_tokens"] == 0 and r["mlm_loss"] == 0 and r["loss"] == r["ar_loss"] for r in records)
    assert_loss_decreases({r["step"]: r["loss"] for r in records})


def test_nonfinite_steps_are_skipped_logged_and_stop_the_run(phases):
    result, root = phases
    assert result["nonfinite_error"] is not None and "3 consecutive steps" in result["nonfinite_error"]
    records = read_metrics(root / "nonfinite")
    assert [r["step"] for r in records if r["skipped"]] == [3, 6, 7, 8]
    assert records[-1]["step"] == 8  # stopped right there
    by_step = {r["step"]: r for r in records}
    assert by_step[4]["lr"] == by_step[3]["lr"]  # a skipped step does not advance the schedule
    assert all(isinstance(r["loss"], float) for r in records if not r["skipped"])  # finite elsewhere
    assert all(r["loss"] == "nan" for r in records if r["skipped"])  # written as a string, valid JSON


def _hf_loss_on_first_step(conv: dict, cfg) -> float:
    """Mean next-token CE of the HF model over the first global batch, document by document.

    Megatron's output layer has the padded vocabulary; conversion fills the extra rows with
    zeros, so they add logits of 0 to the softmax: the reference appends the same columns.
    The rows of a global batch do not depend on the layout, so one reader here (dp=1) sees what
    the two training ranks (dp=2) saw together.
    """
    padded = json.loads((Path(conv["mcore"]) / "wedlm_model.json").read_text())["padded_vocab_size"]
    spec = loader_spec_from_manifest(
        conv["data"], num_streams=cfg.data.num_streams, seq_length=cfg.data.seq_length, wedlm=False,
        block_size=cfg.wedlm.block_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
    )
    data = TrainDataIterator(spec, 0, 1, cfg.data.micro_batch_size, num_workers=0)
    total, count = 0.0, 0
    for _ in range(cfg.data.global_batch_size // cfg.data.micro_batch_size):
        batch, _ = data.next_microbatch()
        for row in range(batch.input_ids.shape[0]):
            for doc in torch.unique(batch.doc_ids[row][batch.doc_ids[row] >= 0]):
                slots = batch.doc_ids[row] == doc
                ids, labels = batch.input_ids[row][slots], batch.ar_labels[row][slots]
                with torch.no_grad():
                    logits = conv["hf"](input_ids=ids[None]).logits[0].float()
                logits = torch.cat([logits, logits.new_zeros(logits.shape[0], padded - logits.shape[1])], dim=1)
                keep = labels >= 0
                total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
                count += int(keep.sum())
    return total / count


def test_training_starts_from_a_converted_hf_checkpoint(converted, phases):
    """The first logged loss (before any update) equals the HF model's own loss on those rows."""
    _, root = phases
    out = root / "init_from"
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    cfg = load_config(str(TINY), _init_from_overrides(converted["mcore"], converted["data"], out))
    assert records[0]["loss"] == pytest.approx(_hf_loss_on_first_step(converted, cfg), rel=1e-4)
    saved = json.loads((out / "checkpoints" / "iter_0000003" / "wedlm_model.json").read_text())
    assert saved["architecture"] == "qwen2"
    assert saved["mask_token_id"] == read_manifest(converted["data"])["mask_token_id"]


def test_config_keys_that_contradict_the_checkpoint_are_refused(converted, tmp_path):
    manifest = read_manifest(converted["data"])
    cfg = load_config(str(TINY), [*_init_from_overrides(converted["mcore"], converted["data"], tmp_path),
                                  "model.hidden_size=32"])
    with pytest.raises(ConfigError, match="model.hidden_size=32 disagrees"):
        resolve_model_args(cfg, manifest, "float32")
    cfg = load_config(str(TINY), _init_from_overrides(converted["mcore"], converted["data"], tmp_path))
    args = resolve_model_args(cfg, manifest, "float32")
    assert cfg.model.qk_layernorm is False and cfg.model.add_qkv_bias is True  # filled from the checkpoint
    assert args.padded_vocab_size % 128 == 0 and args.vocab_size >= manifest["tokenizer_length"]
