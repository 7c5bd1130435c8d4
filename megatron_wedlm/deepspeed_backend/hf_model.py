"""A HF causal LM ready for WeDLM training: loaded from a local directory, with a mask-token row.

Anything :func:`megatron_wedlm.decoding.loading.load_wedlm_model` loads. The data fixes the mask
id: a checkpoint that knows a mask token must agree; otherwise the embedding grows if needed and
the mask row takes the mean of the real tokens' rows, as the HF -> Megatron conversion does, so
both backends start from the same weights. ``config.mask_token_id`` records the id.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from megatron_wedlm.runtime.hf_local import checkpoint_mask_token_id, checkpoint_tokenizer, read_config

__all__ = [
    "MaskTokenPlan",
    "load_hf_causal_lm",
    "plan_mask_token",
    "apply_mask_token",
    "weight_decay_param_groups",
]


@dataclass(frozen=True)
class MaskTokenPlan:
    """What :func:`apply_mask_token` does to a checkpoint for the data's mask token id."""

    mask_token_id: int
    initialise_row: bool  # the token is new to the checkpoint: give its row the mean embedding
    mean_over_rows: int  # rows of real tokens averaged for the new row
    min_rows: int  # the embedding must have at least this many rows


def load_hf_causal_lm(path: str | Path, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """Load ``path`` in ``dtype`` for training (``train()`` mode, KV cache off) without moving it:
    DeepSpeed places it (under ZeRO-3 init already partitioned)."""
    from megatron_wedlm.decoding.loading import load_wedlm_model  # imports transformers

    try:
        model = load_wedlm_model(
            path, dtype=dtype, attn_implementation=attn_implementation, require_mask_token=False, place=False
        )
    except ValueError as err:
        raise ValueError(f"model.init_from: {err}") from None
    model.config.use_cache = False
    return model.train()


def plan_mask_token(init_from: str | Path, mask_token_id: int, vocab_rows: int) -> MaskTokenPlan:
    """Decide how checkpoint ``init_from`` (with ``vocab_rows`` embedding rows) gets the data's mask id."""
    path = Path(init_from)
    tokenizer = checkpoint_tokenizer(path)
    known = checkpoint_mask_token_id(read_config(path), tokenizer)
    if known is not None:
        if known != mask_token_id:
            raise ValueError(
                f"the checkpoint in {path} uses mask token id {known} but the data was prepared with mask "
                f"token id {mask_token_id}; prepare the data with the checkpoint's tokenizer "
                "(tools/prepare_data.py --tokenizer <model dir>)"
            )
        if known >= vocab_rows:
            raise ValueError(
                f"{path}: mask_token_id {known} has no embedding row (the embedding has {vocab_rows} rows)"
            )
        return MaskTokenPlan(mask_token_id, initialise_row=False, mean_over_rows=0, min_rows=vocab_rows)
    # Without the checkpoint's tokenizer only a row beyond the embedding is known to be new.
    real_tokens = len(tokenizer) if tokenizer is not None else vocab_rows
    if mask_token_id < real_tokens:
        # An ordinary token of the checkpoint's vocabulary promoted to mask token: keep its row.
        return MaskTokenPlan(mask_token_id, initialise_row=False, mean_over_rows=0, min_rows=vocab_rows)
    return MaskTokenPlan(
        mask_token_id,
        initialise_row=True,
        mean_over_rows=min(real_tokens, vocab_rows),
        min_rows=max(vocab_rows, mask_token_id + 1),
    )


@contextlib.contextmanager
def _full_parameters(params: list[nn.Parameter]) -> Iterator[None]:
    """Full tensors of ZeRO-3-partitioned parameters inside the block, rank 0's edits kept (no-op otherwise)."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        yield


def _embedding_weights(model: nn.Module) -> list[nn.Parameter]:
    """Input embedding and, when untied, output layer weights (the tensors with a row per token)."""
    weights = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight is not weights[0]:
        weights.append(output.weight)
    return weights


def apply_mask_token(model: nn.Module, plan: MaskTokenPlan, pad_rows_to_multiple_of: int = 1) -> None:
    """Grow the embedding if needed, initialise the new mask row, record ``config.mask_token_id``;
    other grown rows are zero, as in the Megatron conversion."""
    old_rows = model.get_input_embeddings().num_embeddings
    if old_rows < plan.min_rows:
        multiple = max(int(pad_rows_to_multiple_of), 1)
        new_rows = -(-plan.min_rows // multiple) * multiple
        model.resize_token_embeddings(new_rows, mean_resizing=False)
    weights = _embedding_weights(model)
    if plan.initialise_row or model.get_input_embeddings().num_embeddings > old_rows:
        with _full_parameters(weights), torch.no_grad():
            for weight in weights:
                weight[old_rows:] = 0
                if plan.initialise_row:
                    mean = weight[: plan.mean_over_rows].double().mean(0)
                    weight[plan.mask_token_id] = mean.to(weight.dtype)
    model.config.mask_token_id = plan.mask_token_id


def weight_decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups as Megatron forms them: no decay on biases and 1-D tensors; ``wd_mult`` keeps
    Megatron's scheduler from decaying the no-decay group."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps the full shape aside
        (no_decay if name.endswith(".bias") or len(shape) == 1 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]
    return [g for g in groups if g["params"]]
