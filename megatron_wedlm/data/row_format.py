"""How a training row is built from its documents: one frozen settings object, checked once.

The settings travel whole from the run's config and data manifest (``training/run_data.py``)
through the loader to :func:`.dual_stream.build_dual_stream_batch`; each field's meaning is in
:mod:`.dual_stream` (the masking rules) and :mod:`.webdataset_loader` (appended end tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RowFormat"]


@dataclass(frozen=True)
class RowFormat:
    """The row settings of a run (or of a test's rows).

    ``pad_token_id`` defaults to the mask token. ``end_token_id`` is the token that ends a reply;
    ``appended_end_tokens`` copies of it are appended to every SFT sample before packing, and in a
    share ``mask_after_masked_end`` of the blocks a masked end token masks the rest of its block
    (0: never).
    """

    block_size: int
    mask_token_id: int
    pad_token_id: int | None = None
    ratio_mode: Literal["block", "document"] = "block"
    random_block_offset: bool = False
    mask_eps: float = 1e-8
    end_token_id: int | None = None
    appended_end_tokens: int = 0
    mask_after_masked_end: float = 0.0
    prune_unmasked_blocks: bool = False

    def __post_init__(self) -> None:
        mask = self.mask_token_id
        if mask is None or isinstance(mask, bool) or int(mask) != mask:
            raise ValueError(f"mask_token_id must be the integer id of the mask token, got {mask!r}")
        object.__setattr__(self, "mask_token_id", int(mask))
        object.__setattr__(self, "pad_token_id", int(mask if self.pad_token_id is None else self.pad_token_id))
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not 0.0 < self.mask_eps <= 1.0:
            raise ValueError(f"eps must be in (0, 1], got {self.mask_eps!r}")
        if self.ratio_mode not in ("block", "document"):
            raise ValueError(f"ratio_mode must be 'block' or 'document', got {self.ratio_mode!r}")
        if self.appended_end_tokens < 0:
            raise ValueError(f"appended_end_tokens must be >= 0, got {self.appended_end_tokens}")
        if not 0.0 <= self.mask_after_masked_end <= 1.0:
            raise ValueError(f"mask_after_masked_end is the share of blocks it applies to, in [0, 1]; "
                             f"got {self.mask_after_masked_end}")
        if (self.appended_end_tokens or self.mask_after_masked_end) and self.end_token_id is None:
            raise ValueError("appended_end_tokens and mask_after_masked_end need the reply's end_token_id")

    @property
    def masked_end_token_id(self) -> int | None:
        """The end token whose masking masks the rest of its block; None when the rule is off."""
        return self.end_token_id if self.mask_after_masked_end else None

    def position_key(self) -> dict[str, int]:
        """The fields a stream position depends on (where rows are cut), recorded with a data
        state so that a resume under another format is refused."""
        return {"block_size": self.block_size, "appended_end_tokens": self.appended_end_tokens}
