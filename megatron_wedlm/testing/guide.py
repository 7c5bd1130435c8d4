"""Run a markdown guide's shell blocks as written, so a guide whose commands break fails a test.

The guide (docs/cluster.md) opens with one settings block (:data:`SETTINGS_MARKER`) that every
later block reads; a block opening with :data:`SKIP_MARKER` is not run. :func:`compose_script`
puts a test's settings in its place and joins the rest verbatim, in order.
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
    """A block's command lines as bash reads them (continuations joined, comments dropped, spaces
    collapsed), so pages giving the same commands with other comments or line breaks agree."""
    joined = re.sub(r"\\\n", " ", block)
    lines = (re.sub(r"(^|\s)#.*$", "", line) for line in joined.splitlines())
    return [" ".join(line.split()) for line in lines if line.strip()]


def read_names(block: str) -> set[str]:
    """The ``$NAME`` / ``${NAME}`` a block reads, less its own loop variables."""
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", block))
    return used - set(re.findall(r"\bfor\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\b", block))


def compose_script(blocks: list[Block], settings: str, before: Mapping[str, str] | None = None) -> str:
    """One ``set -euo pipefail`` script: ``settings`` in place of the first block, then every block
    not skipped, each after a marker line; ``before`` maps a fragment naming exactly one block to code
    run just before it. Background processes are stopped when the script ends, however it ends."""
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
    """What each block of a :func:`compose_script` script that ran printed, by block number."""
    return {int(number): text for number, text in _OUTPUT.findall(stdout)}
