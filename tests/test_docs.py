"""The documentation's shape: front pages short enough to read, and every relative link resolving.

A link is checked the way GitHub renders it: the file must exist in the checkout, and an anchor
must be the slug of one of the target's headings, so renaming a heading or moving a file breaks
this test instead of a reader's click.
"""
from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from megatron_wedlm.testing.guide import bash_blocks

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


@functools.lru_cache(maxsize=None)  # a page is linked many times; its headings are read once
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


def invocations(markdown: str) -> list[tuple[str, frozenset[str]]]:
    """Each call of a project script in a page's ```bash blocks: the script (with its subcommand,
    if any) and the ``--flags`` given to it. Continued lines are joined, and a quoted command
    (``sbatch --wrap "python ..."``) is read as the command it holds."""
    found: list[tuple[str, frozenset[str]]] = []

    def scan(tokens: list[str]) -> None:
        for i, token in enumerate(tokens):
            if " " in token and (".py" in token or ".sbatch" in token):
                scan(shlex.split(token))
            if not token.endswith((".py", ".sbatch")) or "/" not in token:
                continue
            rest: list[str] = []
            for t in tokens[i + 1:]:
                if t in ("&&", "||", ";", "|", "&"):
                    break
                rest.append(t)
            name = token
            if rest and re.fullmatch(r"[a-z]+(-[a-z]+)+", rest[0]):
                name += " " + rest[0]  # a subcommand, e.g. hf-to-megatron
            found.append((name, frozenset(t.split("=", 1)[0] for t in rest if t.startswith("--"))))

    for block in bash_blocks(markdown):
        for line in block.text.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # a line of a here-document (Python), not a shell command
                continue
            scan(tokens)
    return found


def test_readme_commands_are_the_tested_guides() -> None:
    """The README's path from an AR checkpoint shortens docs/cluster.md, whose commands a test runs
    (tests/test_cluster_guide.py): each of its calls must appear there with at least its flags, so a
    renamed flag fails here too."""
    guide = invocations((ROOT / "docs" / "cluster.md").read_text())
    readme_text = (ROOT / "README.md").read_text()
    section = readme_text.split("## From an AR checkpoint to an evaluated WeDLM", 1)[1].split("\n## ", 1)[0]
    readme = invocations(section)
    assert len(readme) >= 5, f"the README's path should be five commands, found {readme}"
    for name, flags in readme:
        matches = [g for n, g in guide if n == name]
        assert matches, f"README runs {name}, which docs/cluster.md does not"
        assert any(flags <= g for g in matches), \
            f"README's {name} {sorted(flags)}: no call in docs/cluster.md has these flags ({[sorted(g) for g in matches]})"
