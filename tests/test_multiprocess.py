"""The multi-process harness: results by rank, failures surfaced, hangs killed."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_wedlm.runtime.multiprocess import DistributedLaunchError, run_distributed


def allreduce_rank(scale: float) -> dict:
    import torch.distributed as dist

    from megatron_wedlm.runtime.parallel import init_distributed

    init_distributed(torch.device("cpu"))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": value * scale, "env_rank": int(os.environ["RANK"])}


def fail_on_rank_one() -> int:
    import torch.distributed as dist

    from megatron_wedlm.runtime.parallel import init_distributed

    init_distributed(torch.device("cpu"))
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever without the harness
    return 0


def sleep_forever() -> None:
    time.sleep(3600)


def rank_one_killed_with_helpers_running(pid_dir: str) -> None:
    """Each rank starts Megatron's kind of helpers, then rank 1 is killed with SIGKILL."""
    import multiprocessing as mp

    import torch.distributed as dist

    from megatron_wedlm.runtime.parallel import init_distributed

    init_distributed(torch.device("cpu"))
    # The Manager behind Megatron's checkpoint-writer result queue (a spawned server process).
    manager = mp.get_context("spawn").Manager()
    manager.Queue()
    # A helper that ignores SIGTERM and waits on a futex forever.
    helper = os.fork()
    if helper == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns
    pids = [os.getpid(), manager._process.pid, helper]
    Path(pid_dir, f"rank{dist.get_rank()}").write_text(" ".join(map(str, pids)))
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here for a rank that is gone


def report_pid_env_and_sleep(pid_dir: str) -> None:
    """Prints the launch-time variable, writes its pid, then waits to be killed."""
    # one write of the whole line: print's text and newline are two writes on an unbuffered stdout,
    # and two ranks' could interleave in the file they share
    sys.stdout.write(f"rank {os.environ['RANK']} says {os.environ.get('WEDLM_TEST_SET_AT_LAUNCH')}\n")
    sys.stdout.flush()
    Path(pid_dir, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)


_LAUNCHER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from megatron_wedlm.runtime.multiprocess import run_distributed
from test_multiprocess import report_pid_env_and_sleep
run_distributed(os.getpid, 1)  # the fork server starts here
os.environ["WEDLM_TEST_SET_AT_LAUNCH"] = "yes"
os.dup2(os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT), 1)
run_distributed(report_pid_env_and_sleep, 2, sys.argv[1], timeout_s=300)
"""


def test_ranks_see_the_launch_time_environment_and_stdout_and_die_with_a_killed_launcher(tmp_path):
    """Ranks fork from a server started before the variable was set and stdout redirected:
    they still see the variable and print to the new stdout, and SIGKILL to the launcher ends
    them (through the server, which exits with it)."""
    pid_dir, stdout = tmp_path / "pids", tmp_path / "stdout.txt"
    pid_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(pid_dir), str(Path(__file__).parent),
                                 str(stdout)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while sorted(p.name for p in pid_dir.iterdir() if p.read_text()) != ["rank0", "rank1"]:
            assert launcher.poll() is None and time.monotonic() < deadline, "the launch did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        assert all(map(_alive, pids))
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    assert sorted(stdout.read_text().splitlines()) == ["rank 0 says yes", "rank 1 says yes"]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == [], "ranks outlived their launcher"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_a_rank_leaves_no_process_of_the_launch(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedLaunchError, match="rank 1: exited with code -9"):
        run_distributed(rank_one_killed_with_helpers_running, 2, str(tmp_path), timeout_s=120)
    pids = [int(p) for rank in (0, 1) for p in (tmp_path / f"rank{rank}").read_text().split()]
    assert len(pids) == 6
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
    assert time.monotonic() - start < 90


_RANK_WITH_CHECKPOINT_MANAGER = """
import sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_wedlm.runtime.megatron_compat import write_results_queue_attribute
from megatron_wedlm.runtime.multiprocess import make_checkpoint_manager_die_with_rank
if sys.argv[1] == "patched":
    assert make_checkpoint_manager_die_with_rank() is not None
queue = getattr(filesystem_async, write_results_queue_attribute())()
print(queue._manager._process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "megatron-as-is"])
def test_megatron_checkpoint_manager_dies_with_a_killed_rank(patched):
    # A rank outside our launcher (as under torchrun) starts the Manager that Megatron's
    # checkpoint writers report through, then is killed with -9, its process group untouched.
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK_WITH_CHECKPOINT_MANAGER, "patched" if patched else "as-is"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    manager_pid = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 3
    while _alive(manager_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphaned = _alive(manager_pid)
    if orphaned:
        os.kill(manager_pid, signal.SIGKILL)
    assert orphaned is not patched  # Megatron's own Manager outlives its rank; ours does not


def test_results_come_back_in_rank_order():
    results = run_distributed(allreduce_rank, 3, 2.0, timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["env_rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert torch.equal(r["sum"], torch.tensor([12.0]))


def test_a_failing_rank_fails_the_launch_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedLaunchError, match="rank one is broken"):
        run_distributed(fail_on_rank_one, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # the waiting rank was killed, not waited for


def test_a_hung_launch_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedLaunchError, match="deadline"):
        run_distributed(sleep_forever, 2, timeout_s=8)
    assert time.monotonic() - start < 40
