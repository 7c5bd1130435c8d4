"""Stopping a run cleanly on a signal: the step in flight finishes, every rank saves that step's
checkpoint, the log is closed, and the process exits 0.

SLURM sends SIGTERM at a job's time limit, on ``scancel`` and on preemption. The signal is blocked,
not handled: the loop asks for it after each step (:meth:`StopSignal.requested`) and adds the answer
to the step's one all-reduce, so every rank learns at the same step and they save together. A signal
mask, unlike a Python handler, is inherited by the threads and processes a rank starts later
(loader workers, checkpoint writers), so the SIGTERM that reaches them does not kill what the save
needs; hence :func:`block_stop_signal` runs first in the entry point, before torch starts a thread.
"""

from __future__ import annotations

import signal
import threading
from multiprocessing import resource_tracker

__all__ = ["StopSignal", "block_stop_signal"]


def block_stop_signal(name: str | None) -> bool:
    """Block ``name`` (a ``trainer.exit_signal``) in this process; returns whether it did.

    Call it while the process has one thread: a thread started earlier keeps its own mask, and a
    process-directed signal goes to a thread that does not block it (killing the process)."""
    if name is None or threading.active_count() > 1:
        return False
    # multiprocessing's resource tracker unblocks SIGINT and SIGTERM in the thread that starts it,
    # which the first spawned helper does (Megatron-Core's checkpoint writers' queue, at the first
    # save): started now, before the block, it is never started from the training loop
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.Signals[name]})
    return True


class StopSignal:
    """Whether ``name`` came since it was blocked (:func:`block_stop_signal`). Where it is not
    blocked (``trainer.exit_signal=null``, or a run started in-process, as the tests' launcher
    does), the signal keeps its default action and ``requested`` stays 0."""

    def __init__(self, name: str | None) -> None:
        self.number = None if name is None else signal.Signals[name]
        self.armed = self.number is not None and self.number in signal.pthread_sigmask(signal.SIG_BLOCK, [])

    @property
    def requested(self) -> float:
        """1.0 once the signal is pending (a number, to be summed over the ranks with the step's totals)."""
        if not self.armed:
            return 0.0
        # blocked again each time, in case a library unblocked it in this thread since (a signal
        # in between kills the rank, as without the block)
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.number})
        return 1.0 if self.number in signal.sigpending() else 0.0
