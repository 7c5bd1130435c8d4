"""The masked-slot probe (megatron_wedlm/eval/slot_probe.py, tools/probe_masked_slots.py) against
one unpadded forward per cut, on a tiny saved model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megatron_wedlm.decoding import load_tokenizer, load_wedlm_model
from megatron_wedlm.decoding.sampling import entropy
from megatron_wedlm.eval.builtin_tasks import completion_of, builtin_task
from megatron_wedlm.eval.slot_probe import format_probe, probe_masked_slots
from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TAUS = (0.6, 1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_wedlm_probe")
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, arch="qwen2")
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # entropies spread around the taus: some slots commit, some not
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _examples(tokenizer, n=4):
    out = []
    for e in builtin_task("counting", n).examples:
        prompt = tokenizer.encode(e.prompt)
        out.append((prompt, tokenizer.encode(e.prompt + completion_of(e.reference))[len(prompt):]))
    return out


def test_probe_equals_one_forward_per_cut(checkpoint):
    model, tokenizer = load_wedlm_model(checkpoint, device="cpu"), load_tokenizer(checkpoint)
    mask, window, penalty = model.config.mask_token_id, 6, 0.02
    examples = _examples(tokenizer)
    # an answer alternating the model's favourite prediction with another token, so that some of its
    # wrong argmaxes are its neighbours' tokens (slips)
    prompt = examples[0][0]
    with torch.no_grad():
        first = model(torch.tensor([prompt + [mask] * window])).logits[0, -window:]
    first[:, mask] = torch.finfo(first.dtype).min
    favourite = int(first.argmax(-1).mode().values)
    other = next(t for t in examples[0][1] if t != favourite)
    examples.append((prompt, [favourite, other] * 4))
    states, correct, slipped = [0] * window, [0] * window, [0] * window
    commits = {t: [0] * window for t in TAUS}
    wrong = {t: [0] * window for t in TAUS}
    wrong_commits: list[tuple[float, int, int, int]] = []  # (tau, distance, predicted, reference)
    for prompt, answer in examples:
        for c in range(len(answer)):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + answer[:c] + [mask] * window])).logits[0, -window:]
            logits[:, mask] = torch.finfo(logits.dtype).min
            h = entropy(logits)
            for d in range(min(window, len(answer) - c)):
                token, j = int(logits[d].argmax()), c + d
                right = token == answer[j]
                states[d] += 1
                correct[d] += right
                neighbours = [answer[i] for i in (j - 1, j + 1) if 0 <= i < len(answer)]
                slipped[d] += not right and token in neighbours
                for t in TAUS:
                    if h[d] + penalty * d < t:
                        commits[t][d] += 1
                        wrong[t][d] += not right
                        if not right:
                            wrong_commits.append((t, d, int(logits[d].argmax()), answer[c + d]))
    # end tokens: the most frequent wrong prediction, and the most frequent reference of the other
    # wrong commits, so that both early ends (an end predicted) and late ends (an end due) occur
    predicted = [p for _, _, p, _ in wrong_commits]
    common = max(set(predicted), key=predicted.count)
    due = [r for _, _, p, r in wrong_commits if p != common and r != common]
    ends = {common, max(set(due), key=due.count)}
    early = {t: [0] * window for t in TAUS}
    late = {t: [0] * window for t in TAUS}
    for t, d, p, r in wrong_commits:
        early[t][d] += p in ends and r not in ends
        late[t][d] += r in ends and p not in ends
    stats = probe_masked_slots(model, examples, mask_token_id=mask, window_size=window, distance_penalty=penalty,
                               taus=TAUS, rows_per_forward=5, end_token_ids=ends)  # several forwards per answer
    assert [s.states for s in stats] == states
    assert states[0] == sum(len(a) for _, a in examples)
    assert [s.correct for s in stats] == correct
    assert [s.slipped for s in stats] == slipped
    for t in TAUS:
        assert [s.commits[t] for s in stats] == commits[t]
        assert [s.wrong[t] for s in stats] == wrong[t]
        assert [s.early_end[t] for s in stats] == early[t] and [s.late_end[t] for s in stats] == late[t]
    assert sum(early[TAUS[1]]) > 0 and sum(late[TAUS[1]]) > 0
    assert 0 < sum(commits[TAUS[0]]) < sum(commits[TAUS[1]])  # the taus separate: the check is not vacuous
    assert sum(wrong[TAUS[1]]) > 0 and sum(slipped) > 0
    table = format_probe(stats, TAUS, max_distance=3)
    assert f"{wrong[TAUS[0]][0]}/{commits[TAUS[0]][0]}" in table and len(table.splitlines()) == 4 + len(TAUS)
    assert len(format_probe(stats, TAUS, max_distance=3, ends=True).splitlines()) == 4 + 3 * len(TAUS)


def _cli():
    spec = importlib.util.spec_from_file_location("probe_cli", ROOT / "tools" / "probe_masked_slots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reads_pairs_and_names_a_bad_line(checkpoint, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Count from 3 to 6:", "response": " 3 4 5 6\\n"}\n\n'
                     '{"prompt": "Repeat a b:", "response": " a b\\n"}\n')
    out = tmp_path / "probe.json"
    assert _cli().main(["--model", str(checkpoint), "--pairs", str(pairs), "--window-size", "4",
                        "--taus", "0.5,2", "--json", str(out), "--device", "cpu"]) == 0
    tokenizer = load_tokenizer(checkpoint)
    lengths = [len(tokenizer.encode(p + r)) - len(tokenizer.encode(p))
               for p, r in [("Count from 3 to 6:", " 3 4 5 6\n"), ("Repeat a b:", " a b\n")]]
    result = json.loads(out.read_text())["tasks"]["pairs.jsonl"]
    assert [d["states"] for d in result] == [sum(max(0, n - d) for n in lengths) for d in range(4)]
    assert set(result[0]["early_end"]) == set(result[0]["late_end"]) == {"0.5", "2"}
    assert all(0 <= d["slipped"] <= d["states"] - d["correct"] for d in result)
    assert "2 answers" in capsys.readouterr().out

    pairs.write_text('{"prompt": "Count from 3 to 6:", "response": " 3 4 5 6\\n"}\n{"prompt": "x"}\n')
    with pytest.raises(SystemExit, match=r"pairs\.jsonl:2: expected a JSON object"):
        _cli().main(["--model", str(checkpoint), "--pairs", str(pairs), "--device", "cpu"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _cli().main(["--model", str(checkpoint), "--pairs", str(pairs), "--taus", "0.2,high"])
    assert "argument --taus: expected comma-separated numbers, got '0.2,high'" in capsys.readouterr().err


def test_cli_chat_answers_end_at_eos(checkpoint, tmp_path):
    """--chat probes what evaluate.py --chat decodes: the prompt as a user turn, the stripped reply, EOS."""
    chat_dir = tmp_path / "chat"
    tokenizer = load_tokenizer(checkpoint)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    tokenizer.save_pretrained(chat_dir)
    load_wedlm_model(checkpoint, device="cpu").save_pretrained(chat_dir)
    pairs = tmp_path / "pairs.jsonl"
    replies = [("Count from 3 to 6:", " 3 4 5 6\n"), ("Repeat a b c:", " a b c\n")]
    pairs.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in replies))
    out = tmp_path / "probe.json"
    assert _cli().main(["--model", str(chat_dir), "--pairs", str(pairs), "--chat", "--window-size", "4",
                        "--taus", "0.5", "--json", str(out), "--device", "cpu"]) == 0
    lengths = [len(tokenizer.encode(r.strip(), add_special_tokens=False)) + 1 for _, r in replies]
    result = json.loads(out.read_text())["tasks"]["pairs.jsonl"]
    assert [d["states"] for d in result] == [sum(max(0, n - d) for n in lengths) for d in range(4)]

    examples = _cli()._answer_ids(tokenizer, *replies[0], "pairs.jsonl:1", chat=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": replies[0][0]}], tokenize=False,
                                         add_generation_prompt=True)
    assert tokenizer.decode(examples[0]) == text
    assert examples[1][-1] == tokenizer.eos_token_id and tokenizer.decode(examples[1][:-1]) == "3 4 5 6"
