"""A run owns its output directory and never loses a run (issue 19, training items 1, 2, 3, 6, 7).

Each test reproduces one probe of the issue with real training processes (two gloo ranks, the
tiny config of ``test_training.py``) and real files, and checks that nothing is lost or mixed:

1. a fresh run into a finished run's directory is refused (``trainer.overwrite=true`` moves the
   old run aside);
2. after a rollback (resume an older checkpoint by path), ``--resume auto`` and pruning follow
   the new branch, and ``metrics.jsonl`` keeps the branch's history;
3. a second run into a directory in use is refused; a lock left by a dead run is taken over;
6. an unreadable newest checkpoint is named, and ``--resume auto`` falls back to the previous one;
7. resuming the data position on a different shard set is refused unless told.

One launch per probe; every training inside it is a few steps. The DeepSpeed backend shares the
same layer (``training.run_dir``, ``training.checkpointing``): one launch checks it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_deepspeed_training import ENV as DS_ENV
from test_deepspeed_training import _common as ds_common
from test_deepspeed_training import make_sft_data
from test_training import LAUNCH_TIMEOUT, TINY, _base, _train, losses

from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.eval.builtin_tasks import training_corpus
from megatron_wedlm.runtime.multiprocess import run_distributed
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer
from megatron_wedlm.training.checkpoint_index import complete_checkpoints
from megatron_wedlm.training.metrics import METRICS_ABANDONED_FILE, read_metrics
from megatron_wedlm.training.run_dir import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """Two pretraining sets with the same number of shards and different documents."""
    root = tmp_path_factory.mktemp("data")
    build_tiny_tokenizer().save_pretrained(str(root / "tok"))
    for name, seed in (("a", 0), ("b", 1)):
        with open(root / f"{name}.jsonl", "w") as handle:
            for doc in training_corpus(200, seed=seed):
                handle.write(json.dumps({"text": doc}) + "\n")
        prepare_dataset([root / f"{name}.jsonl"], root / name, root / "tok", PrepareOptions(samples_per_shard=50))
    return {"a": str(root / "a"), "b": str(root / "b")}


def _attempt(config: Path, overrides: list[str]) -> dict:
    """A training's result, or the error it stopped with (every rank raises the same one)."""
    try:
        return {"result": _train(str(config), overrides)}
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(err).__name__}: {err}"}


def _steps(out: Path) -> list[int]:
    return [s for s, _ in complete_checkpoints(out / "checkpoints")]


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# --------------------------------------------------------------------------------------------
# 1. A fresh run into a finished run's directory
# --------------------------------------------------------------------------------------------


def rerun_worker(data_dir: str, out_dir: str) -> dict:
    out = Path(out_dir)
    run = [*_base(data_dir, out), "checkpointing.save_interval=3", "checkpointing.keep_last=2"]
    _train(str(TINY), [*run, "trainer.train_steps=6"])
    before = {"metrics": read_metrics(out), "config": (out / "config.yaml").read_text(), "ckpts": _steps(out)}
    refused = _attempt(TINY, [*run, "trainer.train_steps=3", "optimizer.lr=1e-3"])
    after = {"metrics": read_metrics(out), "config": (out / "config.yaml").read_text(), "ckpts": _steps(out)}
    replaced = _attempt(TINY, [*run, "trainer.train_steps=3", "optimizer.lr=1e-3", "trainer.overwrite=true"])
    return {"before": before, "refused": refused, "after": after, "replaced": replaced}


def test_a_fresh_run_into_a_finished_run_is_refused_and_overwrite_moves_it_aside(data, tmp_path):
    out = tmp_path / "run"
    got = run_distributed(rerun_worker, 2, data["a"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    assert got["before"]["ckpts"] == [3, 6] and len(got["before"]["metrics"]) == 6

    assert "result" not in got["refused"], "a fresh run started over the finished one"
    message = got["refused"]["error"]
    assert "already holds checkpoints" in message and "iter_0000006" in message
    assert "--resume auto" in message and "trainer.overwrite=true" in message
    assert got["after"] == got["before"]  # metrics, config and checkpoints untouched

    assert got["replaced"]["result"]["final_step"] == 3
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # only the new run
    assert _steps(out) == [3]
    [aside] = tmp_path.glob("run.replaced-*")  # the old run, whole, beside it
    assert [r["step"] for r in read_metrics(aside)] == list(range(1, 7))
    assert [s for s, _ in complete_checkpoints(aside / "checkpoints")] == [3, 6]
    assert (aside / "config.yaml").read_text() == got["before"]["config"]
    assert not (out / LOCK_FILE).exists()  # released at the end


# --------------------------------------------------------------------------------------------
# 2. Rollback: --resume auto, pruning and metrics follow the new branch
# --------------------------------------------------------------------------------------------


def rollback_worker(data_dir: str, out_dir: str) -> dict:
    out = Path(out_dir)
    run = [*_base(data_dir, out), "trainer.train_steps=20", "checkpointing.save_interval=10",
           "checkpointing.keep_last=2"]
    first = _train(str(TINY), run)  # iter 10, 20
    branch = _train(str(TINY), [*run, f"checkpointing.resume={out / 'checkpoints' / 'iter_0000010'}",
                                "trainer.exit_at_step=15"])  # iter 15 on a new branch; iter 20 abandoned
    after_branch = _steps(out)
    auto = _attempt(TINY, [*run, "checkpointing.resume=auto", "trainer.exit_at_step=17"])
    return {"first": first, "branch": branch, "after_branch": after_branch, "auto": auto}


def _run_ids(out: Path) -> dict[int, str]:
    return {r["step"]: r["run_id"] for r in read_metrics(out)}


def test_resume_auto_and_pruning_follow_the_branch_after_a_rollback(data, tmp_path):
    out = tmp_path / "run"
    got = run_distributed(rollback_worker, 2, data["a"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    assert got["branch"]["start_step"] == 10
    # keep_last=2 counts the branch's checkpoints (10, 15); the abandoned 20 is neither kept nor counted
    assert got["after_branch"] == [10, 15, 20]

    assert "result" in got["auto"], got["auto"]
    assert got["auto"]["result"]["start_step"] == 15  # not the abandoned iter_0000020
    assert _steps(out) == [15, 17, 20]  # pruned along the branch only; the just-saved 17 kept

    # one consistent history in metrics.jsonl: first run to 10, the branch to 15, then 16, 17
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 18))
    ids = _run_ids(out)
    assert len({ids[s] for s in range(1, 11)}) == 1 and len({ids[s] for s in range(11, 16)}) == 1
    assert len({ids[1], ids[11], ids[16]}) == 3
    # the branch resumed exactly: its steps 11..15 equal the first run's
    first = {int(k): v for k, v in got["first"]["losses"].items()}
    assert [losses(out)[s] for s in range(11, 16)] == [first[s] for s in range(11, 16)]
    # nothing was cut silently: the first run's 11..20 are kept aside, tagged with the branch's run
    abandoned = read_metrics(out / METRICS_ABANDONED_FILE)
    assert [r["step"] for r in abandoned] == list(range(11, 21))
    assert {r["run_id"] for r in abandoned} == {ids[1]} and {r["abandoned_by"] for r in abandoned} == {ids[11]}
    assert [r["loss"] for r in abandoned] == [first[s] for s in range(11, 21)]

    state = json.loads((out / "checkpoints" / "iter_0000017" / "trainer_state.json").read_text())
    assert state["run_id"] == ids[16] and state["parent"].endswith("iter_0000015")
    assert [e["run_id"] for e in state["lineage"]] == [ids[1], ids[11], ids[16]]
    assert [e["from_step"] for e in state["lineage"]] == [0, 10, 15]


# --------------------------------------------------------------------------------------------
# 3. Two runs in one directory; a lock left by a killed run
# --------------------------------------------------------------------------------------------


def locked_worker(data_dir: str, out_dir: str) -> dict:
    return _attempt(TINY, [*_base(data_dir, Path(out_dir)), "trainer.train_steps=3"])


def test_a_second_run_into_a_directory_in_use_is_refused_naming_the_holder(data, tmp_path):
    out = tmp_path / "run"
    holder = RunLock(out, "the-first-run")  # this test process is the live run that holds it
    holder.acquire(print)
    try:
        got = run_distributed(locked_worker, 2, data["a"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    finally:
        holder.release()
    assert "result" not in got, "a second run trained in a directory in use"
    assert f"pid {os.getpid()}" in got["error"] and "the-first-run" in got["error"]
    assert sorted(p.name for p in out.iterdir()) == []  # nothing written: no metrics, config, checkpoints


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_warning(data, tmp_path, capfd):
    out = tmp_path / "run"
    # a real process takes the lock and dies without releasing it (as under kill -9)
    code = ("import os, sys; from megatron_wedlm.training.run_dir import RunLock; "
            "RunLock(sys.argv[1], 'killed-run').acquire(print); os._exit(9)")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, timeout=120)
    assert proc.returncode == 9 and json.loads((out / LOCK_FILE).read_text())["run_id"] == "killed-run"

    got = run_distributed(locked_worker, 2, data["a"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    assert got.get("result", {}).get("final_step") == 3, got
    assert "taking over the stale lock" in capfd.readouterr().err
    assert not (out / LOCK_FILE).exists()


# --------------------------------------------------------------------------------------------
# 6. An unreadable newest checkpoint
# --------------------------------------------------------------------------------------------


def corrupt_worker(data_dir: str, out_dir: str) -> dict:
    out = Path(out_dir)
    ckpts = out / "checkpoints"
    run = [*_base(data_dir, out), "trainer.train_steps=10", "checkpointing.save_interval=5",
           "checkpointing.keep_last=3"]
    _train(str(TINY), run)  # iter 5, 10
    if _is_rank0():  # a save cut short by a full disk: the newest tensor file is truncated
        shard = max((ckpts / "iter_0000010").glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(shard, shard.stat().st_size // 2)
    _barrier()
    by_path = _attempt(TINY, [*run, f"checkpointing.resume={ckpts / 'iter_0000010'}"])
    auto = _attempt(TINY, [*run, "checkpointing.resume=auto", "trainer.exit_at_step=7"])  # saves iter 7
    if _is_rank0():  # a kill while the trainer state was written: an empty file
        (ckpts / "iter_0000007" / "trainer_state.json").write_text("")
    _barrier()
    auto_again = _attempt(TINY, [*run, "checkpointing.resume=auto", "trainer.exit_at_step=6"])
    return {"by_path": by_path, "auto": auto, "auto_again": auto_again}


def test_an_unreadable_checkpoint_is_named_and_auto_falls_back_to_the_previous_one(data, tmp_path, capfd):
    out = tmp_path / "run"
    got = run_distributed(corrupt_worker, 2, data["a"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    warnings = capfd.readouterr().err

    assert "result" not in got["by_path"]
    error = got["by_path"]["error"]
    assert "iter_0000010" in error and ".distcp is truncated" in error and "'auto'" in error

    assert got["auto"]["result"]["start_step"] == 5
    assert "iter_0000010 cannot be read" in warnings and "trying the previous one" in warnings
    assert got["auto_again"]["result"]["start_step"] == 5
    assert "iter_0000007/trainer_state.json cannot be read" in warnings


# --------------------------------------------------------------------------------------------
# 7. Resuming the data position on other data
# --------------------------------------------------------------------------------------------


def other_data_worker(data_a: str, data_b: str, out_dir: str) -> dict:
    out = Path(out_dir)
    _train(str(TINY), [*_base(data_a, out), "trainer.train_steps=10", "trainer.exit_at_step=4"])
    resume = ["checkpointing.resume=auto", "trainer.train_steps=10", "trainer.exit_at_step=6"]
    refused = _attempt(TINY, [*_base(data_b, out), *resume])
    allowed = _attempt(TINY, [*_base(data_b, out), *resume, "checkpointing.allow_data_change=true"])
    return {"refused": refused, "allowed": allowed}


def test_resuming_on_a_different_shard_set_is_refused_unless_allowed(data, tmp_path):
    from megatron_wedlm.data.manifest import read_manifest

    assert len(read_manifest(data["a"])["shards"]) == len(read_manifest(data["b"])["shards"])
    out = tmp_path / "run"
    got = run_distributed(other_data_worker, 2, data["a"], data["b"], str(out), timeout_s=LAUNCH_TIMEOUT)[0]
    assert "result" not in got["refused"], "the saved stream positions were applied to other data"
    error = got["refused"]["error"]
    assert "another shard set" in error and data["b"] in error
    assert "checkpointing.load_data_state=false" in error and "checkpointing.allow_data_change=true" in error
    assert got["allowed"]["result"]["start_step"] == 4 and got["allowed"]["result"]["final_step"] == 6


# --------------------------------------------------------------------------------------------
# The DeepSpeed backend: the same lock, refusal, lineage and fallback
# --------------------------------------------------------------------------------------------


def deepspeed_worker(common: list[str], data: dict[str, str], out_dir: str) -> dict:
    from megatron_wedlm.config import load_config
    from megatron_wedlm.deepspeed_backend import run_deepspeed_sft

    out = Path(out_dir)

    def run(*extra: str):
        return run_deepspeed_sft(load_config(None, [
            *common, "trainer.backend=deepspeed", f"model.init_from={data['hf']}", f"trainer.output_dir={out}",
            "deepspeed.export_hf=false", "checkpointing.save_interval=2", "checkpointing.keep_last=2", *extra,
        ]))

    run()  # 4 steps: iter 2, 4
    refused = {}
    try:
        run()
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        refused = {"error": f"{type(err).__name__}: {err}"}
    branch = run(f"checkpointing.resume={out / 'checkpoints' / 'iter_0000002'}", "trainer.exit_at_step=3")
    if _is_rank0():  # the branch's newest checkpoint is damaged
        (out / "checkpoints" / "iter_0000003" / "trainer_state.json").write_text("{")
    _barrier()
    auto = run("checkpointing.resume=auto", "trainer.exit_at_step=3")
    return {"refused": refused, "branch_start": branch.start_step, "auto_start": auto.start_step}


def test_the_deepspeed_backend_owns_its_output_dir_and_follows_the_lineage(tmp_path, capfd):
    data = make_sft_data(tmp_path)
    out = tmp_path / "run"
    got = run_distributed(deepspeed_worker, 2, ds_common(data), data, str(out), env=DS_ENV,
                          timeout_s=LAUNCH_TIMEOUT)[0]
    assert "already holds checkpoints" in got["refused"]["error"]
    assert got["branch_start"] == 2
    # iter_3 is unreadable and iter_4 belongs to the abandoned first run: auto goes back to iter_2
    assert got["auto_start"] == 2
    warnings = capfd.readouterr().err
    assert "iter_0000003/trainer_state.json cannot be read" in warnings
    assert "iter_0000004 belongs to an abandoned branch" in warnings
