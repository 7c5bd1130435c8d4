"""HF directory (Qwen2 / Qwen3 / Llama / Qwen3-MoE, safetensors) -> Megatron ``torch_dist`` checkpoint.

Writes the checkpoint, ``wedlm_model.json`` (what to build to load it), the tokenizer files and
``generation_config.json``. Every HF tensor is checked before anything is written, and the
output is renamed into place at the end, so a failure leaves an earlier output as it was.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_wedlm.model.hf_config import (
    DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY,
    ModelArgs,
    UnsupportedModelError,
    model_args_from_hf_config,
    pad_vocab_size,
    save_model_args,
)
from megatron_wedlm.runtime.atomic_output import atomic_output_dir, check_output_dir
from megatron_wedlm.runtime.multiprocess import run_distributed

from .hf_checkpoint import ConversionError, HFSafetensorsReader, read_json
from .layout import resize_rows
from .mapping import (
    IGNORED_HF_SUFFIXES,
    OUTPUT_LAYER,
    Combine,
    TensorRule,
    all_hf_names,
    experts_of,
    global_rules,
    hf_shapes,
    layer_rules,
    to_megatron,
    zero_hf_tensors,
)
from .megatron_checkpoint import build_conversion_model, fill_model, megatron_process_group, save_megatron_checkpoint
from .tokenizer_files import DEFAULT_MASK_TOKEN, MaskTokenSetup, copy_tokenizer_files, prepare_tokenizer

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class MaskRowInit:
    """Give a newly added mask token's row the mean of the existing token rows."""

    row: int
    mean_over_rows: int  # rows of real tokens before the addition


def check_hf_checkpoint(reader: HFSafetensorsReader, args: ModelArgs) -> None:
    """Raise naming the first missing or mis-shaped tensor, or listing tensors nothing would convert."""
    for rule in global_rules(args):
        _check_rule(reader, rule, None, args)
    for layer in range(args.num_layers):
        for rule in layer_rules(args):
            for expert in experts_of(rule, args):
                _check_rule(reader, rule, layer, args, expert)
    expected = set(all_hf_names(args))
    if args.tie_word_embeddings:
        expected |= set(OUTPUT_LAYER.hf)  # some tied checkpoints store the (identical) head anyway
    for layer in range(args.num_layers):
        for name in zero_hf_tensors(args, layer):
            expected.add(name)
            if name in reader and reader.read(name).any():
                raise ConversionError(
                    f"tensor {name!r} in {reader.directory} is not zero: a {args.architecture} model with q/k/v "
                    "biases converts only without an output-projection bias (Megatron's add_bias_linear would "
                    "add MLP biases too, which this model does not have)"
                )
    unmapped = sorted(n for n in reader.names() if n not in expected and not n.endswith(IGNORED_HF_SUFFIXES))
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f", ... ({len(unmapped)} in all)" if len(unmapped) > 8 else "")
        raise ConversionError(
            f"the HF checkpoint has tensors that a {args.architecture} conversion does not map and would "
            f"drop: {shown}. Is config.json's model_type right?"
        )


def _check_rule(
    reader: HFSafetensorsReader, rule: TensorRule, layer: int | None, args: ModelArgs, expert: int | None = None
) -> None:
    for name, shape in zip(rule.hf_names(layer, expert), hf_shapes(rule, args)):
        if name not in reader:
            raise ConversionError(f"tensor {name!r} is missing from the HF checkpoint {reader.directory}")
        actual = reader.shape(name)
        if actual != shape:
            moe = (f", num_experts={args.num_experts}, moe_intermediate_size={args.moe_ffn_hidden_size}"
                   if args.is_moe else "")
            raise ConversionError(
                f"shape mismatch for tensor {name!r}: the checkpoint has {actual}, config.json implies {shape} "
                f"(hidden_size={args.hidden_size}, heads={args.num_attention_heads}, kv_heads={args.num_query_groups}, "
                f"head_dim={args.head_dim}, intermediate_size={args.ffn_hidden_size}, vocab_size={args.vocab_size}"
                f"{moe})"
            )


class HFTensorSource:
    """Full Megatron tensors made from HF tensors read on demand (see ``TensorSource``)."""

    def __init__(self, directory: str | Path, args: ModelArgs, mask_init: MaskRowInit | None) -> None:
        self.reader = HFSafetensorsReader(directory)
        self.args = args
        self.mask_init = mask_init

    def __call__(self, rule: TensorRule, layer: int | None, expert: int | None = None) -> torch.Tensor:
        tensors = [self.reader.read(name) for name in rule.hf_names(layer, expert)]
        if rule.combine is Combine.VOCAB:
            tensors = [self._grown_vocab(tensors[0])]
        return to_megatron(rule, tensors, self.args).to(self.args.torch_dtype)

    def _grown_vocab(self, rows: torch.Tensor) -> torch.Tensor:
        grown = resize_rows(rows, self.args.vocab_size)
        if self.mask_init is not None:
            real = rows[: self.mask_init.mean_over_rows]
            grown[self.mask_init.row] = real.mean(dim=0, dtype=torch.float32).to(rows.dtype)
        return grown


def write_rank(
    args_dict: dict, input_dir: str, output_dir: str, tp: int, pp: int, ep: int = 1,
    mask_init: MaskRowInit | None = None,
) -> None:
    """One rank of the writer: build its part of the model at TP x PP x EP, fill it from the HF
    directory, save (collectively). Joins the caller's world, whose ranks beyond TP x PP x EP are
    data-parallel replicas (tests write several layouts in one launch this way).
    """
    args = ModelArgs.from_dict(args_dict)
    with megatron_process_group(tp, pp, ep):
        model = build_conversion_model(args)
        fill_model(model, args, HFTensorSource(input_dir, args, mask_init))
        save_megatron_checkpoint(model, output_dir, release_model=True)


def convert_hf_to_megatron(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    mask_token: str = DEFAULT_MASK_TOKEN,
    add_mask_token: bool = True,
    make_vocab_size_divisible_by: int = DEFAULT_MAKE_VOCAB_SIZE_DIVISIBLE_BY,
    dtype: str | None = None,
    overwrite: bool = False,
    timeout_s: float = 24 * 3600.0,
) -> ModelArgs:
    """Convert and return the :class:`ModelArgs` written to ``wedlm_model.json``.

    ``tensor/pipeline/expert_model_parallel_size``: the layout written (TP x PP x EP local
    processes; experts use TP as their expert TP); it loads under any layout. ``dtype`` defaults to
    the HF weights'.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    config_file = input_dir / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{input_dir} is not a HF model directory: {config_file} does not exist")
    check_output_dir(output_dir, [input_dir], overwrite)
    raw = read_json(config_file)
    try:
        source_args = model_args_from_hf_config(
            raw, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tensor_model_parallel_size=tp
        )
    except ValueError as err:  # an unsupported model, or fields ModelArgs refuses (top-k > experts)
        kind = UnsupportedModelError if isinstance(err, UnsupportedModelError) else ConversionError
        raise kind(f"{config_file}: {err}") from err
    _check_layout(source_args, tp, pp, ep)
    reader = HFSafetensorsReader(input_dir)
    check_hf_checkpoint(reader, source_args)

    with tempfile.TemporaryDirectory(prefix="wedlm-tokenizer-") as staged_tokenizer:
        # Staged aside: torch_dist warns about (and may clean) a non-empty target directory.
        mask = prepare_tokenizer(
            input_dir, staged_tokenizer, config=raw,
            mask_token=mask_token, add_mask_token=add_mask_token,
        )
        args = _target_args(source_args, mask, reader, dtype, make_vocab_size_divisible_by, tp)
        mask_init = None
        if mask.added:
            mask_init = MaskRowInit(mask.mask_token_id, min(mask.tokenizer_len, source_args.vocab_size))

        with atomic_output_dir(output_dir, inputs=[input_dir], overwrite=overwrite) as staging:
            rank_args = (args.to_dict(), str(input_dir), str(staging), tp, pp, ep, mask_init)
            if tp * pp * ep == 1:
                write_rank(*rank_args)
            else:
                run_distributed(write_rank, tp * pp * ep, *rank_args, timeout_s=timeout_s)
            copy_tokenizer_files(staged_tokenizer, staging)
            save_model_args(args, staging)
            if (input_dir / GENERATION_CONFIG).is_file():
                shutil.copyfile(input_dir / GENERATION_CONFIG, staging / GENERATION_CONFIG)
    return args


def _check_layout(args: ModelArgs, tp: int, pp: int, ep: int) -> None:
    """The layout the checkpoint is written with must be one Megatron can build."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConversionError(f"--tp, --pp and --ep must be >= 1, got {tp}, {pp} and {ep}")
    if ep > 1 and not args.is_moe:
        raise ConversionError(f"--ep {ep} splits experts, and this {args.architecture} model has none; use --ep 1")
    if args.is_moe and args.num_experts % ep:
        raise ConversionError(
            f"--ep {ep} does not divide num_experts={args.num_experts}; choose an --ep that does (each rank "
            "holds the same number of experts)"
        )
    splits = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads (query groups)": args.num_query_groups,
    }
    if args.is_moe:  # experts are split over TP too (expert TP = TP); the dense size is unused
        splits["moe_intermediate_size"] = args.moe_ffn_hidden_size
    else:
        splits["intermediate_size"] = args.ffn_hidden_size
    for name, value in splits.items():
        if value % tp:
            raise ConversionError(f"--tp {tp} does not divide {name}={value}; choose a --tp that does")
    if args.num_layers % pp:
        raise ConversionError(f"--pp {pp} does not divide the model's {args.num_layers} layers")


def _target_args(
    source: ModelArgs, mask: MaskTokenSetup, reader: HFSafetensorsReader, dtype: str | None,
    divisible_by: int, tp: int,
) -> ModelArgs:
    vocab = source.vocab_size
    if mask.mask_token_id >= vocab:
        vocab = pad_vocab_size(mask.mask_token_id + 1, divisible_by)  # grown for the new token
    if dtype is None:
        stored = reader.dtype("model.embed_tokens.weight")
        dtype = str(stored).removeprefix("torch.")
    return dataclasses.replace(
        source,
        vocab_size=vocab,
        padded_vocab_size=pad_vocab_size(vocab, divisible_by, tp),
        mask_token_id=mask.mask_token_id,
        dtype=dtype,
    )
