"""Decoding-step matmuls on CPU in bf16 through oneDNN-packed weights: the same bits, less time.

torch's bf16 ``F.linear`` on CPU gives oneDNN the weight in its plain layout, which oneDNN
reorders into its blocked layout on every call; a weight packed once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does, and vLLM's CPU
backend through its own oneDNN handle) skips that. At decoding's row counts the packed kernel is
the one ``F.linear`` and ``torch.mv`` run, so the outputs are equal bit for bit; a matrix's
shape is checked at each thread count before its packed copy is used (:meth:`Packed.serves`),
and the plain call runs where the check fails or the rows exceed :data:`PACKED_ROWS`
(prefills). Row-concatenated weights (q, k, v; gate, up) are one packed matmul, as each output
row's sum is unchanged. Cost: a second copy of the packed matrices while their runner lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# the most rows a packed matmul serves: decoding steps (a batch's next tokens, a window);
# longer inputs (prefills) take F.linear, whose kernel choice for them may differ
PACKED_ROWS = 32

# (out, in, bias, threads) -> whether the packed matmul equals the plain one at 1..PACKED_ROWS rows
_EQUAL: dict[tuple[int, int, bool, int], bool] = {}


def can_pack(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight on a CPU whose oneDNN has bf16 kernels."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of ``x`` ``[T, in]``; one row through ``mv``/``addmv`` (same bits, less time)."""
    if x.shape[0] == 1:
        row = torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0])
        return row[None]
    return F.linear(x, weight, bias)


class Packed:
    """One matrix, the row-concatenation of ``parts`` (weight, bias), packed at its first use."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor | None]]):
        if len({weight.shape[1] for weight, _ in parts}) != 1 or len({bias is None for _, bias in parts}) != 1:
            raise ValueError("packed parts take inputs of one width, and biases for all parts or none")
        self.parts = list(parts)
        self.sizes = [weight.shape[0] for weight, _ in parts]
        biases = [bias for _, bias in parts]
        self.bias = None if biases[0] is None else torch.cat(biases)
        self.packed: torch.Tensor | None = None

    def serves(self, rows: int) -> bool:
        """Whether a matmul over ``rows`` rows takes the packed weight at this thread count."""
        if not 1 <= rows <= PACKED_ROWS:
            return False
        weight = self.parts[0][0]
        key = (sum(self.sizes), weight.shape[1], self.bias is not None, torch.get_num_threads())
        if key not in _EQUAL:
            _EQUAL[key] = self._equal_to_plain()
        return _EQUAL[key]

    def _equal_to_plain(self) -> bool:
        # a different kernel sums in a different order, which random inputs show at once
        generator = torch.Generator().manual_seed(0)
        weight = self.parts[0][0]
        for rows in range(1, PACKED_ROWS + 1):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
            plain = torch.cat([plain_linear(x, w, b) for w, b in self.parts], dim=-1)
            if not torch.equal(self._matmul(x), plain):
                return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            whole = torch.cat([weight for weight, _ in self.parts]) if len(self.parts) > 1 else self.parts[0][0]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(whole, PACKED_ROWS)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` through the matrix, cut back into its parts (views)."""
        return self(x).split(self.sizes, dim=-1)


def pack(*parts: tuple[torch.Tensor, torch.Tensor | None]) -> Packed | None:
    """``parts`` as one packed matrix (packed at its first use), or None where they cannot be."""
    if not all(can_pack(weight) for weight, _ in parts):
        return None
    return Packed(parts)
