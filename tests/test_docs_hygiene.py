"""Comments and docstrings say what the code does and why, not a lab notebook's history.

Configs explain what a key does and why its value; measurements (which seed did what, on which
machine, on which day) belong in docs/results.md. These checks keep the notebook out of the
product: no comment under ``configs/`` names a seed by its number or carries a date or a commit
id, and no comment or docstring of the package, the tools or the entry points carries a date.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
PRODUCT_CODE = sorted(p for d in ("megatron_wedlm", "tools", "inference", "pretrain", "sft")
                      for p in (ROOT / d).rglob("*.py"))

NAMED_SEED = re.compile(r"\bseeds?\s+\d", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b")
COMMIT = re.compile(r"\bcommits?\s+[0-9a-f]{7,40}\b")
HISTORY = re.compile(r"\bwas tried\b|\bwe tried\b", re.IGNORECASE)


def yaml_comment(line: str) -> str:
    """The comment part of one YAML line ("" if none): a ``#`` at the start of the line or after
    whitespace, outside quoted scalars."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[i + 1:]
    return ""


def code_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text(encoding="utf-8")
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    return found


@pytest.mark.parametrize("line, comment", [
    ("seed: 7  # which seed", " which seed"),
    ("  # trained on seeds 0-9", " trained on seeds 0-9"),
    ("description: 'a # inside quotes' # after", " after"),
    ("url: http://host/#anchor", ""),
])
def test_yaml_comment_finds_the_comment_part(line, comment):
    assert yaml_comment(line) == comment


def test_the_patterns_catch_what_they_are_for():
    assert NAMED_SEED.search("over SFT seeds 1-3") and NAMED_SEED.search("Seed 7 never learnt copying")
    assert not NAMED_SEED.search("trainer.seed and data.seed") and not NAMED_SEED.search("on every seed")
    assert DATE.search("measured 2026-11-28") and COMMIT.search("(commit ade813a)")


def test_configs_exist():
    assert len(CONFIGS) >= 10 and len(PRODUCT_CODE) >= 50


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_comments_name_no_seed_date_or_commit(path):
    bad = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        comment = yaml_comment(line)
        for pattern in (NAMED_SEED, DATE, COMMIT, HISTORY):
            if pattern.search(comment):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
                break
    assert not bad, ("config comments say what a key does and why its value; per-seed figures, "
                     "dates and commits belong in docs/results.md:\n" + "\n".join(bad))


def test_code_comments_and_docstrings_carry_no_dates():
    bad = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)}"
           for path in PRODUCT_CODE for line, text in code_prose(path)
           for match in [DATE.search(text)] if match]
    assert not bad, ("a dated measurement belongs in docs/results.md; the comment keeps the reason, "
                     "in the present tense:\n" + "\n".join(bad))
