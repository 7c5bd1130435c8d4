"""The code-execution sandbox and the code tasks (HumanEval, MBPP) scored with it."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from megatron_wedlm.eval.code_tasks import HumanEvalTask, MBPPTask
from megatron_wedlm.eval import isolation
from megatron_wedlm.eval.isolation import CGROUP, NETWORK_NAMESPACE, PID_NAMESPACE, RLIMITS, SESSION
from megatron_wedlm.eval.sandbox import (
    EXITED_EARLY, FAILED, MEMORY, PASSED, TIMEOUT, run_many, run_python,
)

BARE = (SESSION, RLIMITS)  # the fences every host has: what the sandbox falls back to


def _fences() -> tuple[str, ...]:
    """The isolation this host gives a program (probed by running one)."""
    return run_python("pass").isolation


def _require(fence: str) -> None:
    if fence not in _fences():
        pytest.skip(f"{fence} is not available here (needs a writable cgroup / a working unshare)")


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


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "exit()"])
def test_exiting_before_the_asserts_is_not_a_pass(exit_call):
    program = f"import os, sys\ndef f(x):\n    return None\n{exit_call}\nassert f(3) == 6\n"
    result = run_python(program, timeout_s=5)
    assert result.returncode == 0 and result.status == EXITED_EARLY and not result.passed
    assert "exited before its end" in result.stderr_tail
    # The same program without the early exit reaches its asserts and fails on them.
    assert run_python(program.replace(exit_call, "pass"), timeout_s=5).status == FAILED


def _processes_with_cmdline(args: list[str]) -> list[int]:
    wanted = "\0".join(args).encode() + b"\0"
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read() == wanted:
                    found.append(int(entry))
        except OSError:
            pass
    return found


@pytest.mark.parametrize(
    "fences", [isolation.ALL, (*BARE, CGROUP), BARE], ids=["all", "cgroup", "bare"]
)
def test_setsid_grandchild_is_killed_with_the_program(tmp_path, fences):
    # A grandchild leaves the program's session, starts a `sleep` of its own and would write a
    # file after the program's timeout: nothing of it may outlive the run, whatever fences.
    marker, sleeper = tmp_path / "escaped", ["sleep", f"4{os.getpid()}.{time.time_ns() % 1000}"]
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', {sleeper!r})\n"
        "    time.sleep(2.0)\n"
        f"    open({str(marker)!r}, 'w').write('escaped')\n"
        "time.sleep(60)\n"
    )
    result = run_python(program, timeout_s=1.0, isolation_allowed=fences)
    assert result.status == TIMEOUT and set(result.isolation) <= set(fences)
    assert _processes_with_cmdline(sleeper) == []
    time.sleep(2.5)
    assert not marker.exists()


def test_total_memory_of_forked_children_is_capped():
    _require(CGROUP)
    # Four children each fill 700 MB: each is under the 1 GB per-process limit, 2.8 GB is not.
    program = (
        "import os\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        blob = bytearray(b'x') * (700 << 20)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "assert all(os.waitpid(pid, 0)[1] == 0 for pid in pids), 'a child was killed'\n"
    )
    capped = run_python(program, timeout_s=30, memory_mb=1024)
    assert CGROUP in capped.isolation and capped.status == MEMORY and not capped.passed


def test_process_count_is_capped():
    _require(CGROUP)
    program = (
        "import os, time\n"
        "for _ in range(40):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
    )
    assert run_python(program, timeout_s=10, max_processes=16).status == FAILED
    assert run_python(program.replace("40", "8"), timeout_s=10, max_processes=16).passed


def test_network_is_unreachable_inside_a_network_namespace():
    _require(NETWORK_NAMESPACE)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        )
        isolated = run_python(program, timeout_s=5)
        assert NETWORK_NAMESPACE in isolated.isolation and isolated.status == FAILED
        assert "OSError" in isolated.stderr_tail  # unreachable: the namespace has no network
        with pytest.raises(socket.timeout):
            listener.accept()
        # Without the namespace the same program reaches the listener.
        assert run_python(program, timeout_s=5, isolation_allowed=BARE).passed
        listener.accept()[0].close()


def test_filesystem_is_read_only_and_tmp_is_private(tmp_path):
    _require(PID_NAMESPACE)  # the namespaces come together
    secret = tmp_path / "secret.txt"
    secret.write_text("host file")
    program = (
        "import os\n"
        f"assert not os.path.exists({str(secret)!r})\n"
        "assert os.listdir('/tmp') == ['sandbox'] and os.getcwd() == '/tmp/sandbox'\n"
        f"for target in [{str(secret)!r}, {os.path.join(os.getcwd(), 'sandbox_wrote_here')!r}]:\n"
        "    try:\n"
        "        open(target, 'w').write('x')\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise SystemExit('wrote ' + target)\n"
        "open('mine.txt', 'w').write('the program may write its own folder')\n"
        "assert len(os.listdir('/proc')) < 80 and os.getpid() < 10  # its own PID namespace\n"
    )
    result = run_python(program, timeout_s=5)
    assert result.passed, result.stderr_tail
    assert secret.read_text() == "host file" and not os.path.exists("sandbox_wrote_here")


def test_result_reports_the_isolation_in_force():
    bare = run_python("pass", isolation_allowed=BARE)
    assert bare.passed and bare.isolation == BARE
    full = run_python("pass")
    assert set(BARE) <= set(full.isolation) <= set(isolation.ALL)
    with pytest.raises(ValueError, match="unknown isolation"):
        run_python("pass", isolation_allowed=("chroot",))


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
        "assert os.listdir('.') == ['program.py']\n"
        "assert os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()\n"
        f"assert os.getcwd() != {os.getcwd()!r}\n"
        "assert 'PYTHONPATH' not in os.environ\n"
        "assert sys.flags.isolated == 1\n"
    )
    assert run_python(probe).passed


def test_run_many_keeps_order_and_validates():
    # a timeout well above interpreter start-up, which a loaded machine can stretch past a second
    results = run_many(["assert True", "assert False", "while True: pass", "assert 1"], timeout_s=4.0, workers=2)
    assert [r.status for r in results] == [PASSED, FAILED, TIMEOUT, PASSED]
    assert run_many([]) == []
    with pytest.raises(ValueError, match="positive"):
        run_python("pass", timeout_s=0)


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    # a generous limit for programs that end (a loaded machine must not turn a failure into a
    # timeout), a short one for the program that never does
    task = HumanEvalTask(timeout_s=30.0, workers=2).limited(6)
    assert len(task.examples) == 6 and task.examples[0].uid == "HumanEval/0"
    good = task.judge_all(task.examples, [e.reference for e in task.examples])
    assert all(j.correct for j in good)
    bad = task.judge_all(task.examples, ["    return None\n"] * 6)
    assert not any(j.correct for j in bad) and all(j.detail.startswith("failed") for j in bad)
    hang = HumanEvalTask(timeout_s=2.0, workers=1).limited(1)
    verdict = hang.judge(hang.examples[0], "    while True:\n        pass\n")
    assert not verdict.correct and verdict.detail.startswith("timeout")


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
