"""tools/prepare_data.py: text/jsonl/chat -> webdataset shards; bad lines skipped, counted, reported."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_wedlm.data.manifest import read_manifest
from megatron_wedlm.data.prepare import PrepareOptions, prepare_dataset
from megatron_wedlm.testing.tiny_models import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny tokenizer *without* a mask token (prepare_data must add one)."""
    directory = tmp_path_factory.mktemp("tok")
    tok = build_tiny_tokenizer()
    tok.mask_token = None
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(str(directory))
    return directory


def read_shards(data_dir: Path) -> list[tuple[list[int], dict]]:
    """Every sample of a prepared directory, read back with webdataset, in shard order."""
    from webdataset.tariterators import tarfile_samples

    manifest = read_manifest(data_dir)
    samples = []
    for shard in manifest["shards"]:
        for sample in tarfile_samples([{"url": str(data_dir / shard["path"])}]):
            tokens = np.load(io.BytesIO(sample["tokens.npy"])).tolist()
            samples.append((tokens, json.loads(sample["json"])))
    return samples


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_pretrain_jsonl_bad_lines_are_skipped_counted_and_reported(tmp_path, tokenizer_dir):
    good = ["Count from 3 to 7: 3 4 5 6 7", "The quick brown fox.", "literal <|mask|> text is plain text"]
    src = write_lines(
        tmp_path / "docs.jsonl",
        [
            json.dumps({"text": good[0]}),
            "{not json",
            json.dumps({"txt": "wrong field"}),
            "",
            json.dumps({"text": "   "}),
            json.dumps({"text": good[1]}),
            json.dumps(["not", "an", "object"]),
            json.dumps({"text": 42}),
            json.dumps({"text": good[2]}),
        ],
    )
    reported: list[str] = []
    summary = prepare_dataset([src], tmp_path / "out", tokenizer_dir,
                              PrepareOptions(samples_per_shard=2), report=reported.append)
    assert summary.bad_lines == 5
    assert [line.split(": ", 1)[0] for line in reported] == [f"skipped {src}:{n}" for n in (2, 3, 5, 7, 8)]
    assert summary.bad_by_reason == {
        "invalid JSON": 1, "missing field 'text'": 1, "empty 'text'": 1,
        "not a JSON object": 1, "field 'text' is not a string": 1,
    }
    manifest = read_manifest(tmp_path / "out")
    assert manifest["bad_lines"] == 5 and manifest["num_samples"] == 3
    assert [s["samples"] for s in manifest["shards"]] == [2, 1]

    # the mask token was added, its id recorded, and the saved tokenizer knows it
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    assert summary.mask_token_added and saved.mask_token == "<|mask|>"
    assert saved.convert_tokens_to_ids("<|mask|>") == manifest["mask_token_id"] == summary.mask_token_id
    assert manifest["tokenizer_length"] == len(saved)

    samples = read_shards(tmp_path / "out")
    for (tokens, meta), text, line in zip(samples, good, (1, 6, 9)):
        expected = saved(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [saved.eos_token_id]
        assert tokens == expected
        assert meta == {"prompt_length": 0, "source": f"{src}:{line}"}
        assert manifest["mask_token_id"] not in tokens  # the literal "<|mask|>" stayed text


def test_text_files_split_into_paragraphs_or_lines(tmp_path, tokenizer_dir):
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "book.txt"
    src.write_text("first paragraph\nstill first\n\n\nsecond one\n")
    para = prepare_dataset([src], tmp_path / "p", tokenizer_dir, PrepareOptions(text_unit="paragraph", add_eos=False))
    lines = prepare_dataset([src], tmp_path / "l", tokenizer_dir, PrepareOptions(text_unit="line", add_eos=False))
    whole = prepare_dataset([tmp_path / "in"], tmp_path / "f", tokenizer_dir,
                            PrepareOptions(text_unit="file", add_eos=False))
    assert (para.num_samples, lines.num_samples, whole.num_samples) == (2, 3, 1)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "p" / "tokenizer"))
    decoded = [tok.decode(t) for t, _ in read_shards(tmp_path / "p")]
    assert decoded == ["first paragraph\nstill first", "second one"]
    assert [m["source"] for _, m in read_shards(tmp_path / "p")] == [f"{src}:1", f"{src}:5"]


def test_sft_chat_template_prompt_lengths(tmp_path, tokenizer_dir):
    chats = [
        {"messages": [{"role": "user", "content": "Count from 3 to 5:"}, {"role": "assistant", "content": " 3 4 5"}]},
        {"prompt": "12 + 35 =", "response": " 47"},
        {"messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat: a b"},
            {"role": "assistant", "content": "a b"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "a b"},
        ]},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]},
        {"prompt": "only a prompt"},
    ]
    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(c) for c in chats])
    reported: list[str] = []
    summary = prepare_dataset([src], tmp_path / "sft", tokenizer_dir,
                              PrepareOptions(task="sft", chat_template=CHAT_TEMPLATE), report=reported.append)
    assert summary.num_samples == 3 and summary.bad_lines == 3
    assert [r.split(": ", 1)[0] for r in reported] == [f"skipped {src}:{n}" for n in (4, 5, 6)]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "sft" / "tokenizer"))
    assert tok.chat_template == CHAT_TEMPLATE  # saved with the data
    for (tokens, meta), chat in zip(read_shards(tmp_path / "sft"), chats[:3]):
        messages = chat.get("messages") or [
            {"role": "user", "content": chat["prompt"]}, {"role": "assistant", "content": chat["response"]},
        ]
        k = meta["prompt_length"]
        assert tok.decode(tokens[:k]) == tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert tok.decode(tokens[k:]) == messages[-1]["content"] + "<|im_end|>\n"
    assert read_manifest(tmp_path / "sft")["task"] == "sft"
    # the reply ends "<|im_end|>\n": its last special token, not the newline nor EOS, ends a turn
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id and read_manifest(tmp_path / "sft")["end_token_id"] == im_end


def test_sft_without_template_needs_raw_mode(tmp_path, tokenizer_dir):
    src = write_lines(tmp_path / "pairs.jsonl", [json.dumps({"prompt": "1 2 3", "completion": " 4 5\n"})])
    with pytest.raises(ValueError, match="no chat template"):
        prepare_dataset([src], tmp_path / "x", tokenizer_dir, PrepareOptions(task="sft"))
    prepare_dataset([src], tmp_path / "raw", tokenizer_dir, PrepareOptions(task="sft", raw_sft=True))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "raw" / "tokenizer"))
    [(tokens, meta)] = read_shards(tmp_path / "raw")
    assert tok.decode(tokens[: meta["prompt_length"]]) == "1 2 3"
    assert tokens[meta["prompt_length"]:] == tok(" 4 5\n", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert read_manifest(tmp_path / "raw")["end_token_id"] == tok.eos_token_id


def test_reply_end_names_the_end_token_and_skips_replies_without_it(tmp_path, tokenizer_dir, capsys):
    """--reply-end: its one token becomes end_token_id in place of EOS; a reply that does not end
    with it (before EOS) is a bad line naming file:line; a text of several tokens, or pretraining
    data, is refused before anything is written."""
    pairs = [{"prompt": "Count from 3 to 5:", "response": " 3 4 5\n"}, {"prompt": "Repeat a b:", "response": " a b"},
             {"prompt": "12 + 35 =", "response": " 47\n"}]
    src = write_lines(tmp_path / "pairs.jsonl", [json.dumps(p) for p in pairs])
    out = tmp_path / "sft"
    argv = ["--task", "sft", "--raw-sft", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert _prepare_tool([*argv, "--reply-end", "\\n"]) == 0  # as a shell passes '\n'
    assert f"skipped {src}:2: the reply does not end with reply_end ('\\n')" in capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    [newline] = tok("\n", add_special_tokens=False)["input_ids"]
    manifest = read_manifest(out)
    assert (manifest["end_token_id"], manifest["reply_end"], manifest["num_samples"]) == (newline, "\n", 2)
    assert newline != tok.eos_token_id
    for tokens, meta in read_shards(out):
        assert tokens[-2:] == [newline, tok.eos_token_id] and meta["prompt_length"] < len(tokens) - 2
    for extra, message in ((["--reply-end", "4 5"], "must be one token"),
                           (["--reply-end", "\\n", "--task", "pretrain"], "no meaning for pretraining")):
        assert _prepare_tool([*argv, "--overwrite", *extra]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _prepare_tool([*argv, "--overwrite", "--reply-end", "\\x"])
    assert "--reply-end: '\\x' has a broken backslash escape" in capsys.readouterr().err
    assert read_manifest(out) == manifest  # the refused runs left the prepared directory as it was


def test_cli_summary_and_refusal_to_overwrite(tmp_path, tokenizer_dir):
    src = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "a b c"}), "oops", json.dumps({"text": ""})])
    cmd = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), "--input", str(src),
           "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{src}:2: invalid JSON" in proc.stderr and f"{src}:3: empty 'text'" in proc.stderr
    assert "skipped 2 bad lines" in proc.stdout and "wrote 1 samples" in proc.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--overwrite" in again.stderr


def _prepare_tool(argv: list[str]) -> int:
    """tools/prepare_data.py's main in this process (its argument parsing and summary included)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data_tool", ROOT / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_valid_fraction_holds_out_a_stable_share_into_a_prepared_directory(tmp_path, tokenizer_dir, capsys):
    from megatron_wedlm.data.manifest import tokenizer_dir_of
    from megatron_wedlm.data.prepare import holds_out

    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": f"document number {i}"}) for i in range(200)])
    args = ["--input", str(src), "--tokenizer", str(tokenizer_dir), "--samples-per-shard", "16",
            "--valid-fraction", "0.1"]
    assert _prepare_tool([*args, "--output", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert _prepare_tool([*args, "--output", str(tmp_path / "b")]) == 0

    train, valid = read_shards(tmp_path / "a"), read_shards(tmp_path / "a" / "valid")
    held = sorted(meta["source"] for _, meta in valid)
    # every document went to exactly one side, the side its source's hash says
    assert sorted(meta["source"] for _, meta in train + valid) == sorted(f"{src}:{i}" for i in range(1, 201))
    assert held == sorted(f"{src}:{i}" for i in range(1, 201) if holds_out(f"{src}:{i}", 0.1))
    assert 8 <= len(held) <= 35  # ~10% of 200
    assert held == sorted(meta["source"] for _, meta in read_shards(tmp_path / "b" / "valid"))  # a re-run: same split
    assert f"wrote {len(train)} samples" in printed and f"held out {len(valid)} samples" in printed

    manifest, valid_manifest = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "a" / "valid")
    assert manifest["valid"] == {"path": "valid", "fraction": 0.1, "num_samples": len(valid),
                                 "num_tokens": sum(len(t) for t, _ in valid)}
    assert (manifest["num_samples"], valid_manifest["num_samples"]) == (len(train), len(valid))
    for key in ("task", "mask_token_id", "eos_token_id", "tokenizer_length"):
        assert valid_manifest[key] == manifest[key]
    valid_tok = tokenizer_dir_of(tmp_path / "a" / "valid", valid_manifest)
    assert (valid_tok / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer" / "tokenizer.json").read_bytes()


def test_valid_fraction_that_holds_out_nothing_is_refused(tmp_path, tokenizer_dir, capsys):
    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": "one document"})])
    args = ["--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "out")]
    assert _prepare_tool([*args, "--valid-fraction", "1e-9"]) == 2
    assert "held out none of the 1 documents" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert _prepare_tool([*args, "--valid-fraction", "1.0"]) == 2
    assert "valid_fraction must be in [0, 1)" in capsys.readouterr().err
