"""The few-shot text of the reference evaluation, read from a local checkout of Tencent/WeDLM.

The paper's few-shot examples belong to the reference repository, so this project does not carry
them: point ``WEDLM_REFERENCE`` (or ``reference_dir=``) at a clone and they are parsed (never
imported) from ``evaluation/datasets/*.py``. Each text must match the SHA-256 of commit 0216110,
else it is refused: its prompts would not give scores comparable with the paper's.
"""

from __future__ import annotations

import ast
import hashlib
import os
from collections.abc import Mapping

REFERENCE_ENV = "WEDLM_REFERENCE"
REFERENCE_COMMIT = "0216110f24697d425eeea1c04b68fbbb1b3deb13"

#: benchmark -> (file under the checkout, name the text is assigned to)
PREFIXES: dict[str, tuple[str, str]] = {
    "gsm8k": ("evaluation/datasets/gsm8k.py", "_fewshot_prefix"),
    "math": ("evaluation/datasets/math.py", "_fewshot_prefix"),
    "mmlu": ("evaluation/datasets/mmlu.py", "_fewshot_prefix"),
    "hellaswag": ("evaluation/datasets/hellaswag.py", "_fewshot_prefix"),
    "gpqa": ("evaluation/datasets/gpqa.py", "_fewshot_prefix"),
    "mbpp": ("evaluation/datasets/mbpp.py", "_fewshot_block"),
    "humaneval": ("evaluation/datasets/humaneval.py", "_INSTRUCTION_PREFIX"),
}

#: SHA-256 of each text at ``REFERENCE_COMMIT``.
PINNED_SHA256: dict[str, str] = {
    "gsm8k": "aee1c01a744bcc503666bce8a8dbb9a361f5fa31d54a9924604c458f1a4df477",
    "math": "b67845a3934e856f350f5d5923c42e5619bd279315632af128a40097088f9eef",
    "mmlu": "c9a1ee923d17a24b35a7c153e58f2e93c4de941eff8d9e855c35940d357ace65",
    "hellaswag": "135a13519996166639552e9ef3a52940bcec90265ec1c965155de75a6d76216f",
    "gpqa": "bf916502e00c49a8dcfe07564a5d05992da7e8c87ac62cc18e40f36553e4611b",
    "mbpp": "066b69f986b4fb074c076c2835ea5b8ca35388a0de08212bf4e36e8ff595f708",
    "humaneval": "41844e5b03c96e8451b83426c9cd1e3f440f5f524dbfb274f6d178261a49a911",
}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _assigned_string(source: str, name: str, where: str) -> str:
    """The one string literal assigned to ``name`` or ``self.name`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            target_name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
            if target_name == name and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                found.append(node.value.value)
    if len(found) != 1:
        raise ValueError(f"{where}: expected one string assigned to {name!r}, found {len(found)}; "
                         f"is this a checkout of Tencent/WeDLM at {REFERENCE_COMMIT[:7]}?")
    return found[0]


def reference_dir(given: str | None = None, benchmark: str | None = None) -> str:
    """The checkout to read from: ``given``, else ``$WEDLM_REFERENCE``; an error says what it is, how
    to get one and which tasks need it (``benchmark``: the one asking)."""
    path = given or os.environ.get(REFERENCE_ENV)
    if not path:
        asking = f"paper:{benchmark}" if benchmark else "the paper's suite"
        raise ValueError(
            f"{asking} needs {REFERENCE_ENV}, the path of a clone of the WeDLM reference evaluation, whose "
            "few-shot prompt text this project does not carry: `git clone https://github.com/Tencent/WeDLM "
            f"/src/WeDLM && git -C /src/WeDLM checkout {REFERENCE_COMMIT[:7]}`, then "
            f"`export {REFERENCE_ENV}=/src/WeDLM`. Tasks that need it: "
            f"{', '.join('paper:' + b for b in PREFIXES)} (paper:arc_c and paper:arc_e are zero-shot and do "
            "not); scoring saved completions (inference/score.py) does not"
        )
    if not os.path.isdir(os.path.join(path, "evaluation", "datasets")):
        raise ValueError(f"{path!r} is not a checkout of Tencent/WeDLM: it has no evaluation/datasets/ "
                         f"(set {REFERENCE_ENV} to the clone's root)")
    return path


def few_shot_prefix(
    benchmark: str, checkout: str | None = None, pinned: Mapping[str, str] | None = PINNED_SHA256
) -> str:
    """The reference's few-shot text for ``benchmark``, checked against ``pinned`` (``None``: unchecked)."""
    if benchmark not in PREFIXES:
        raise ValueError(f"the reference has no few-shot text for {benchmark!r}; it has {sorted(PREFIXES)}")
    relative, name = PREFIXES[benchmark]
    path = os.path.join(reference_dir(checkout, benchmark), relative)
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; expected the reference's {relative}")
    with open(path, encoding="utf-8") as f:
        text = _assigned_string(f.read(), name, path)
    if pinned is not None and benchmark in pinned and sha256(text) != pinned[benchmark]:
        raise ValueError(
            f"{path}: the few-shot text {name!r} differs from the one this suite was checked against "
            f"(Tencent/WeDLM {REFERENCE_COMMIT[:7]}); check out that commit to get comparable prompts"
        )
    return text
