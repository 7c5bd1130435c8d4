"""The documentation's shape: front pages short enough to read, and every relative link resolving.

A link is checked the way GitHub renders it: the file must exist in the checkout, and an anchor
must be the slug of one of the target's headings, so renaming a heading or moving a file breaks
this test instead of a reader's click.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md")])

# Limits from issue 64: the README is a front page, the quickstart guide a guide, the results page
# a dated record rather than a log.
LINE_LIMITS = {"README.md": 150, "docs/quickstart.md": 250, "docs/results.md": 600}

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, where a bracket is markdown rather than code."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def test_slug_follows_github() -> None:
    assert github_slug("### `tools/verify_parallel.py`".lstrip("# ")) == "toolsverify_parallelpy"
    assert github_slug("5. Checkpoints") == "5-checkpoints"
    assert github_slug("The real-model preset (smollm)") == "the-real-model-preset-smollm"


@pytest.mark.parametrize("name,limit", sorted(LINE_LIMITS.items()))
def test_front_pages_stay_short(name: str, limit: int) -> None:
    n = len((ROOT / name).read_text().splitlines())
    assert n <= limit, f"{name} has {n} lines, over its {limit}: move detail to a guide or docs/results.md"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    prose = "\n".join(_prose_lines(doc.read_text()))
    for target in _LINK.findall(prose):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path_part, _, anchor = target.partition("#")
        file = (doc.parent / path_part).resolve() if path_part else doc
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if ROOT in file.parents else file}")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
