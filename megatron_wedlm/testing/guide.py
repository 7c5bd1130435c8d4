"""Run a markdown guide's shell blocks as written, so a guide whose commands break fails a test.

A guide written for this (docs/cluster.md) opens with one ```bash block of settings, marked by
its first line (:data:`SETTINGS_MARKER`), and every later block reads only those variables; a
block that must not run in a test (it needs the network) opens with :data:`SKIP_MARKER`, where a
reader sees it. :func:`compose_script` puts a test's own settings in place of the first block and
joins every other block, verbatim and in order, into one bash script (``set -euo pipefail``), with
a marker line before each block so that each block's output can be told apart
(:func:`block_outputs`), and optional test code before the blocks that need it (what time or a
person does between two commands: waiting for jobs, stopping one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SETTINGS_MARKER", "SKIP_MARKER", "Block", "assigned_names", "bash_blocks", "block_outputs",
           "commands", "compose_script", "read_names"]

SETTINGS_MARKER = "# settings"
SKIP_MARKER = "# not run by the test:"
_OUTPUT = re.compile(r"@@block (\d+)@@\n(.*?)(?=\n@@(?:block \d+|test|end)@@\n)", re.DOTALL)


@dataclass
class Block:
    """One ```bash block: its place on the page and its text (with a final newline)."""

    number: int  # 1-based, in the order of the page
    line: int  # the line of its opening fence
    text: str

    @property
    def skipped(self) -> bool:
        return self.text.lstrip().startswith(SKIP_MARKER)


def bash_blocks(markdown: str) -> list[Block]:
    """The ```bash blocks of a page; other fences are not commands. An unclosed block is an error."""
    blocks: list[Block] = []
    current: list[str] | None = None
    start = 0
    for number, line in enumerate(markdown.splitlines(), 1):
        stripped = line.strip()
        if current is None and stripped == "```bash":
            current, start = [], number
        elif current is not None and stripped == "```":
            blocks.append(Block(len(blocks) + 1, start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise ValueError(f"the ```bash block opened on line {start} is not closed")
    return blocks


def assigned_names(settings: str) -> list[str]:
    """The variables a settings block assigns, in order: ``A=1 B=2`` and ``export C=3`` lines."""
    names = []
    for line in settings.splitlines():
        code = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
        names += re.findall(r"(?:^|\s)(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", code)
    return names


def commands(block: str) -> list[str]:
    """A block's command lines as bash reads them: continuation lines joined, comments (a ``#``
    after a space, or opening a line) dropped, runs of spaces made one; so two pages that give
    the same commands with other comments or line breaks agree."""
    joined = re.sub(r"\\\n", " ", block)
    lines = (re.sub(r"(^|\s)#.*$", "", line) for line in joined.splitlines())
    return [" ".join(line.split()) for line in lines if line.strip()]


def read_names(block: str) -> set[str]:
    """The ``$NAME`` / ``${NAME}`` a block reads, less its own loop variables."""
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", block))
    return used - set(re.findall(r"\bfor\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\b", block))


def compose_script(blocks: list[Block], settings: str, before: Mapping[str, str] | None = None) -> str:
    """One bash script: ``settings`` in place of the first block, then every block not skipped.

    ``before`` maps a fragment of one block's text to code run just before that block (the
    fragment must name exactly one block to run). Background processes a block starts are
    stopped (SIGTERM, then waited for) when the script ends, however it ends.
    """
    if not blocks or not blocks[0].text.startswith(SETTINGS_MARKER):
        raise ValueError(f"the first block must be the settings, opening with {SETTINGS_MARKER!r}")
    runnable = [block for block in blocks[1:] if not block.skipped]
    hooks: dict[int, str] = {}
    for fragment, code in (before or {}).items():
        holders = [block.number for block in runnable if fragment in block.text]
        if len(holders) != 1:
            raise ValueError(f"{len(holders)} blocks hold {fragment!r}; the test's code needs exactly one")
        hooks[holders[0]] = code
    lines = ["set -euo pipefail",
             '__stop() { for p in $(jobs -p); do kill "$p" 2>/dev/null || true; wait "$p" || true; done; }',
             "trap __stop EXIT",
             settings]
    for block in runnable:
        if block.number in hooks:
            lines += ["printf '\\n@@test@@\\n'", hooks[block.number]]  # the test's output is no block's
        lines += [f"printf '\\n@@block {block.number}@@\\n'", block.text]  # output may end without a newline
    lines.append("printf '\\n@@end@@\\n'")
    return "\n".join(lines) + "\n"


def block_outputs(stdout: str) -> dict[int, str]:
    """What each block of a :func:`compose_script` script printed, by block number (the blocks
    that ran; a script that stopped early lacks the rest)."""
    return {int(number): text for number, text in _OUTPUT.findall(stdout)}
