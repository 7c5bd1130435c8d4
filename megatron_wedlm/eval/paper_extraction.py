"""The reference evaluation's rules for reading an answer out of a completion, as pure functions.

These reproduce the verdicts of the WeDLM reference evaluator (``evaluation/evaluators/`` of
Tencent/WeDLM, checked at commit 0216110), oddities included, so that a score computed here can
be set next to the paper's. Each function's docstring says the rule and, where the rule is
surprising, what it does to a verdict; ``answer_extraction`` holds this project's own rules.

An extraction that finds nothing returns ``""`` (the reference writes ``"NULL"`` for GSM8K);
an empty extraction is never correct.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Sequence

from megatron_wedlm.eval.answer_extraction import closing_brace

# --------------------------------------------------------------------------- GSM8K

_GSM8K_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")


def _numbers(text: str) -> list[str]:
    return _GSM8K_NUMBER.findall(text.replace(",", ""))


def gsm8k_final_number(text: str) -> str:
    """The first number after the last ``####``, else the last number of the text. Commas go
    (``1,234``), a trailing period belongs to the number (``42.``), a hyphen before digits is a minus
    (``5-3`` ends in ``-3``)."""
    if "####" in text:
        after = _numbers(text.rsplit("####", 1)[1])
        if after:
            return after[0]
    found = _numbers(text)
    return found[-1] if found else ""


def gsm8k_prediction(completion: str) -> str:
    """The completion's answer: only the text before a ``Question:`` the model went on to write counts."""
    return gsm8k_final_number(completion.split("Question:")[0])


def gsm8k_equal(predicted: str, reference: str) -> bool:
    """Numerically equal within 1e-6; both must have been found."""
    if not predicted or not reference:
        return False
    try:
        return abs(float(predicted) - float(reference)) < 1e-6
    except ValueError:
        return predicted == reference


# --------------------------------------------------------------------------- MATH


def _last_boxed_span(text: str) -> str | None:
    """From the last ``\\boxed`` (else the last ``\\fbox``) to the brace that closes the first
    brace after it, or ``None`` when that brace never closes (the model stopped mid-answer)."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start : end + 1]


def math_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}``, braces balanced; ``None`` if there is
    none, or only the unbraced ``\\boxed 5`` (the reference accepts the braced form only)."""
    span = _last_boxed_span(text)
    if span is None:
        return None
    for head in ("\\boxed{", "\\fbox{"):
        if span.startswith(head):
            return span[len(head) : -1]
    return None


def _unwrap_braces(s: str, balanced_only: bool) -> str:
    """Drop outer braces while the brace at the start closes at the very end: ``{{x}}`` -> ``x``."""
    while s.startswith("{") and s.endswith("}"):
        depth, closes_early = 0, False
        for i, c in enumerate(s):
            depth += (c == "{") - (c == "}")
            if depth == 0 and i < len(s) - 1:
                closes_early = True
                break
        if closes_early or (balanced_only and depth != 0):
            break
        s = s[1:-1]
    return s


_NEXT_PROBLEM = ("\nProblem:", "\n\nProblem:", "\nProblem ", "\n\nProblem ")


def math_prediction(completion: str) -> str:
    """The last boxed answer before the model starts a new ``Problem``, outer braces removed.
    Oddity kept: a ``Problem`` at position 0 does not cut the completion."""
    cut = len(completion)
    for marker in _NEXT_PROBLEM:
        pos = completion.find(marker)
        if pos > 0:
            cut = min(cut, pos)
    boxed = math_boxed_content(completion[:cut])
    return "" if boxed is None else _unwrap_braces(boxed, balanced_only=False)


def math_normalize(answer: str) -> str:
    """The reference's string normalisation before exact match: drops newlines, ``\\!``,
    ``\\left``/``\\right``, degrees, ``$``, ``%`` and spaces; ``tfrac``/``dfrac`` -> ``frac``; a comma
    between digits goes (pairwise: ``1,2,3`` -> ``12,3``); outer braces go. Nothing else is equated
    (``0.5`` vs ``\\frac{1}{2}``, ``\\frac12`` vs ``\\frac{1}{2}``)."""
    s = answer.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" ", "")
    s = re.sub(r"(\d),(\d)", r"\1\2", s)
    return _unwrap_braces(s, balanced_only=True)


def math_equal(predicted: str, reference: str) -> bool:
    """Equal after ``math_normalize`` (an empty prediction matches only an empty reference)."""
    return math_normalize(predicted) == math_normalize(reference)


# --------------------------------------------------------------------------- multiple choice

_LETTERS = ("A", "B", "C", "D")
#: Tried in order after the first-character rule; each pattern's first match only.
_CHOICE_PATTERNS = (
    r"(?:answer|Answer|ANSWER)[\s:]*([A-D])",
    r"(?:is|IS)[\s:]*([A-D])",
    r"\b([A-D])\b",
)


def mmlu_letter(completion: str) -> str:
    """MMLU: a first character A-D in either case, else ``answer X``, else ``is X``, else a lone
    capital A-D, else the first a-d/A-D anywhere. Oddity kept: ``Answer: (C)`` reads as ``A``, and
    the last rule finds a letter in almost any text."""
    text = completion.strip()
    if not text:
        return ""
    if text[0].upper() in _LETTERS:
        return text[0].upper()
    for pattern in _CHOICE_PATTERNS:
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    return next((c.upper() for c in text if c.upper() in _LETTERS), "")


def arc_letter(completion: str, options: Collection[str]) -> str:
    """ARC: as ``mmlu_letter`` but only letters among ``options`` count, and ``X)`` also counts
    as a letter at the start. A pattern whose first match is not an option is skipped (its later
    matches are not tried)."""
    valid = {o.upper() for o in options}
    text = completion.strip()
    if not text:
        return ""
    if text[0].upper() in valid:
        return text[0].upper()
    for pattern in (r"^([A-D])[.\s)]",) + _CHOICE_PATTERNS:
        match = re.search(pattern, text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    return next((c.upper() for c in text if c.upper() in valid), "")


def hellaswag_letter(completion: str) -> str:
    """HellaSwag: ``answer/option/choice (is) X`` in any case, else a capital A-D at the start, else
    the *last* lone capital A-D. Oddity kept: ``the answer is a dog`` reads as ``A``."""
    text = completion.strip()
    if not text:
        return ""
    match = re.search(r"(?:the\s+)?(?:answer|option|choice)\s*(?:is)?\s*:?\s*\b([A-D])\b", text, re.IGNORECASE)
    if match:
        return match.group(1).upper()
    match = re.match(r"\s*([A-D])(?:[.\s)]|$)", text)
    if match:
        return match.group(1)
    found = re.findall(r"\b([A-D])\b", text)
    return found[-1] if found else ""


def gpqa_letter(completion: str, uid: str) -> tuple[str, bool]:
    """GPQA: the stripped text between the first ``####`` and the next, and whether it was guessed.

    It must equal the letter (``#### D.`` is wrong). Without ``####`` the reference guesses unseeded;
    here the guess is seeded with the example's ``uid``, so a rescoring gives the same verdict."""
    text = completion.split("\n\nQuestion")[0]
    parts = text.split("####")
    if len(parts) > 1:
        return parts[1].strip(), False
    return random.Random(uid).choice(_LETTERS), True


# --------------------------------------------------------------------------- code

_FENCES = (re.compile(r"```(.*?)```", re.DOTALL), re.compile(r"~~~(.*?)~~~", re.DOTALL))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _is_note(line: str) -> bool:
    """A comment, or a line starting a string (a docstring line)."""
    stripped = line.strip()
    return stripped.startswith(("#", "'", '"'))


def _fenced_block(text: str) -> str | None:
    """The first closed ``` (else ~~~) block, without a language tag line; ``None`` if none."""
    for fence in _FENCES:
        blocks = fence.findall(text)
        if blocks:
            head, newline, rest = blocks[0].partition("\n")
            tag = head.strip()
            block = rest if newline and tag and len(tag) <= 20 and tag.isalpha() else blocks[0]
            return block.lstrip("\n").rstrip()
    return None


def _unfenced_code(text: str) -> str:
    """Plain-text completion: drop an unclosed fence's tail and leading imports, then keep the
    indented block the completion starts with, or else the body of the first ``def``."""
    lines = text.split("```", 1)[0].split("~~~", 1)[0].splitlines()
    skip = 0
    while skip < len(lines) and lines[skip].lstrip().startswith(("from ", "import ")):
        skip += 1
    text = "\n".join(lines[skip:]).lstrip("\n").rstrip()

    lines = text.splitlines()
    first = 0
    while first < len(lines) and (not lines[first].strip() or _is_note(lines[first])):
        first += 1
    block: list[str] = []
    if first < len(lines) and _indent(lines[first]) >= 4:
        for line in lines[first:]:
            if line.strip() and not _is_note(line) and _indent(line) < 4:
                break
            block.append(line)
    if any(line.strip() and not _is_note(line) for line in block):
        return "\n".join(block).rstrip()
    if "def " in text or text.lstrip().startswith("def"):
        match = re.search(r"\bdef\b[ \t]+[A-Za-z_][A-Za-z0-9_]*\s*\(", text)
        if match:
            segment = text[match.start() :].splitlines()
            depth, body = 0, 1
            for i, line in enumerate(segment):
                depth += line.count("(") - line.count(")")
                if line.rstrip().endswith(":") and depth == 0:
                    body = i + 1
                    break
            text = "\n".join(segment[body:]).lstrip("\n").rstrip()
    return text


def humaneval_body(completion: str) -> str:
    """The function body the reference appends to the HumanEval prompt: code of the first fenced
    block, else of the plain text, blank lines dropped, a column-0 body indented, cut at the first
    code line indented less than its first (which drops test code or a second function)."""
    fenced = _fenced_block(completion)
    lines = [line for line in (_unfenced_code(completion) if fenced is None else fenced).splitlines() if line.strip()]
    if not lines:
        return ""
    first = next((i for i, line in enumerate(lines) if not _is_note(line)), None)
    if first is None:
        return "\n".join(lines)
    if _indent(lines[first]) == 0:
        lines = ["    " + line for line in lines]
    base = _indent(lines[first])
    for i in range(first + 1, len(lines)):
        if not _is_note(lines[i]) and _indent(lines[i]) < base:
            lines = lines[:i]
            break
    return "\n".join(lines).rstrip()


def mbpp_code(completion: str) -> str:
    """MBPP: the text before ``[DONE]``, stripped, without the quotes the few-shot answers wear."""
    code = completion.split("[DONE]")[0].strip()
    if code.startswith("'") and code.endswith("'"):
        code = code[1:-1]
    return code.strip()


def mbpp_program(code: str, setup: str, tests: Sequence[str]) -> str:
    """The program the reference runs: the code, the test setup code, then the asserts."""
    program = code.rstrip() + "\n"
    if setup:
        program += setup.rstrip() + "\n"
    if tests:
        program += "\n".join(tests) + "\n"
    return program
