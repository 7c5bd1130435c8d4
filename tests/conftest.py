"""Shared pytest setup: import the package from this checkout and keep CPU threads in check."""

import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Spawned ranks import the package by name; make sure they find this checkout too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# On pytest-xdist's workers (.ci/run: two on two cores), torch in the test process and in the
# commands it starts uses one thread: two workers' thread pools on two cores spin against each
# other, which made in-process decoding tests 3-5x slower than one worker running them alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


# --------------------------------------------------------------------------------------------
# Where the suite's time goes: wall and CPU seconds (this process and the children it waited
# for: torchrun ranks, CLI launches, servers) per test file, printed at the end of every run and,
# with MEGATRON_WEDLM_TEST_TIMES=path, written as JSON. CPU/wall below about 1 means the file mostly
# waits (launches, servers, sleeps); near 2 means it keeps both cores busy.
# --------------------------------------------------------------------------------------------
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

_TEST_TIMES: dict[str, tuple[float, float]] = {}  # node id -> (wall s, CPU s)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _fork_server_cpu_seconds()


def _fork_server_cpu_seconds() -> float:
    """run_distributed's ranks are children of its fork server, which reaps them: its own and its
    reaped children's CPU time (/proc/PID/stat fields 14-17)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    _TEST_TIMES[item.nodeid] = (time.perf_counter() - wall, _cpu_seconds() - cpu)


def pytest_sessionfinish(session):
    """Under pytest-xdist, each worker hands its times to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["test_times"] = json.dumps(_TEST_TIMES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _TEST_TIMES.update(json.loads(getattr(node, "workeroutput", {}).get("test_times", "{}")))


def pytest_terminal_summary(terminalreporter):
    if not _TEST_TIMES:
        return
    files: dict[str, list[float]] = {}  # path -> [wall s, CPU s, tests]
    for nodeid, (wall, cpu) in _TEST_TIMES.items():
        entry = files.setdefault(nodeid.split("::", 1)[0], [0.0, 0.0, 0])
        entry[0] += wall
        entry[1] += cpu
        entry[2] += 1
    rows = sorted(files.items(), key=lambda kv: -kv[1][0])
    terminalreporter.write_sep("=", "time per test file (wall s, CPU s, CPU/wall, tests)")
    for path, (wall, cpu, count) in rows[:25]:
        terminalreporter.write_line(f"{wall:8.1f} {cpu:8.1f} {cpu / max(wall, 1e-9):5.2f} {count:4d}  {path}")
    total_wall, total_cpu = sum(v[0] for v in files.values()), sum(v[1] for v in files.values())
    terminalreporter.write_line(f"{total_wall:8.1f} {total_cpu:8.1f} {total_cpu / max(total_wall, 1e-9):5.2f}  all files")
    target = os.environ.get("MEGATRON_WEDLM_TEST_TIMES")
    if target:
        Path(target).write_text(json.dumps({
            "files": {p: {"wall_s": w, "cpu_s": c, "tests": n} for p, (w, c, n) in files.items()},
            "tests": {t: {"wall_s": w, "cpu_s": c} for t, (w, c) in _TEST_TIMES.items()}}, indent=1))
