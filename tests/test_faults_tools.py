"""Tools that write (converter, export, prepare_data) under faults: issue 19, items 4, 5 and 9.

Each case is a probe that lost a user's work before: an output that overlaps its input, a
failing run over a good earlier output, a mistyped --input with --overwrite, a full disk (while
converting, exporting, preparing data and saving a training checkpoint), truncated input files,
non-UTF-8 text, head counts that do not split the model. Everything is real: tiny HF checkpoints
converted by the real converter, real prepare_data runs, a real training rank, and a real 64 KiB
tmpfs for the full disk (skipped where mounting is not allowed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_conversion import make_hf_dir, safetensors_of
from test_prepare_data import read_shards, tokenizer_dir  # noqa: F401 - tokenizer_dir is a fixture

from megatron_wedlm.config import ConfigError, load_config
from megatron_wedlm.conversion import ConversionError, convert_hf_to_megatron, convert_megatron_to_hf
from megatron_wedlm.data.manifest import read_manifest
from megatron_wedlm.data.prepare import InvalidUtf8Error, PrepareOptions, prepare_dataset
from megatron_wedlm.model.hf_config import UnsupportedModelError, model_args_from_hf_config
from megatron_wedlm.runtime.atomic_output import DiskFullError

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "pretrain" / "tiny_cpu.yaml"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (relative path -> content hash)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def leftovers(output: Path) -> list[str]:
    """Temporary siblings a writer of ``output`` left behind."""
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f"{output.name}.tmp-")
                  or p.name.startswith(f"{output.name}.old-"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A tiny Qwen2 HF directory ``hf``, its Megatron conversion ``megatron`` and export ``export``."""
    root = tmp_path_factory.mktemp("faults")
    make_hf_dir(root / "hf", "qwen2", tied=False)
    convert_hf_to_megatron(root / "hf", root / "megatron")
    convert_megatron_to_hf(root / "megatron", root / "export")
    return root


@pytest.fixture
def work(checkpoints, tmp_path) -> Path:
    """Writable copies of the three directories (a test may damage them)."""
    for name in ("hf", "megatron", "export"):
        shutil.copytree(checkpoints / name, tmp_path / name)
    return tmp_path


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A real 64 KiB tmpfs: writes past it fail with ENOSPC. Skipped where mounting is refused."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


# --------------------------------------------------------------------------------------------
# Item 4: convert_checkpoint.py
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("relation", ["same", "inside", "holds"])
def test_converter_refuses_an_output_that_overlaps_its_input(work, capsys, relation):
    source = work / "hf"
    output = {"same": source, "inside": source / "converted", "holds": work}[relation]
    before = snapshot(work)
    code = _tool("convert_checkpoint").main(
        ["hf-to-megatron", "--input", str(source), "--output", str(output), "--overwrite"]
    )
    assert code == 2
    assert f"the input {source}" in capsys.readouterr().err
    assert snapshot(work) == before


def test_export_of_its_own_input_directory_is_refused(work, capsys):
    before = snapshot(work / "megatron")
    code = _tool("convert_checkpoint").main(
        ["megatron-to-hf", "--input", str(work / "megatron"), "--output", str(work / "megatron"), "--overwrite"]
    )
    assert code == 2 and "is the input" in capsys.readouterr().err
    assert snapshot(work / "megatron") == before


def test_failed_export_over_a_good_export_leaves_it_as_it_was(work, capsys):
    distcp = sorted((work / "megatron").glob("*.distcp"))[-1]
    distcp.write_bytes(distcp.read_bytes()[:1000])  # an interrupted copy
    before = snapshot(work / "export")
    code = _tool("convert_checkpoint").main(
        ["megatron-to-hf", "--input", str(work / "megatron"), "--output", str(work / "export"), "--overwrite"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{distcp} is truncated (1000 bytes" in err
    assert snapshot(work / "export") == before
    assert leftovers(work / "export") == []


def test_overwrite_replaces_the_old_output_whole_once_the_new_one_is_complete(work, checkpoints):
    (work / "export" / "stale.txt").write_text("from an earlier export")
    convert_megatron_to_hf(work / "megatron", work / "export", overwrite=True)
    assert not (work / "export" / "stale.txt").exists()
    original, exported = safetensors_of(checkpoints / "hf"), safetensors_of(work / "export")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    assert leftovers(work / "export") == []


def test_truncated_safetensors_input_is_named_and_nothing_is_written(work):
    weights = work / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = snapshot(work / "megatron")
    unreadable = rf"{weights} \(\d+ bytes\) is not a readable safetensors file.*truncated"
    with pytest.raises(ConversionError, match=unreadable):
        convert_hf_to_megatron(work / "hf", work / "megatron", overwrite=True)
    assert snapshot(work / "megatron") == before


# --------------------------------------------------------------------------------------------
# Item 5: prepare_data.py
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path, tokenizer_dir) -> Path:  # noqa: F811 - the imported fixture
    """A prepared dataset at ``tmp_path/data`` made from ``tmp_path/corpus/docs.jsonl``."""
    (tmp_path / "corpus").mkdir()
    lines = [json.dumps({"text": f"Count from {i} to {i + 5}"}) for i in range(20)]
    (tmp_path / "corpus" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_dataset([tmp_path / "corpus"], tmp_path / "data", tokenizer_dir, PrepareOptions(samples_per_shard=8))
    return tmp_path / "data"


def _prepare_cli(*args: str) -> int:
    return _tool("prepare_data").main(list(args))


def test_overwrite_with_a_mistyped_input_keeps_the_shards(prepared, tokenizer_dir, capsys):  # noqa: F811
    before = snapshot(prepared)
    typo = prepared.parent / "corpus" / "dosc.jsonl"
    code = _prepare_cli("--input", str(typo), "--tokenizer", str(tokenizer_dir), "--output", str(prepared),
                        "--overwrite")
    assert code == 2 and f"input {typo} does not exist" in capsys.readouterr().err
    assert snapshot(prepared) == before
    assert len(read_shards(prepared)) == 20


def test_a_run_that_fails_midway_keeps_the_previous_output(prepared, tokenizer_dir, capsys):  # noqa: F811
    junk = prepared.parent / "junk.jsonl"
    junk.write_text("not json\n{\"txt\": 1}\n")
    before = snapshot(prepared)
    code = _prepare_cli("--input", str(junk), "--tokenizer", str(tokenizer_dir), "--output", str(prepared),
                        "--overwrite")
    assert code == 2 and "no usable samples" in capsys.readouterr().err
    assert snapshot(prepared) == before
    assert leftovers(prepared) == []


def test_prepare_refuses_an_output_inside_an_input_directory(prepared, tokenizer_dir, capsys):  # noqa: F811
    corpus = prepared.parent / "corpus"
    code = _prepare_cli("--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output", str(corpus / "shards"))
    assert code == 2 and f"is inside the input {corpus}" in capsys.readouterr().err
    assert sorted(p.name for p in corpus.iterdir()) == ["docs.jsonl"]


# --------------------------------------------------------------------------------------------
# Item 9: non-UTF-8 input, full disk, head counts
# --------------------------------------------------------------------------------------------


@pytest.fixture
def mixed_encoding(tmp_path) -> tuple[Path, Path]:
    """A jsonl file with two invalid bytes on line 2, and a Latin-1 text file (one bad byte on line 3)."""
    jsonl = tmp_path / "in" / "docs.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_bytes(b'{"text": "clean line"}\n{"text": "bad \xff\xfe bytes"}\n{"text": "clean again"}\n')
    text = tmp_path / "in" / "book.txt"
    text.write_bytes(b"first paragraph\n\ncaf\xe9 au lait\n")
    return jsonl, text


def test_invalid_utf8_stops_the_run_naming_file_and_line(mixed_encoding, tmp_path, tokenizer_dir):  # noqa: F811
    jsonl, _ = mixed_encoding
    with pytest.raises(InvalidUtf8Error, match=rf"{jsonl}:2: invalid UTF-8 \(byte 0xff\).*--encoding-errors replace"):
        prepare_dataset([jsonl], tmp_path / "out", tokenizer_dir)
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_replaced_on_request_is_counted_per_file(mixed_encoding, tmp_path, tokenizer_dir):  # noqa: F811
    jsonl, text = mixed_encoding
    reported: list[str] = []
    summary = prepare_dataset([jsonl, text], tmp_path / "out", tokenizer_dir,
                              PrepareOptions(encoding_errors="replace"), report=reported.append)
    expected = {str(jsonl): {"bytes": 2, "lines": 1, "first_line": 2},
                str(text): {"bytes": 1, "lines": 1, "first_line": 3}}
    assert summary.invalid_utf8 == expected
    assert read_manifest(tmp_path / "out")["invalid_utf8"] == expected
    assert f"{jsonl}:2: replaced 2 invalid UTF-8 byte(s) on 1 line(s) by U+FFFD" in reported
    assert "replaced 3 invalid UTF-8 bytes by U+FFFD in 2 file(s)" in summary.describe()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    decoded = [tok.decode(tokens, skip_special_tokens=True) for tokens, _ in read_shards(tmp_path / "out")]
    assert decoded == ["clean line", "bad \ufffd\ufffd bytes", "clean again", "first paragraph", "caf\ufffd au lait"]


def test_full_disk_during_conversion_is_named_and_the_previous_output_kept(small_disk, checkpoints):
    previous = small_disk / "converted"
    previous.mkdir()
    (previous / "wedlm_model.json").write_text("{}")  # a small earlier output that must survive
    output = small_disk / "converted"
    with pytest.raises(DiskFullError, match=f"no space left on device while writing {output}"):
        convert_hf_to_megatron(checkpoints / "hf", output, overwrite=True)
    assert snapshot(previous) == {"wedlm_model.json": hashlib.sha256(b"{}").hexdigest()}
    assert leftovers(output) == []


def test_full_disk_during_export_is_named(small_disk, checkpoints):
    output = small_disk / "export"
    with pytest.raises(DiskFullError, match=f"no space left on device while writing {output}"):
        convert_megatron_to_hf(checkpoints / "megatron", output)
    assert sorted(p.name for p in small_disk.iterdir()) == []


def test_full_disk_during_prepare_data_is_named(small_disk, tmp_path, tokenizer_dir, capsys):  # noqa: F811
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "1 2 3 4 5 6 7 8 9 " * 8}) + "\n"
                              for i in range(300)))
    output = small_disk / "data"
    code = _prepare_cli("--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output", str(output))
    assert code == 2
    assert f"no space left on device while writing {output}" in capsys.readouterr().err
    assert sorted(p.name for p in small_disk.iterdir()) == []


def full_disk_training_worker(data_dir: str, out_dir: str, checkpoint_dir: str) -> str:
    """One training rank whose checkpoints go to the small disk; returns the error it stopped with."""
    from megatron_wedlm.training.loop import run_training

    overrides = [f"data.path={data_dir}", f"trainer.output_dir={out_dir}", f"checkpointing.dir={checkpoint_dir}",
                 "trainer.train_steps=2", "optimizer.warmup_steps=0", "logging.progress_bar=false"]
    try:
        run_training(load_config(TINY_CONFIG, overrides))
    except DiskFullError as err:
        return str(err)
    return "no error"


def test_full_disk_during_a_training_save_is_named(small_disk, tmp_path, tokenizer_dir):  # noqa: F811
    from megatron_wedlm.runtime.multiprocess import run_distributed

    corpus = tmp_path / "corpus.jsonl"
    counts = [" ".join(str(n) for n in range(i, i + 10)) for i in range(64)]
    corpus.write_text("".join(json.dumps({"text": f"Count: {text}"}) + "\n" for text in counts))
    prepare_dataset([corpus], tmp_path / "data", tokenizer_dir, PrepareOptions(samples_per_shard=8))
    [message] = run_distributed(full_disk_training_worker, 1, str(tmp_path / "data"), str(tmp_path / "run"),
                                str(small_disk / "checkpoints"), timeout_s=300)
    assert message.startswith(f"[Errno 28] no space left on device while writing {small_disk / 'checkpoints'}")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.num_attention_heads=6"], r"model\.num_attention_heads=6 does not divide model\.hidden_size=64"),
        (["model.num_query_groups=3"], r"model\.num_query_groups=3 does not divide model\.num_attention_heads=4"),
    ],
    ids=["heads-hidden", "groups-heads"],
)
def test_head_counts_that_do_not_split_the_model_are_refused_at_config_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_CONFIG, overrides)


def test_an_explicit_head_dim_lifts_the_hidden_size_rule():
    cfg = load_config(TINY_CONFIG, ["model.num_attention_heads=6", "model.num_query_groups=2", "model.head_dim=16"])
    assert (cfg.model.num_attention_heads, cfg.model.head_dim) == (6, 16)


def test_hf_config_head_counts_are_checked_before_converting(work, capsys):
    config_file = work / "hf" / "config.json"
    raw = json.loads(config_file.read_text())
    del raw["head_dim"]
    config_file.write_text(json.dumps({**raw, "num_attention_heads": 6}))
    code = _tool("convert_checkpoint").main(
        ["hf-to-megatron", "--input", str(work / "hf"), "--output", str(work / "out")]
    )
    assert code == 2
    assert "num_attention_heads=6 does not divide hidden_size=32" in capsys.readouterr().err
    assert not (work / "out").exists()
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=3 does not divide num_attention_heads=4"):
        model_args_from_hf_config({**raw, "num_key_value_heads": 3})
