"""The README's "Decoding in Python" snippet, run as written on a tiny exported chat model."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron_wedlm.decoding import generate
from megatron_wedlm.testing.serving import write_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
_PATH_LINE = re.compile(r'^path = "[^"]*"', re.MULTILINE)


def readme_snippet() -> str:
    """The ```python block of the README's "## Decoding in Python" section."""
    section = (ROOT / "README.md").read_text().split("\n## Decoding in Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, "the section holds one python block"
    return blocks[0]


def run_snippet(model_dir: Path) -> dict:
    """The snippet's names after running it verbatim, but for the model path."""
    code, n = _PATH_LINE.subn(f"path = {str(model_dir)!r}", readme_snippet())
    assert n == 1, 'the snippet names its model in one line `path = "..."`'
    names: dict = {}
    exec(compile(code, "README.md (Decoding in Python)", "exec"), names)  # noqa: S102 - the README's own code
    return names


def test_readme_snippet_stops_at_the_eos_of_the_generation_config(tmp_path, capsys):
    """A reply ends at the EOS ids of the model's ``generation_config.json``, as HF ``generate`` ends it,
    with no stop ids given.

    Not a tautology: the EOS is not chosen by the test's decode call but read by ``generate`` from the
    exported directory. A tiny random model rarely emits its tokenizer's EOS, so the test first decodes
    the snippet's prompt without any stop (``stop_token_ids=()``: all ``max_new_tokens``), takes a
    token the model greedily produces a few tokens in (first there), writes it as the generation
    config's ``eos_token_id`` and runs the snippet again. The reply must be the unstopped one cut just
    after that token: fewer than ``max_new_tokens`` tokens, the last an EOS id, ``stop_reason``
    ``stop_token``. Without the default stop it would run to ``max_new_tokens``.
    """
    model_dir = write_tiny_chat_model(tmp_path / "export")
    first = run_snippet(model_dir)
    model, tokenizer, prompt_ids, settings = (first[k] for k in ("model", "tokenizer", "prompt_ids", "settings"))
    assert settings.method == "streaming"
    budget = settings.max_new_tokens
    free = generate(model, prompt_ids, settings, tokenizer=tokenizer, stop_token_ids=()).token_ids
    assert len(free) == budget
    k = next(i for i in range(3, budget) if free[i] not in free[:i])
    eos = free[k]
    assert tokenizer.eos_token_id not in free[: k + 1]  # the only stop reached is the one written below

    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, "eos_token_id": [eos]}))
    capsys.readouterr()
    names = run_snippet(model_dir)
    r = names["r"]

    assert list(names["model"].generation_config.eos_token_id) == [eos]
    assert r.token_ids == free[: k + 1]
    assert r.token_ids[-1] == eos and len(r.token_ids) < budget
    assert r.stop_reason == "stop_token"
    assert r.text in capsys.readouterr().out
