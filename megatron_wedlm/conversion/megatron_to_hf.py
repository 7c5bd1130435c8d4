"""Megatron ``torch_dist`` checkpoint -> HF directory that ``AutoModelForCausalLM`` loads.

Reads one layer at a time and writes shard by shard (memory: about one shard plus one tensor),
into a temporary sibling renamed into place at the end, so a failed export leaves an earlier one.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from megatron_wedlm.model.hf_config import ModelArgs, find_model_args_file, hf_config_from_model_args, load_model_args
from megatron_wedlm.runtime.atomic_output import atomic_output_dir, check_output_dir
from megatron_wedlm.runtime.hf_local import has_token_id, load_tokenizer

from .hf_checkpoint import ConversionError, ShardedSafetensorsWriter, parse_size
from .mapping import EMBEDDING, FINAL_NORM, OUTPUT_LAYER, experts_of, layer_rules, to_hf, zero_hf_tensors
from .megatron_checkpoint import MegatronCheckpointReader, check_torch_dist_dir, megatron_process_group
from .tokenizer_files import copy_tokenizer_files, tokenizer_files_in

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = "2GB"


def convert_megatron_to_hf(
    input_dir: str | Path,
    output_dir: str | Path,
    *,
    model_args: str | Path | ModelArgs | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
    require_mask_token: bool = True,
    overwrite: bool = False,
) -> list[Path]:
    """Export and return the safetensors files written; ``model_args`` defaults to the
    ``wedlm_model.json`` in ``input_dir`` or its parents, ``tokenizer_dir`` to that file's
    directory.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    check_torch_dist_dir(input_dir)
    check_output_dir(output_dir, [input_dir], overwrite)
    args, args_dir, args_file = _resolve_model_args(input_dir, model_args)
    if dtype is not None:
        args = dataclasses.replace(args, dtype=dtype)
    if require_mask_token and args.mask_token_id is None:
        raise ConversionError(
            "the model description has no mask_token_id, so the export would not be a usable WeDLM checkpoint; "
            "convert the AR model with hf-to-megatron (which adds a mask token) or pass --allow-no-mask-token"
        )
    tokenizer_src = Path(tokenizer_dir) if tokenizer_dir is not None else args_dir
    if tokenizer_src is None or not tokenizer_files_in(tokenizer_src):
        raise ConversionError(
            f"no tokenizer files in {tokenizer_src}; pass --tokenizer DIR with the tokenizer the model was trained with"
        )
    _check_mask_in_tokenizer(tokenizer_src, args)
    inputs = [input_dir, args_file, *tokenizer_files_in(tokenizer_src)]

    with megatron_process_group(1, 1):
        reader = MegatronCheckpointReader(input_dir, args)  # reads the checkpoint's metadata
        with atomic_output_dir(output_dir, inputs=inputs, overwrite=overwrite) as staging:
            writer = ShardedSafetensorsWriter(staging, parse_size(max_shard_size))

            def put(rule, layer, expert=None):
                tensors = to_hf(rule, reader.read(rule, layer, expert), args)
                for name, tensor in zip(rule.hf_names(layer, expert), tensors):
                    writer.add(name, tensor.to(args.torch_dtype))

            put(EMBEDDING, None)
            for layer in range(args.num_layers):
                for rule in layer_rules(args):
                    for expert in experts_of(rule, args):
                        put(rule, layer, expert)
                for name, shape in zero_hf_tensors(args, layer).items():
                    writer.add(name, torch.zeros(shape, dtype=args.torch_dtype))
            put(FINAL_NORM, None)
            if not args.tie_word_embeddings:
                put(OUTPUT_LAYER, None)
            files = writer.close()

            config = hf_config_from_model_args(args)
            config.save_pretrained(str(staging))
            _write_generation_config(config, [input_dir, args_dir], staging)
            copy_tokenizer_files(tokenizer_src, staging)
    return [output_dir / file.name for file in files]


def _resolve_model_args(input_dir: Path, model_args) -> tuple[ModelArgs, Path | None, Path | None]:
    """The model description, the directory it came from and its file (None for ModelArgs given)."""
    if isinstance(model_args, ModelArgs):
        return model_args, None, None
    if model_args is not None:
        path = Path(model_args)
        file = path if path.is_file() else find_model_args_file(path)
        return load_model_args(path), (path if path.is_dir() else path.parent), file
    found = find_model_args_file(input_dir)
    if found is None:
        raise ConversionError(
            f"no wedlm_model.json in {input_dir} or its parents; pass --model-args PATH (written by hf-to-megatron)"
        )
    return load_model_args(found), found.parent, found


def _check_mask_in_tokenizer(tokenizer_dir: Path, args: ModelArgs) -> None:
    if args.mask_token_id is None:
        return
    tokenizer = load_tokenizer(tokenizer_dir)
    if not has_token_id(tokenizer, args.mask_token_id):
        raise ConversionError(
            f"mask_token_id={args.mask_token_id} is not a token of the tokenizer in {tokenizer_dir} "
            f"({len(tokenizer)} tokens); pass the tokenizer the model was trained with (--tokenizer)"
        )


def _write_generation_config(config, search: list[Path | None], output_dir: Path) -> None:
    for directory in search:
        if directory is not None and (directory / GENERATION_CONFIG).is_file():
            shutil.copyfile(directory / GENERATION_CONFIG, output_dir / GENERATION_CONFIG)
            return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(str(output_dir))
