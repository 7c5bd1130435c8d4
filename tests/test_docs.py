"""The documentation's shape: front pages short enough to read, and every relative link resolving;
and what must not drift between pages: install lines (pinned by constraints.txt, naming the extras
their page runs) and the quickstart's measured time.

A link is checked the way GitHub renders it: the file must exist in the checkout, and an anchor
must be the slug of one of the target's headings, so renaming a heading or moving a file breaks
this test instead of a reader's click.
"""
from __future__ import annotations

import ast
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


# --- install lines -------------------------------------------------------------------------------

_INSTALL = re.compile(r"pip install -e \"?\.(?:\[([\w,]+)\])?\"?")
# what a documented command needs beyond the core install: setup.py's extras_require says why
_EXTRA_OF = {"inference/serve.py": "serve", "tools/bench_serve.py": "serve", "tools/bench_vllm.py": "serve",
             "tools/prepare_data.py": "data",
             "tools/convert_checkpoint.py gguf-to-hf": "gguf"}


def install_lines(markdown: str) -> list[str]:
    """Every line of a page that installs the checkout, continued lines joined."""
    return [line for line in markdown.replace("\\\n", " ").splitlines() if "pip install -e" in line]


def installed_extras(line: str) -> set[str]:
    found = _INSTALL.search(line)
    assert found, f"cannot read the extras of {line!r}"
    return set(filter(None, (found.group(1) or "").split(",")))


def test_install_lines_are_read_as_written() -> None:
    assert installed_extras('pip install -e ".[serve,eval]" -c constraints.txt') == {"serve", "eval"}
    assert installed_extras("pip install -e .") == set()
    joined = install_lines("a && \\\n    pip install -e '.' -c x\n")
    assert [" ".join(line.split()) for line in joined] == ["a && pip install -e '.' -c x"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_downloads_use_the_pinned_hubs_command(doc: Path) -> None:
    """huggingface_hub >= 1.0 (what the extras resolve to) ships `hf`; `huggingface-cli` is gone."""
    import huggingface_hub

    assert int(huggingface_hub.__version__.split(".")[0]) >= 1
    assert "huggingface-cli" not in doc.read_text(), f"{doc.relative_to(ROOT)}: use `hf download`"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_line_pins_with_the_constraints(doc: Path) -> None:
    """Without ``-c constraints.txt`` pip may swap the CPU torch for a CUDA build, or take a
    Megatron-Core release that Python's leg of CI does not test (README, Two commands)."""
    loose = [line.strip() for line in install_lines(doc.read_text()) if "-c constraints.txt" not in line]
    assert not loose, f"{doc.relative_to(ROOT)} installs without -c constraints.txt: {loose}"


@pytest.mark.parametrize("doc", [d for d in DOCS if install_lines(d.read_text())],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_install_lines_name_the_extras_their_page_runs(doc: Path) -> None:
    text = doc.read_text()
    lines = install_lines(text)
    setup_extras = set(re.findall(r'^\s+"(\w+)": \[', (ROOT / "setup.py").read_text(), re.MULTILINE))
    extras = set().union(*(installed_extras(line) for line in lines))
    assert extras <= setup_extras, f"extras setup.py does not have: {sorted(extras - setup_extras)}"
    needed = {_EXTRA_OF[name] for name, _ in invocations(text) if name in _EXTRA_OF}
    if any(re.search(r"^\s*lm_eval ", b.text, re.MULTILINE) for b in bash_blocks(text)):
        needed.add("eval")
    assert needed <= extras, f"{doc.relative_to(ROOT)} runs commands needing {sorted(needed - extras)}, " \
                             f"which its install line ({sorted(extras)}) leaves out"


def test_the_command_line_guide_installs_what_the_readme_does() -> None:
    """docs/tools.md documents every command line, so it installs the README's extras."""
    readme = set().union(*map(installed_extras, install_lines((ROOT / "README.md").read_text())))
    tools = set().union(*map(installed_extras, install_lines((ROOT / "docs" / "tools.md").read_text())))
    assert readme and tools == readme, f"docs/tools.md installs {sorted(tools)}, the README {sorted(readme)}"


# --- the quickstart's time -----------------------------------------------------------------------

def _whole_command_seconds(markdown: str) -> tuple[int, int, int]:
    row = re.search(r"^\| whole command, s[^|]*\| (\d+) \| (\d+) \| (\d+) \|$", markdown, re.MULTILINE)
    assert row, "no 'whole command, s...' row of min / median / max seconds"
    return tuple(int(v) for v in row.groups())  # type: ignore[return-value]


def test_the_quickstart_time_is_one_measured_figure() -> None:
    """The README's table holds the measured seconds of the whole command; its median in minutes is
    the figure the README, ``tools/quickstart.py --help`` (the module docstring), docs/tools.md and
    docs/quickstart.md state, and docs/quickstart.md's table holds the same seconds."""
    readme = (ROOT / "README.md").read_text()
    seconds = _whole_command_seconds(readme)
    assert _whole_command_seconds((ROOT / "docs" / "quickstart.md").read_text()) == seconds
    figure = f"about {round(seconds[1] / 60)} minutes"
    script = (ROOT / "tools" / "quickstart.py").read_text()
    assert "description=__doc__" in script, "--help no longer prints the module docstring"
    places = {"README.md": readme, "tools/quickstart.py --help": ast.get_docstring(ast.parse(script)) or "",
              "docs/tools.md": (ROOT / "docs" / "tools.md").read_text(),
              "docs/quickstart.md": (ROOT / "docs" / "quickstart.md").read_text()}
    for place, text in places.items():
        stated = set(re.findall(r"about [\d-]+ minutes", text))
        assert stated == {figure}, f"{place} says {sorted(stated)}: the quickstart takes {figure} " \
                                   f"({seconds[0]}-{seconds[2]} s, the README's table)"
    full_row = re.search(r"^\| `full` .*$", places["docs/quickstart.md"], re.MULTILINE)
    assert full_row and figure in full_row.group(0), "docs/quickstart.md's preset table: the full preset's time"
