"""Pulling a final answer out of generated text, and comparing it with a reference.

The rules are the same for every decoding method, so accuracy differences come from the decoder:

* GSM8K: ``#### N``, else ``the answer is N``, else the last number; equal when numerically equal.
* MATH: the last ``\\boxed{...}``, else ``the answer is X``; both sides normalised
  (``normalize_math_answer``, a subset of Hendrycks et al.'s rules), then compared as strings or
  as numbers.
* Multiple choice: ``answer is (X)``, else the first choice label standing alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

_NUMBER = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer is[:\s]*\(?([^\n]*?)\)?\s*(?:\.\s|\.$|\n|$)", re.IGNORECASE)


def normalize_number(text: str) -> str:
    """``"$1,234.50."`` -> ``"1234.5"``; non-numbers come back stripped but otherwise unchanged."""
    s = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        value = float(s)
    except ValueError:
        return s
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def numbers_equal(a: str, b: str, rel_tol: float = 1e-6) -> bool:
    a, b = normalize_number(a), normalize_number(b)
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b and a != ""
    return abs(x - y) <= rel_tol * max(1.0, abs(x), abs(y))


def gsm8k_reference(answer_field: str) -> str:
    """The number after the last ``####`` of a GSM8K ``answer`` field."""
    if "####" not in answer_field:
        raise ValueError("GSM8K 'answer' field has no '#### <number>' final answer")
    return normalize_number(answer_field.rsplit("####", 1)[1])


def extract_number_answer(completion: str) -> str:
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1]
        match = _NUMBER.search(tail)
        if match:
            return normalize_number(match.group())
    for match in reversed(list(_ANSWER_IS.finditer(completion))):
        number = _NUMBER.search(match.group(1))
        if number:
            return normalize_number(number.group())
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else ""


def closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` that closes the first ``{`` from ``start`` on, counting nested braces;
    ``None`` when it never closes."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces, or ``None``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start == -1:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # "\boxed 5" shorthand
        match = re.match(r"[^\s$]+", text[i:])
        return match.group() if match else None
    end = closing_brace(text, i)
    return None if end is None else text[i + 1 : end]  # None: unbalanced, the model stopped mid-answer


def math_reference(solution: str) -> str:
    boxed = last_boxed(solution)
    if boxed is None:
        raise ValueError("MATH 'solution' field has no \\boxed{...} final answer")
    return boxed


def extract_math_answer(completion: str) -> str:
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS.finditer(completion))
    return matches[-1].group(1).strip().strip("$") if matches else ""


def _unwrap_command(s: str, command: str) -> str:
    """Replace ``\\command{X}`` with ``X`` (balanced braces)."""
    token = "\\" + command + "{"
    while (start := s.find(token)) != -1:
        depth, j = 0, start + len(token) - 1
        for j in range(start + len(token) - 1, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        s = s[:start] + s[start + len(token) : j] + s[j + 1 :]
    return s


def normalize_math_answer(answer: str) -> str:
    s = answer.strip()
    for cmd in ("text", "textbf", "mathrm", "mbox", "mathbf"):
        s = _unwrap_command(s, cmd)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for unit in ("^{\\circ}", "^\\circ", "\\%", "%", "\\degree"):
        s = s.replace(unit, "")
    s = s.replace(" ", "").rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    if re.match(r"^[a-zA-Z]\\?=", s) or re.match(r"^[a-zA-Z]=", s):
        s = s.split("=", 1)[1]
    if s.startswith("."):
        s = "0" + s
    return s


def _as_number(s: str) -> Fraction | None:
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_equal(predicted: str, reference: str) -> bool:
    a, b = normalize_math_answer(predicted), normalize_math_answer(reference)
    if not a:
        return False
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and x == y


def extract_choice(completion: str, labels: Sequence[str]) -> str:
    """The chosen label, or ``""`` when no label can be found."""
    alternatives = "|".join(re.escape(label) for label in sorted(labels, key=len, reverse=True))
    explicit = re.search(rf"answer is[:\s]*\(?({alternatives})\b", completion, re.IGNORECASE)
    if explicit:
        # IGNORECASE may have matched "a" for label "A": map back to the label's spelling.
        return next(lb for lb in labels if lb.lower() == explicit.group(1).lower())
    standalone = re.search(rf"(?<![\w])\(?({alternatives})(?:\)|\.|:|(?![\w]))", completion)
    return standalone.group(1) if standalone else ""
