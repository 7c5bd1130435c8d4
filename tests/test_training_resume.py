"""Stopping, resuming and changing the layout: each behaviour its own small 2-rank launch
(real gloo processes, the tiny CPU config), its worker next to its test."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from megatron_wedlm.config import config_from_yaml_text
from megatron_wedlm.conversion import convert_megatron_to_hf
from megatron_wedlm.runtime.multiprocess import DistributedLaunchError, run_distributed
from megatron_wedlm.training.checkpoint_index import complete_checkpoints
from megatron_wedlm.training.metrics import read_metrics
from test_training import (  # noqa: F401  (data: the fixture)
    LAUNCH_TIMEOUT, TINY, _base, _train, _validation, assert_loss_decreases, data, losses, valid_losses,
)
from test_training_export import _generate


def stop_and_resume_worker(data: dict[str, str], root: str) -> dict:
    """30 steps straight; 30 steps stopped at 15 and resumed (what --resume auto sets); both
    validating every 10 steps and at the end of each run."""
    validation = _validation(data)
    _train(str(TINY), [*_base(data["pretrain"], Path(root) / "straight"), *validation])
    stopped = Path(root) / "stopped"
    first = _train(str(TINY), [*_base(data["pretrain"], stopped), *validation, "trainer.exit_at_step=15"])
    checkpoints = [s for s, _ in complete_checkpoints(stopped / "checkpoints")]
    resumed = _train(str(TINY), [*_base(data["pretrain"], stopped), *validation, "checkpointing.resume=auto"])
    return {"first": first, "checkpoints": checkpoints, "resumed": resumed}


def test_stop_at_15_and_resume_reproduces_steps_16_to_30(data, tmp_path):
    result = run_distributed(stop_and_resume_worker, 2, data, str(tmp_path), timeout_s=LAUNCH_TIMEOUT)[0]
    assert result["first"]["final_step"] == 15 and result["checkpoints"] == [10, 15]
    assert result["resumed"]["start_step"] == 15 and result["resumed"]["final_step"] == 30
    resumed, straight = losses(tmp_path / "stopped"), losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(1, 31))
    # bit-identical: same data rows, masks, weights, optimizer moments and step counters
    assert [resumed[s] for s in range(16, 31)] == [straight[s] for s in range(16, 31)]

    # one validation curve: each run validates at its interval steps and after its last step, and a
    # step's validation is the same number resumed or not
    assert sorted(result["first"]["valid_losses"]) == [10, 15] and sorted(result["resumed"]["valid_losses"]) == [20, 30]
    curve, straight_curve = valid_losses(tmp_path / "stopped"), valid_losses(tmp_path / "straight")
    assert sorted(curve) == [10, 15, 20, 30] and sorted(straight_curve) == [10, 20, 30]
    assert [curve[s] for s in (10, 20, 30)] == [straight_curve[s] for s in (10, 20, 30)]
    assert curve[20] == result["resumed"]["valid_losses"][20]["loss"]


@pytest.fixture(scope="module")
def blend(data, tmp_path_factory) -> list[str]:
    """data.blend overrides: the pretraining corpus at weight 1 and another corpus of the same kind
    (same tokenizer) at weight 3."""
    from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
    from megatron_wedlm.eval.builtin_tasks import training_corpus

    root = tmp_path_factory.mktemp("blend")
    with open(root / "corpus.jsonl", "w") as f:
        for doc in training_corpus(400, seed=7):
            f.write(json.dumps({"text": doc}) + "\n")
    tokenizer = Path(data["pretrain"]).parent / "tok"  # the one the data fixture prepared with
    prepare_dataset([root / "corpus.jsonl"], root / "second", tokenizer, PrepareOptions(samples_per_shard=50))
    return ["data.path=null", f"data.blend=[{{path: {data['pretrain']}, weight: 1, name: first}}, "
                              f"{{path: {root / 'second'}, weight: 3}}]"]


def _blend_base(blend: list[str], out: str) -> list[str]:
    return [*blend, f"trainer.output_dir={out}", "logging.progress_bar=false"]


def crash_worker(blend: list[str], out: str) -> None:
    """Rank 0 is SIGKILLed while saving step 10: after every rank wrote its shards, before the
    checkpoint is made visible."""
    from megatron_wedlm.training import checkpointing

    original = checkpointing.CheckpointManager.publish

    def publish(self, partial, final):
        if final.name == "iter_0000010":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, partial, final)

    checkpointing.CheckpointManager.publish = publish
    _train(str(TINY), [*_blend_base(blend, out), "checkpointing.save_interval=5"])


def resume_after_crash_worker(blend: list[str], out: str) -> dict:
    return _train(str(TINY), [*_blend_base(blend, out), "checkpointing.resume=auto", "trainer.exit_at_step=7",
                              "checkpointing.save_interval=5"])


def test_killed_save_leaves_the_previous_checkpoint_loadable(blend, tmp_path):
    """On a data blend (data.blend): the run killed at step 10 resumes from step 5 with its losses (steps 6, 7)
    and per-source token counts bit for bit, the blend's data state included."""
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    with pytest.raises(DistributedLaunchError):
        run_distributed(crash_worker, 2, blend, str(out), timeout_s=LAUNCH_TIMEOUT)
    assert [s for s, _ in complete_checkpoints(ckpts)] == [5]  # the step-10 save never became visible
    assert (ckpts / "iter_0000010.partial" / "metadata.json").is_file()  # although every shard had been written
    crashed = losses(out)
    assert sorted(crashed) == list(range(1, 11))
    crashed_records = {r["step"]: r for r in read_metrics(out)}

    resumed = run_distributed(resume_after_crash_worker, 2, blend, str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    assert resumed["start_step"] == 5
    assert [resumed["losses"][s] for s in range(6, 8)] == [crashed[s] for s in range(6, 8)]
    assert not (ckpts / "iter_0000010.partial").exists()  # the next save cleaned it up
    assert [s for s, _ in complete_checkpoints(ckpts)] == [5, 7]

    records = {r["step"]: r for r in read_metrics(out)}
    per_source = [[records[s][f"tokens/{n}"] for n in ("first", "second")] for s in range(1, 8)]
    assert per_source == [[crashed_records[s][f"tokens/{n}"] for n in ("first", "second")] for s in range(1, 8)]
    assert all(sum(counts) == records[s]["tokens"] for counts, s in zip(per_source, range(1, 8)))
    total = [sum(c[i] for c in per_source) for i in (0, 1)]
    assert 0.15 < total[0] / sum(total) < 0.35  # weight 1 of 4 (documents of different lengths)
    state = json.loads((ckpts / "iter_0000007" / "trainer_state.json").read_text())
    assert state["consumed_source_tokens"] == dict(zip(("first", "second"), total))
    assert state["data"]["rows_consumed"] == 7 * 8 and [s["weight"] for s in state["data"]["blend"]] == [0.25, 0.75]


def tp2_then_tp1_worker(pretrain: str, root: str) -> dict:
    """TP=2 for 30 steps (checkpoint at 15), then TP=1 (DP=2) resumed from that checkpoint."""
    tp2 = Path(root) / "tp2"
    return {
        "tp2": _train(str(TINY), [*_base(pretrain, tp2), "parallelism.tp=2", "checkpointing.save_interval=15"]),
        "tp1": _train(str(TINY), [*_base(pretrain, Path(root) / "tp1"), "trainer.exit_at_step=20",
                                  f"checkpointing.resume={tp2 / 'checkpoints' / 'iter_0000015'}"]),
    }


def test_tp2_trains_and_its_checkpoint_resumes_with_tp1(data, tmp_path):
    result = run_distributed(tp2_then_tp1_worker, 2, data["pretrain"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)[0]
    tp2 = {int(k): v for k, v in result["tp2"]["losses"].items()}
    assert_loss_decreases(tp2)
    tp1 = result["tp1"]
    assert tp1["start_step"] == 15 and tp1["final_step"] == 20
    for step in range(16, 21):  # the same trajectory under the new layout (fp32 reduction order only)
        assert tp1["losses"][step] == pytest.approx(tp2[step], abs=1e-5)
    saved = config_from_yaml_text((tmp_path / "tp1" / "config.yaml").read_text())
    assert saved.parallelism.tp == 1 and saved.parallelism.dp == 2


def pp2_worker(pretrain: str, out: str) -> dict:
    return _train(str(TINY), [*_base(pretrain, Path(out)), "parallelism.pp=2"])


def test_pp2_trains(data, tmp_path):
    result = run_distributed(pp2_worker, 2, data["pretrain"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)
    assert_loss_decreases({int(k): v for k, v in result[0]["losses"].items()})


TINY_MOE = TINY.parent / "tiny_moe_cpu.yaml"  # a Qwen3-MoE, experts split over the 2 ranks (EP=2)


def moe_ep2_worker(pretrain: str, root: str) -> dict:
    """EP=2: 20 steps straight (checkpoint at 10); 20 steps stopped at 10 and resumed; the straight
    run's step-10 checkpoint resumed at EP=1 (DP=2) to step 15."""
    runs = {}
    for name, extra in (("straight", []), ("stopped", ["trainer.exit_at_step=10"]),
                        ("resumed", ["checkpointing.resume=auto"]),
                        ("ep1", ["parallelism.ep=1", "trainer.exit_at_step=15", "checkpointing.resume="
                                 + str(Path(root) / "straight" / "checkpoints" / "iter_0000010")])):
        out = Path(root) / ("stopped" if name == "resumed" else name)
        runs[name] = _train(str(TINY_MOE), [*_base(pretrain, out), "trainer.train_steps=20", *extra])
    return runs


def test_moe_ep2_trains_logs_its_router_loss_resumes_exactly_and_at_ep1_and_exports(data, tmp_path):
    runs = run_distributed(moe_ep2_worker, 2, data["pretrain"], str(tmp_path), timeout_s=LAUNCH_TIMEOUT)[0]
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight")}
    assert_loss_decreases({s: r["loss"] for s, r in straight.items()})
    # the balancing loss (before its weight) is logged every step: 1 when the routing is even, at most E / k
    aux = [straight[s]["moe_aux_loss"] for s in range(1, 21)]
    assert all(0.99 < a < 8 / 2 for a in aux) and len(set(aux)) > 1
    # stopped at 10 and resumed: steps 11-20 bit-identical, router loss included
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "stopped")}
    assert runs["resumed"]["start_step"] == 10 and runs["resumed"]["final_step"] == 20
    for step in range(11, 21):
        assert (resumed[step]["loss"], resumed[step]["moe_aux_loss"]) == (straight[step]["loss"], straight[step]["moe_aux_loss"])
    # the EP=2 checkpoint loads at EP=1 and goes on the same way (fp32 reduction order only)
    ep1 = runs["ep1"]
    assert ep1["start_step"] == 10 and ep1["final_step"] == 15
    for step in range(11, 16):
        assert ep1["losses"][step] == pytest.approx(straight[step]["loss"], abs=1e-5)
    # its last checkpoint exports to a HF Qwen3-MoE that decodes as the checkpoint itself does
    newest = tmp_path / "straight" / "checkpoints" / "iter_0000020"
    convert_megatron_to_hf(newest, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    from_checkpoint, from_export = _generate(newest), _generate(tmp_path / "export")
    assert len(from_export["token_ids"]) == 10
    assert (from_checkpoint["token_ids"], from_checkpoint["forwards"]) == (from_export["token_ids"], from_export["forwards"])
