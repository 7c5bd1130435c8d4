"""Compiled FlexAttention on CPU with our BlockMask vs SDPA with the dense mask.

Eager flex_attention evaluates the mask_mod on every pair and ignores the tile structure, so
only the compiled kernel checks the BlockMask's full/partial/empty tiles end to end: a tile
wrongly claimed 'full' skips the mask_mod and changes the output. (~20-40 s: one compile.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_wedlm.data import RowFormat, build_block_mask, build_dual_stream_batch, stack_dual_stream_batches

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on CPU needs a C++ compiler")


def test_compiled_flex_attention_uses_tiles_correctly():
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    gen = torch.Generator().manual_seed(0)
    rows = [
        build_dual_stream_batch([torch.randint(1, 50, (n,), generator=gen) for n in lens], RowFormat(8, 0), gen,
                                prompt_lengths=[5] * len(lens))
        for lens in [(130, 61, 40), (200, 40), (256,)]
    ]
    stacked = stack_dual_stream_batches(rows, pad_to=512)
    meta = stacked.attention_metadata()
    block_mask = build_block_mask(meta, 128, padding_attends_self=True)
    assert block_mask.full_kv_num_blocks.sum() > 0 and block_mask.kv_num_blocks.sum() > 0
    q, k, v = (torch.randn(3, 2, 512, 16, generator=gen) for _ in range(3))
    # dynamic=False as in the model's flex backend: a dynamic-shape recompile here would leave
    # dynamo's automatic-dynamic state behind for later compiled tests in the same process.
    compiled = torch.compile(flex_attention, dynamic=False)
    out = compiled(q, k, v, block_mask=block_mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=stacked.dense_attention_mask(True).unsqueeze(1))
    assert torch.allclose(out, ref, atol=2e-5), (out - ref).abs().max()

    # the check is sensitive: calling every tile 'full' (mask_mod never evaluated) changes the output
    n = 512 // 128
    all_full = BlockMask.from_kv_blocks(
        torch.zeros(3, 1, n, dtype=torch.int32), torch.zeros(3, 1, n, n, dtype=torch.int32),
        torch.full((3, 1, n), n, dtype=torch.int32), torch.arange(n, dtype=torch.int32).expand(3, 1, n, n).contiguous(),
        BLOCK_SIZE=128, mask_mod=block_mask.mask_mod, seq_lengths=(512, 512),
    )
    assert not torch.allclose(compiled(q, k, v, block_mask=all_full), ref, atol=1e-3)
