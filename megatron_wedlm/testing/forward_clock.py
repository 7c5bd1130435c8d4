"""Wall time a decode spends in the model's forward (body and output layer), for benchmarks.

The decoding runner calls the HF body, or the lean body it takes for a Llama-family model
(:mod:`megatron_wedlm.decoding.lean_body`), and the output layer through
:func:`~megatron_wedlm.decoding.lean_body.project`; HF ``generate`` calls the body and the output
layer's modules. The clock wraps all four, so it counts whichever runs, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_wedlm.decoding import lean_body, model_runner


class ForwardClock:
    """``seconds``: wall time inside the forward while :meth:`installed` (the GPU's queued work included)."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _timed(self, forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            output = forward(*args, **kwargs)
            self._sync()
            self.seconds += time.perf_counter() - start
            return output

        return run

    @contextmanager
    def installed(self) -> Iterator["ForwardClock"]:
        sites = [(self.model.base_model, "forward"), (self.model.get_output_embeddings(), "forward"),
                 (lean_body.LeanBody, "__call__"), (model_runner, "project")]
        originals = [getattr(owner, name) for owner, name in sites]
        for (owner, name), original in zip(sites, originals):
            setattr(owner, name, self._timed(original))
        try:
            yield self
        finally:
            for (owner, name), original in zip(sites, originals):
                setattr(owner, name, original)
