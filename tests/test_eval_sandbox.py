"""The code-execution sandbox and the code tasks (HumanEval, MBPP) scored with it."""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_wedlm.eval.code_tasks import HumanEvalTask, MBPPTask
from megatron_wedlm.eval.sandbox import FAILED, MEMORY, PASSED, TIMEOUT, run_many, run_python


def test_correct_program_passes_and_wrong_one_fails():
    ok = run_python("def f(x):\n    return x * 2\nassert f(3) == 6\n", timeout_s=5)
    assert ok.status == PASSED and ok.passed and ok.returncode == 0
    bad = run_python("def f(x):\n    return x + 2\nassert f(3) == 6, 'f(3) wrong'\n", timeout_s=5)
    assert bad.status == FAILED and not bad.passed
    assert "AssertionError: f(3) wrong" in bad.stderr_tail
    assert run_python("raise SystemExit(3)").returncode == 3
    assert run_python("input()").status == FAILED  # stdin is closed, the program cannot hang on it


def test_infinite_loop_and_its_children_are_killed_at_the_timeout(tmp_path):
    start = time.perf_counter()
    loop = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert loop.status == TIMEOUT and 1.0 <= loop.seconds < 5 and time.perf_counter() - start < 6
    # A forked grandchild that would outlive its parent is killed with the process group.
    marker = tmp_path / "child_alive"
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        f"    time.sleep(2.5)\n    open({str(marker)!r}, 'w').write('x')\n"
        "else:\n    time.sleep(60)\n"
    )
    assert run_python(program, timeout_s=1.0).status == TIMEOUT
    time.sleep(2.0)
    assert not marker.exists()


def test_memory_hog_is_stopped_cleanly():
    one_shot = run_python("blob = bytearray(3 << 30)\n", timeout_s=5, memory_mb=256)
    assert one_shot.status == MEMORY and "MemoryError" in one_shot.stderr_tail
    growing = run_python("keep = []\nwhile True:\n    keep.append(bytearray(16 << 20))\n", timeout_s=5, memory_mb=256)
    assert growing.status == MEMORY and growing.seconds < 5
    # The same allocation passes under a limit that allows it.
    assert run_python("blob = bytearray(64 << 20)\n", timeout_s=5, memory_mb=512).passed


def test_program_runs_in_a_private_directory_with_minimal_environment():
    probe = (
        "import os, sys\n"
        "assert os.listdir('.') == ['program.py'] or sorted(os.listdir('.')) == ['program.py', 'stderr.txt']\n"
        f"assert os.getcwd() != {os.getcwd()!r}\n"
        "assert 'PYTHONPATH' not in os.environ\n"
        "assert sys.flags.isolated == 1\n"
    )
    assert run_python(probe).passed


def test_run_many_keeps_order_and_validates():
    results = run_many(["assert True", "assert False", "while True: pass", "assert 1"], timeout_s=1.0, workers=2)
    assert [r.status for r in results] == [PASSED, FAILED, TIMEOUT, PASSED]
    assert run_many([]) == []
    with pytest.raises(ValueError, match="positive"):
        run_python("pass", timeout_s=0)


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    task = HumanEvalTask(timeout_s=2.0, workers=2).limited(6)
    assert len(task.examples) == 6 and task.examples[0].uid == "HumanEval/0"
    good = task.judge_all(task.examples, [e.reference for e in task.examples])
    assert all(j.correct for j in good)
    bad = task.judge_all(task.examples, ["    return None\n"] * 6)
    assert not any(j.correct for j in bad) and all(j.detail.startswith("failed") for j in bad)
    hang = task.judge(task.examples[0], "    while True:\n        pass\n")
    assert not hang.correct and hang.detail.startswith("timeout")


def test_humaneval_from_local_jsonl(tmp_path):
    problem = {
        "task_id": "Local/0", "entry_point": "inc",
        "prompt": "def inc(x):\n    \"\"\"Add one.\"\"\"\n",
        "canonical_solution": "    return x + 1\n",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
    }
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(problem) + "\n")
    task = HumanEvalTask(str(path), timeout_s=3)
    assert task.judge(task.examples[0], "    return x + 1\n").correct
    assert not task.judge(task.examples[0], "    return x\n").correct


def test_mbpp_few_shot_and_execution(tmp_path):
    records = [
        {"task_id": 2 + i, "text": f"Write a function add{i} that adds {i} to x.",
         "code": f"def add{i}(x):\n    return x + {i}", "test_list": [f"assert add{i}(1) == {1 + i}", f"assert add{i}(0) == {i}"],
         "test_setup_code": ""}
        for i in range(5)
    ]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    task = MBPPTask(str(path), num_shots=3, timeout_s=3)
    assert [e.uid for e in task.examples] == ["mbpp:5", "mbpp:6"]
    prompt = task.examples[0].prompt
    assert prompt.count("[BEGIN]") == 4 and prompt.count("[DONE]") == 3 and prompt.endswith("[BEGIN]\n")
    assert "assert add3(1) == 4" in prompt
    good = task.judge_all(task.examples, ["def add3(x):\n    return x + 3\n", "```python\ndef add4(x):\n    return 4 + x\n```"])
    assert [j.correct for j in good] == [True, True]
    assert not task.judge(task.examples[0], "def add3(x):\n    return x\n").correct
