"""The multi-process harness: results by rank, failures surfaced, hangs killed."""

import os
import time

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
