"""docs/cluster.md, run as written: every ```bash block of the guide, in order, in one bash session.

The guide's first block holds every setting (paths, layout, step counts, evaluation tasks); the
test puts tiny values in its place and runs every other block verbatim, except those that open
with the guide's visible ``# not run by the test:`` marker, which must be the network's (the
hub download, wandb login). At tiny scale, the same flags: a random Qwen3-shaped HF model
without a mask token, a config derived from ``configs/pretrain/qwen3_8b.yaml`` (its keys, the
sizes shrunk), a small corpus, ARC files in the hub's layout for the paper's tasks, and a real
one-node SLURM cluster (:mod:`megatron_wedlm.testing.slurm`) whose jobs run CPU ranks.

The test's own bash between blocks does what time does on a cluster: once the chain's first
job has saved a checkpoint it is cancelled (as its time limit or a preemption would stop it),
then everything queued runs to the end. Then it checks what the guide promises: the
conversion, the shards, the second job resuming the first one's checkpoint, one wandb run for
both jobs with the evaluations in it, ``evals.jsonl`` rows from both jobs' checkpoints up to the
last step, an HF export that transformers loads, and completions from the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatron_wedlm.testing.guide import (
    SETTINGS_MARKER,
    SKIP_MARKER,
    Block,
    assigned_names,
    bash_blocks,
    block_outputs,
    commands,
    compose_script,
    read_names,
)
from megatron_wedlm.testing.slurm import SlurmCluster, why_unavailable
from megatron_wedlm.training.metrics import METRICS_ABANDONED_FILE

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "cluster.md"
README = ROOT / "README.md"
#: what a skipped block may run: commands that need the network, which CI has not
NETWORK_COMMANDS = ("hf download", "wandb login", "wandb sync")
SCRIPT_TIMEOUT_S = 780  # under pytest's 900 s, so a hang reports the script's output

TRAIN_STEPS, SAVE_INTERVAL, SFT_STEPS = 10, 2, 4
TP, PP, CP, GPUS_PER_NODE = 2, 1, 2, 4


# ---------------------------------------------------------------------- the guide's blocks


def test_the_guide_opens_with_its_settings_and_later_blocks_read_only_them():
    blocks = bash_blocks(GUIDE.read_text())
    assert len(blocks) >= 8
    settings, later = blocks[0], blocks[1:]
    assert settings.text.startswith(SETTINGS_MARKER)
    names = set(assigned_names(settings.text))
    assert {"TP", "PP", "CP", "NODES", "GPUS_PER_NODE", "CONFIG", "RUN_DIR", "TRAIN_STEPS"} <= names
    for block in later:
        assert read_names(block.text) <= names, \
            f"block {block.number} (line {block.line}) reads {sorted(read_names(block.text) - names)}, not settings"
    assert set(assigned_names(tiny_settings(Path("/x"), 1))) == names, "the test's settings and the guide's differ"


def test_only_the_networks_commands_are_skipped():
    skipped = [b for b in bash_blocks(GUIDE.read_text()) if b.skipped]
    assert len(skipped) == 3  # the hub download, wandb login, wandb sync
    for block in skipped:
        commands = [line for line in block.text.splitlines()[1:] if line.strip()]
        assert commands and all(line.startswith(NETWORK_COMMANDS) for line in commands), block.text
    text = "\n".join(b.text for b in bash_blocks(GUIDE.read_text()) if not b.skipped)
    assert SKIP_MARKER not in text and not any(command in text for command in NETWORK_COMMANDS)


def test_the_readmes_cluster_commands_are_the_guides_and_so_run_here():
    """The README's short version is not a second text to keep in step: each of its commands is
    one the guide's blocks run as written (the walk-through below), and it reads only the guide's
    settings, which the README tells the reader to copy first."""
    guide = bash_blocks(GUIDE.read_text())
    ran = {command for block in guide[1:] if not block.skipped for command in commands(block.text)}
    readme = [b for b in bash_blocks(README.read_text()) if "hf-to-megatron" in b.text]
    assert len(readme) == 1, "the README's cluster block"
    shown = commands(readme[0].text)
    assert len(shown) == 8 and "sbatch" in readme[0].text and "--dependency singleton" in readme[0].text
    assert [c for c in shown if c not in ran] == [], "README commands the guide does not run"
    assert read_names(readme[0].text) <= set(assigned_names(guide[0].text))
    assert commands("a \\\n   --b  c   # note\n# alone\n\n") == ["a --b c"]


def test_the_sbatch_scripts_default_log_needs_no_directory():
    """SLURM opens --output before the script runs, so a default under a directory nobody made
    kills the job without a log (the README's bare `sbatch examples/slurm/train_wedlm.sbatch`)."""
    script = (ROOT / "examples" / "slurm" / "train_wedlm.sbatch").read_text()
    outputs = re.findall(r"^#SBATCH --output=(\S+)", script, re.MULTILINE)
    assert outputs and all("/" not in path for path in outputs), outputs


def test_a_guide_whose_command_breaks_fails_and_skipped_blocks_do_not_run():
    """The property this file rests on, on a three-line guide: blocks run in order with the test's
    settings, a skipped block does not run, and a failing command stops the script with an error."""
    page = ("```bash\n# settings\nX=real\n```\n\n```bash\necho one $X\n```\n\n"
            "```bash\n# not run by the test: needs the network\necho skipped\n```\n\n"
            "```bash\necho two $X\nno-such-command --flag\necho never\n```\n")
    blocks = bash_blocks(page)
    assert [b.skipped for b in blocks] == [False, False, True, False]
    script = compose_script(blocks, "# settings: tiny\nX=tiny\n", before={"echo two": "echo hook"})
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 127 and "no-such-command" in run.stderr
    assert "skipped" not in run.stdout and "never" not in run.stdout and "@@end@@" not in run.stdout
    assert block_outputs(run.stdout)[2].strip() == "one tiny" and "@@test@@\nhook\n\n@@block 4@@\ntwo tiny" in run.stdout
    with pytest.raises(ValueError, match="2 blocks hold"):
        compose_script(blocks, "# settings\n", before={"echo": "true"})
    with pytest.raises(ValueError, match="not closed"):
        bash_blocks("```bash\necho\n")


# ---------------------------------------------------------------------- the tiny world


def tiny_settings(root: Path, port: int) -> str:
    """The guide's settings at tiny scale: every name of the guide's block, nothing else."""
    return f"""{SETTINGS_MARKER}: tiny values (tests/test_cluster_guide.py)
HF_MODEL={root}/models/Qwen3-tiny
MCORE={root}/ckpt/qwen3-tiny-mcore
CORPUS={root}/corpus
DATA={root}/data/cpt
SAMPLES_PER_SHARD=40
VALID_FRACTION=0.1
PREP_WORKERS=2
CONFIG={root}/tiny_qwen3_8b.yaml
RUN_DIR={root}/runs/wedlm-tiny-cpt
LOGS={root}/runs/logs
NODES=1
GPUS_PER_NODE={GPUS_PER_NODE}
TP={TP} PP={PP} CP={CP}
TRAIN_STEPS={TRAIN_STEPS}
SAVE_INTERVAL={SAVE_INTERVAL}
CHAIN=3
EVAL_TASKS=paper:arc_c:{root}/data/ai2_arc/ARC-Challenge,paper:arc_e:{root}/data/ai2_arc/ARC-Easy
EVAL_LIMIT=2
EVAL_POLL=1
FOLLOW_WAIT=300
export WEDLM_REFERENCE={root}/no-reference  # ARC has no few-shot text to read
CHATS={root}/chats.jsonl
SFT_DATA={root}/data/sft
SFT_CONFIG={root}/tiny_sft_qwen3_8b.yaml
SFT_RUN_DIR={root}/runs/wedlm-tiny-sft
SFT_STEPS={SFT_STEPS}
SFT_CHAIN=1
HF_OUT={root}/ckpt/wedlm-tiny-hf
SFT_HF_OUT={root}/ckpt/wedlm-tiny-sft-hf
PORT={port}
"""


def write_hf_model(directory: Path) -> None:
    """A random Qwen3 (QK-norm, GQA, untied) whose tokenizer has no mask token, as Qwen3-8B's has
    none, and a chat template, as Qwen3-8B's has one."""
    from megatron_wedlm.testing.serving import CHAT_TEMPLATE
    from megatron_wedlm.testing.tiny_models import TinyShape, build_tiny_ar_tokenizer, build_tiny_causal_lm

    tokenizer = build_tiny_ar_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    shape = TinyShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=512)
    model = build_tiny_causal_lm("qwen3", shape, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_tiny_config(path: Path, committed: str = "pretrain/qwen3_8b.yaml") -> None:
    """``configs/<committed>`` with the tiny model's shape and CPU-sized rows and batches; every
    other key (WeDLM, optimizer, checkpointing, wandb) as committed. A key renamed there fails
    here instead of being added."""
    cfg = yaml.safe_load((ROOT / "configs" / committed).read_text())

    def shrink(section: dict, **values) -> None:
        missing = set(values) - set(section)
        assert not missing, f"qwen3_8b.yaml no longer has {sorted(missing)}"
        section.update(values)

    if "num_layers" in cfg["model"]:  # the SFT config reads the shape from model.init_from
        shrink(cfg["model"], num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
               num_query_groups=2, head_dim=16, rope_theta=10000.0)
    shrink(cfg["data"], seq_length=128, micro_batch_size=1, global_batch_size=2, num_workers=1, num_streams=4)
    shrink(cfg["optimizer"], warmup_steps=2)
    shrink(cfg["logging"], log_interval=1)
    shrink(cfg["logging"]["wandb"], enabled=True)
    cfg["logging"]["wandb"]["mode"] = "offline"  # no network in CI
    cfg["logging"]["progress_bar"] = False
    shrink(cfg["trainer"], eval_interval=4, eval_iters=1)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def write_corpus(directory: Path, documents: int = 400) -> None:
    directory.mkdir(parents=True)
    with open(directory / "part-000.jsonl", "w") as f:
        for i in range(documents):
            start = (7 * i) % 90
            f.write(json.dumps({"text": f"Count from {start} to {start + 8}: "
                                + " ".join(str(n) for n in range(start, start + 9))}) + "\n")


def write_chats(path: Path, conversations: int = 200) -> None:
    """SFT conversations in the messages layout: a question and its counted answer."""
    with open(path, "w") as f:
        for i in range(conversations):
            start = (5 * i) % 90
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Count from {start} to {start + 5}."},
                {"role": "assistant", "content": " ".join(str(n) for n in range(start, start + 6))}]}) + "\n")


def write_arc(directory: Path) -> None:
    """ARC-Challenge and ARC-Easy as the hub publishes them: a directory of parquet splits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = [("Which is a planet?", ["Moon", "Mars", "Sun", "Comet"], "B"),
                 ("What do plants need to grow?", ["Light", "Sand", "Salt", "Plastic"], "A"),
                 ("Which is a liquid at room temperature?", ["Iron", "Ice", "Water", "Wood"], "C")]
    for subset in ("ARC-Challenge", "ARC-Easy"):
        (directory / subset).mkdir(parents=True)
        for split in ("test", "train", "validation"):
            rows = [{"id": f"{subset}-{split}-{i}", "question": q,
                     "choices": {"text": options, "label": list("ABCD")}, "answerKey": answer}
                    for i, (q, options, answer) in enumerate(questions)]
            pq.write_table(pa.Table.from_pylist(rows), directory / subset / f"{split}-00000-of-00001.parquet")


# ---------------------------------------------------------------------- the run


def harness_before_sft(harness: Path) -> str:
    """Bash run before the SFT jobs: what time does on a cluster, and waiting for the queue."""
    return f"""
# -- test harness: the chain's first job stops once it has saved a checkpoint, as its time limit would stop it
__first=$(squeue -h -n wedlm -o %i | sort -n | head -n 1)
echo "$__first" > {harness}/stopped_job
__deadline=$((SECONDS + 600))
until compgen -G "$RUN_DIR/checkpoints/iter_???????" >/dev/null; do
  (( SECONDS < __deadline )) || {{ echo "harness: job $__first saved no checkpoint" >&2; exit 1; }}
  sleep 0.2
done
scancel "$__first"
{WAIT_FOR_QUEUE}"""


#: bash: wait until the queue is empty (the guide's "once the chain has ended")
WAIT_FOR_QUEUE = """__deadline=$((SECONDS + 600))
until [ -z "$(squeue -h -o %i)" ]; do
  (( SECONDS < __deadline )) || { echo "harness: jobs still queued" >&2; squeue >&2; exit 1; }
  sleep 1
done
"""


@dataclass
class Walkthrough:
    root: Path
    cluster: SlurmCluster
    stdout: str
    outputs: dict[int, str]  # block number -> what it printed
    blocks: list[Block]

    def path(self, name: str) -> Path:
        value = re.search(rf"^(?:export )?{name}=(\S+)", tiny_settings(self.root, 0), re.MULTILINE).group(1)
        return Path(value)

    def output_of(self, fragment: str) -> str:
        """What the one block whose text holds ``fragment`` printed."""
        numbers = [b.number for b in self.blocks if fragment in b.text and not b.skipped]
        assert len(numbers) == 1, f"{len(numbers)} blocks hold {fragment!r}"
        return self.outputs[numbers[0]]


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory) -> Walkthrough:
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    from megatron_wedlm.runtime.multiprocess import find_free_port

    root = tmp_path_factory.mktemp("cluster_guide")
    write_hf_model(root / "models" / "Qwen3-tiny")
    write_tiny_config(root / "tiny_qwen3_8b.yaml")
    write_tiny_config(root / "tiny_sft_qwen3_8b.yaml", "sft/qwen3_8b.yaml")
    write_chats(root / "chats.jsonl")
    write_corpus(root / "corpus")
    write_arc(root / "data" / "ai2_arc")
    harness = root / "harness"
    harness.mkdir()
    blocks = bash_blocks(GUIDE.read_text())
    script = root / "guide.sh"
    script.write_text(compose_script(blocks, tiny_settings(root, find_free_port()),
                                     before={"SCRIPT=sft/sft_wedlm.py": harness_before_sft(harness),
                                             "megatron-to-hf": WAIT_FOR_QUEUE}))

    with SlurmCluster(root / "slurm", cpus=72, gpus=8) as cluster:
        env = {**cluster.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "MEGATRON_WEDLM_CPU": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(root / "guide.out", "w") as out, open(root / "guide.err", "w") as err:
            process = subprocess.Popen(["bash", str(script)], stdout=out, stderr=err, env=env, cwd=ROOT,
                                       start_new_session=True)
            try:
                rc: int | str = process.wait(SCRIPT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = f"still running after {SCRIPT_TIMEOUT_S} s"
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)  # the script and what it left in the background
                    process.wait()
        stdout = (root / "guide.out").read_text()
        if rc != 0:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted((root / "runs" / "logs").glob("*")))
            pytest.fail(f"the guide's blocks failed (exit {rc}):\n{stdout[-3000:]}\n--- stderr\n"
                        f"{(root / 'guide.err').read_text()[-6000:]}\n{logs}")
        yield Walkthrough(root, cluster, stdout, block_outputs(stdout), blocks)


# ---------------------------------------------------------------------- what the guide promises


def test_every_block_ran(walkthrough):
    ran = [b.number for b in walkthrough.blocks[1:] if not b.skipped]
    assert sorted(walkthrough.outputs) == ran and walkthrough.stdout.rstrip().endswith("@@end@@")


def test_conversion_adds_the_mask_token_and_describes_the_model(walkthrough):
    described = json.loads((walkthrough.path("MCORE") / "wedlm_model.json").read_text())
    assert described["architecture"] == "qwen3" and described["qk_layernorm"] is True
    tokenizer = json.loads((walkthrough.path("MCORE") / "tokenizer.json").read_text())
    assert any(t["content"] == "<|mask|>" and t["id"] == described["mask_token_id"] for t in tokenizer["added_tokens"])


def test_the_corpus_is_prepared_into_shards_and_a_held_out_part(walkthrough):
    manifest = json.loads((walkthrough.path("DATA") / "manifest.json").read_text())
    valid = json.loads((walkthrough.path("DATA") / "valid" / "manifest.json").read_text())
    assert len(list(walkthrough.path("DATA").glob("shard-*.tar"))) >= 4  # the tiny config's num_streams
    assert manifest["num_samples"] + valid["num_samples"] == 400 and valid["num_samples"] > 0


def _jobs(walkthrough) -> list[dict[str, str]]:
    ids = re.findall(r"Submitted batch job (\d+)", walkthrough.stdout)
    return [walkthrough.cluster.job(i) for i in ids]


def _log_tail(walkthrough, job: dict[str, str]) -> str:
    """The end of a job's log (the guide's ``--output "$LOGS/%x-%j.out"``), for a failure message."""
    log = walkthrough.path("LOGS") / f"{job['JobName']}-{job['JobId']}.out"
    return f"{job}\n--- {log}\n" + (log.read_text()[-6000:] if log.is_file() else "(no log)")


def test_the_chain_runs_one_job_at_a_time_and_the_second_continues_the_first(walkthrough):
    first, second, spare, evaluation = _jobs(walkthrough)[:4]
    assert [j["JobName"] for j in (first, second, spare, evaluation)] == ["wedlm"] * 3 + ["wedlm-eval"]
    stopped = (walkthrough.root / "harness" / "stopped_job").read_text().strip()
    assert first["JobId"] == stopped and first["JobState"] == "CANCELLED"
    assert second["JobState"] == "COMPLETED" and second["ExitCode"] == "0:0", _log_tail(walkthrough, second)
    assert evaluation["JobState"] == "COMPLETED" and evaluation["ExitCode"] == "0:0", _log_tail(walkthrough, evaluation)
    assert second["StartTime"] >= first["EndTime"]  # singleton: the second waited for the first to end
    # a job left over once the run is done loads its last checkpoint and ends, training nothing
    assert spare["JobState"] == "COMPLETED" and spare["ExitCode"] == "0:0" and spare["StartTime"] >= second["EndTime"]
    spare_log = (walkthrough.path("LOGS") / f"wedlm-{spare['JobId']}.out").read_text()
    assert f"iter_{TRAIN_STEPS:07d}" in spare_log and "saved checkpoint" not in spare_log

    run = walkthrough.path("RUN_DIR")
    final = json.loads((run / "checkpoints" / f"iter_{TRAIN_STEPS:07d}" / "trainer_state.json").read_text())
    lineage = final["lineage"]
    assert len(lineage) == 2, lineage  # the first job's run, then the second job's, resumed from it
    resumed_at = lineage[1]["from_step"]
    assert SAVE_INTERVAL <= resumed_at < TRAIN_STEPS
    # scancel's SIGTERM stopped the first job at the end of a step, which it saved: nothing to train again
    first_log = (walkthrough.path("LOGS") / f"wedlm-{first['JobId']}.out").read_text()
    assert f"stopped by SIGTERM after step {resumed_at} of {TRAIN_STEPS}, saved" in first_log, first_log[-3000:]
    assert final["run_id"] == lineage[1]["run_id"] and final["parent"].endswith(f"iter_{resumed_at:07d}")
    second_log = (walkthrough.path("LOGS") / f"wedlm-{second['JobId']}.out").read_text()
    assert f"resumed from {run}/checkpoints/iter_{resumed_at:07d}" in second_log
    assert f"tp {TP} x pp {PP} x cp {CP} x dp 1" in second_log

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, TRAIN_STEPS + 1))  # each step once
    assert not (run / METRICS_ABANDONED_FILE).exists()  # no step of the stopped job went unsaved
    assert {r["run_id"] for r in records if r["step"] <= resumed_at} == {lineage[0]["run_id"]}
    assert {r["run_id"] for r in records if r["step"] > resumed_at} == {lineage[1]["run_id"]}


def test_both_jobs_and_the_evaluation_log_to_one_wandb_run(walkthrough):
    from megatron_wedlm.testing.wandb_offline import read_history

    run = walkthrough.path("RUN_DIR")
    run_id = json.loads((run / "checkpoints" / f"iter_{TRAIN_STEPS:07d}" / "trainer_state.json").read_text())[
        "wandb_run_id"]
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) >= 3 and {d.name.rsplit("-", 1)[1] for d in offline} == {run_id}  # 2 jobs + the evaluation
    history = read_history(run / "wandb")
    trained = {h["_step"] for h in history if "loss" in h}
    # the second job's steps; scancel's SIGTERM reached the first job's wandb service too (SLURM signals
    # every process of the job), so what it had not yet written died with it: metrics.jsonl has every step
    resumed_at = json.loads((run / "checkpoints" / f"iter_{TRAIN_STEPS:07d}" / "trainer_state.json").read_text())[
        "lineage"][1]["from_step"]
    assert trained >= set(range(resumed_at + 1, TRAIN_STEPS + 1))
    assert any("valid/loss" in h for h in history)
    evaluated = [h for h in history if "eval/step" in h]
    assert TRAIN_STEPS in {h["eval/step"] for h in evaluated}
    assert all("eval/paper:arc_c/ar/accuracy" in h for h in evaluated)


def test_follow_evaluates_checkpoints_of_both_jobs_up_to_the_last_step(walkthrough):
    from megatron_wedlm.eval.follow import read_evals

    run = walkthrough.path("RUN_DIR")
    rows = read_evals(run)
    lineage = json.loads((run / "checkpoints" / f"iter_{TRAIN_STEPS:07d}" / "trainer_state.json").read_text())[
        "lineage"]
    assert {row["run_id"] for row in rows} == {entry["run_id"] for entry in lineage}  # across the gap between jobs
    assert rows[-1]["step"] == TRAIN_STEPS and [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    for row in rows:
        for task in ("paper:arc_c", "paper:arc_e"):
            for config in ("ar", "streaming_tau0.4"):
                assert 0.0 <= row["metrics"][f"eval/{task}/{config}/accuracy"] <= 1.0
        report = json.loads((Path(row["report"]) / "report.json").read_text())
        assert {r["num_examples"] for r in report["results"]} == {2}  # EVAL_LIMIT


def test_the_export_loads_as_a_qwen3_causal_lm_with_the_mask_token(walkthrough):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = walkthrough.path("HF_OUT")
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("Count from 3 to 7:")["input_ids"]])).logits
    assert torch.isfinite(logits).all()


def test_sft_continues_the_pretraining_run_and_is_evaluated_with_the_chat_template(walkthrough):
    sft_job, sft_eval = _jobs(walkthrough)[4:]
    assert (sft_job["JobName"], sft_job["JobState"], sft_job["ExitCode"]) == ("wedlm-sft", "COMPLETED", "0:0")
    assert (sft_eval["JobName"], sft_eval["JobState"], sft_eval["ExitCode"]) == ("wedlm-sft-eval", "COMPLETED", "0:0")
    run, cpt = walkthrough.path("SFT_RUN_DIR"), walkthrough.path("RUN_DIR")
    log = (walkthrough.path("LOGS") / f"wedlm-sft-{sft_job['JobId']}.out").read_text()
    assert "sft: WeDLM training" in log and f"tp {TP} x pp {PP} x cp {CP} x dp 1" in log, log[-3000:]
    assert "no validation" not in log  # data.valid_path: auto found the held-out conversations
    saved = yaml.safe_load((run / "checkpoints" / f"iter_{SFT_STEPS:07d}" / "config.yaml").read_text())
    assert saved["model"]["init_from"] == str(cpt / "checkpoints" / f"iter_{TRAIN_STEPS:07d}")
    assert saved["data"]["valid_path"] == str(walkthrough.path("SFT_DATA") / "valid")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, SFT_STEPS + 1))
    assert any("valid/loss" in r for r in records)
    from megatron_wedlm.eval.follow import read_evals

    rows = read_evals(run)
    assert [r["step"] for r in rows] == list(range(SAVE_INTERVAL, SFT_STEPS + 1, SAVE_INTERVAL))
    report = json.loads((Path(rows[-1]["report"]) / "report.json").read_text())
    assert report["settings"]["chat"] is True


def test_the_server_answers_curl_and_the_openai_sdk(walkthrough):
    replies = [json.loads(line) for line in walkthrough.output_of("/v1/chat/completions").splitlines()
               if line.startswith("{")]
    assert len(replies) == 1 and replies[0]["model"] == "wedlm-8b-instruct"
    assert replies[0]["usage"]["completion_tokens"] > 0 and replies[0]["choices"][0]["message"]["content"]
    sdk = walkthrough.output_of("from openai import OpenAI")
    usage = re.search(r"completion_tokens=(\d+).*forwards=(\d+).*tokens_per_forward=([\d.]+)", sdk)
    assert usage, sdk
    tokens, forwards, per_forward = int(usage[1]), int(usage[2]), float(usage[3])
    assert tokens > 0 and forwards > 0 and per_forward == pytest.approx(tokens / forwards, rel=1e-3)
