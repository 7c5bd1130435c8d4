"""Run one function on N real ranks joined by a gloo rendezvous, as torchrun would, without a shell.

Each rank gets torchrun's environment and returns its result through a file; a rank that fails
fails the launch with its traceback, a hung launch is killed at ``timeout_s``, and no process
outlives the launch (each rank leads a process group, stopped at the end; ranks die with the
launcher). Ranks fork from a server that has imported ``RANK_PRELOAD`` once.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


#: Seconds between SIGTERM and SIGKILL when a launch's process groups are stopped.
STOP_GRACE_S = 5.0

_PR_SET_PDEATHSIG = 1

#: What the fork server imports before it forks any rank: third-party modules only, which read
#: nothing of a rank's environment on import (the rank sets its own before it runs ``fn``).
RANK_PRELOAD = ("torch", "torch.distributed", "megatron.core")


class DistributedLaunchError(RuntimeError):
    """A rank raised, died, or the launch ran past its deadline."""


def find_free_port() -> int:
    """A free TCP port on 127.0.0.1, picked at random below the ephemeral range when there is room,
    so no outgoing connection takes it between the binds of a launch's process groups."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.Random().sample(range(10_000, low), min(64, max(0, low - 10_000)))
    for port in [*candidates, 0]:  # 0: the kernel's choice, when none below the range is free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError("no free TCP port on 127.0.0.1")


class _LauncherStdio:
    """The launcher's stdout and stderr at launch time, passed to the rank when its arguments are
    pickled for the fork server (whose own stdio is the launcher's at server start)."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_AttachedStdio, tuple(DupFd(fd) for fd in (1, 2)))


class _AttachedStdio:
    def __init__(self, *fds: Any) -> None:
        self.fds = fds

    def attach(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd.detach(), target)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    result_dir: str,
    env: dict[str, str],
    args: tuple,
    kwargs: dict,
    launcher_pid: int,
    stdio: _AttachedStdio,
) -> None:
    _leave_no_orphans(launcher_pid)
    stdio.attach()
    os.environ.clear()  # the launcher's environment as it is now, not as the fork server found it
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    # Two cores shared by several ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    out = Path(result_dir) / f"rank{rank}.pt"
    try:
        result = fn(*args, **kwargs)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - the traceback is the report
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere a no-op).
    The signal follows the parent *thread*: start helpers from the main thread."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def _leave_no_orphans(launcher_pid: int) -> None:
    """Lead a process group of our own (our helpers join it) and die with the launcher: closing our
    copy of the fork server's "alive" pipe lets the server, and so each rank, exit with the launcher."""
    from multiprocessing import forkserver

    os.setpgid(0, 0)
    die_with_parent(os.getppid())
    alive_fd = forkserver._forkserver._forkserver_alive_fd
    if alive_fd is not None:
        os.close(alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        os._exit(1)


def _rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server, with ``RANK_PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def _checkpoint_results_queue(*_args: Any, **_kwargs: Any) -> Any:
    """Megatron's write-results queue factory (``filesystem_async``, 0.16.1 lines 51-56, 0.19.2
    lines 53-66) with its Manager started under ``die_with_parent``; otherwise the same."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
    return filesystem_async._results_queue


def make_checkpoint_manager_die_with_rank() -> Callable[[], None] | None:
    """Make the Manager of Megatron's checkpoint writers die with its rank (torchrun does not stop
    it after a ``kill -9``); return an undo, or None on an unchecked Megatron-Core release."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        from .megatron_compat import SUPPORTED_RELEASES, megatron_core_version, write_results_queue_attribute
    except ImportError:  # no Megatron checkpoints in this process, so no Manager either
        return None
    attribute = write_results_queue_attribute()
    if megatron_core_version() not in SUPPORTED_RELEASES or attribute is None:
        return None
    original = getattr(filesystem_async, attribute)
    if original is _checkpoint_results_queue:
        return lambda: None
    setattr(filesystem_async, attribute, _checkpoint_results_queue)
    return lambda: setattr(filesystem_async, attribute, original)


def stop_process_groups(
    pgids: list[int], reap: Callable[[], object] = lambda: None, grace_s: float = STOP_GRACE_S
) -> None:
    """SIGTERM each process group, then SIGKILL any with members left after ``grace_s``; ``reap``
    runs while waiting, since an unreaped zombie still counts as a member."""
    def signal_groups(groups: list[int], sig: int) -> list[int]:
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
                alive.append(pgid)
            except ProcessLookupError:  # the group is empty
                pass
            except PermissionError:  # a member we cannot signal: not ours to stop
                pass
        return alive

    alive = signal_groups(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        reap()
        alive = signal_groups(alive, 0)
    signal_groups(alive, signal.SIGKILL)
    reap()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (a module-level function) on ``world_size`` fresh ranks; return
    results by rank, or raise ``DistributedLaunchError``."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    ctx = _rank_context()
    port = find_free_port()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_WEDLM_CPU": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="wedlm-mp-") as result_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, result_dir, child_env, args, kwargs, os.getpid(), _LauncherStdio()),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failed_rank = None
        try:
            while any(p.is_alive() for p in procs):
                for rank, proc in enumerate(procs):
                    if not proc.is_alive() and proc.exitcode not in (0, None):
                        failed_rank = rank
                if failed_rank is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            stop_process_groups([p.pid for p in procs], reap=lambda: [p.is_alive() for p in procs])
            for proc in procs:
                if proc.is_alive():  # killed before it could lead its own group
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
        return _collect(procs, result_dir, failed_rank, timeout_s)


def _collect(procs: list, result_dir: str, failed_rank: int | None, timeout_s: float) -> list[Any]:
    results: list[Any] = []
    errors: list[str] = []
    for rank, proc in enumerate(procs):
        path = Path(result_dir) / f"rank{rank}.pt"
        if not path.exists():
            if failed_rank is None and proc.exitcode in (None, -signal.SIGKILL, -signal.SIGTERM):
                errors.append(f"rank {rank}: killed after the {timeout_s:.0f}s deadline")
            else:
                errors.append(f"rank {rank}: exited with code {proc.exitcode} and no result")
            continue
        payload = torch.load(path, weights_only=False)
        if payload["ok"]:
            results.append(payload["result"])
        else:
            errors.append(f"rank {rank} raised:\n{payload['error']}")
    if errors:
        # The first rank that actually raised explains the others (they were killed or hung).
        errors.sort(key=lambda e: ("raised" not in e, e))
        raise DistributedLaunchError("\n".join(errors))
    return results
