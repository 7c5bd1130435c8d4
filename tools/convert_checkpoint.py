#!/usr/bin/env python
"""Convert checkpoints between HF (Qwen2 / Qwen3 / Llama / Qwen3-MoE) and Megatron-Core torch_dist.

    python tools/convert_checkpoint.py hf-to-megatron --input HF_DIR --output DIR [--tp T --pp P --ep E]
    python tools/convert_checkpoint.py megatron-to-hf --input DIR --output HF_DIR
    python tools/convert_checkpoint.py gguf-to-hf --input MODEL.gguf --output HF_DIR

hf-to-megatron writes a torch_dist checkpoint that loads under any TP/PP/EP (--tp/--pp/--ep only
choose the layout it is written with, using T x P x E local processes; --ep splits a MoE model's
experts), plus wedlm_model.json (what the training entry points build: point ``model.init_from``
at DIR) and the tokenizer, with a mask token added if it had none. megatron-to-hf also accepts one
iteration directory of a training run (any TP/PP/CP it was saved with), or the run directory
for its newest complete checkpoint; wedlm_model.json is looked up there and in its two parents
(or give --model-args), and the tokenizer next to it: a training checkpoint holds both, so
--tokenizer is needed only for a checkpoint saved without one.

gguf-to-hf dequantizes a llama.cpp GGUF file (needs ``pip install gguf``) into an HF directory
that hf-to-megatron, the decoder and the evaluation read (megatron_wedlm/conversion/gguf.py).

Inputs are checked before anything is written; the output is written next to --output and
renamed into place at the end, so a failed run leaves an earlier output as it was, and an
output that is (or holds, or lies inside) an input is refused.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    to_mcore = sub.add_parser("hf-to-megatron", help="HF safetensors directory -> Megatron torch_dist")
    to_mcore.add_argument("--input", required=True, help="HF model directory (config.json, *.safetensors, tokenizer)")
    to_mcore.add_argument("--output", required=True, help="directory for the torch_dist checkpoint")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write with (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write with (default 1)")
    to_mcore.add_argument("--ep", type=int, default=1,
                          help="expert-parallel size to write with (MoE models; must divide num_experts; default 1)")
    to_mcore.add_argument("--mask-token", default="<|mask|>", help="mask token to use or add (default <|mask|>)")
    to_mcore.add_argument("--no-add-mask-token", action="store_true",
                          help="fail instead of adding a mask token when the tokenizer has none")
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    to_mcore.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                          help="dtype of the written weights (default: the HF weights' dtype)")
    to_mcore.add_argument("--overwrite", action="store_true",
                          help="replace a non-empty output directory (once the new one is complete)")

    to_hf = sub.add_parser("megatron-to-hf", help="Megatron torch_dist -> HF safetensors directory")
    to_hf.add_argument("--input", required=True,
                       help="torch_dist checkpoint directory: an iter_N of a training run, or the run directory "
                            "for its newest complete checkpoint")
    to_hf.add_argument("--output", required=True, help="HF directory to write")
    to_hf.add_argument("--model-args", help="wedlm_model.json (default: found in --input or its parents)")
    to_hf.add_argument("--tokenizer", help="tokenizer directory (default: next to wedlm_model.json, where training checkpoints hold it)")
    to_hf.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (default 2GB)")
    to_hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="dtype of the exported weights (default: as recorded in wedlm_model.json)")
    to_hf.add_argument("--allow-no-mask-token", action="store_true",
                       help="export even if the model has no mask token (a plain AR checkpoint)")
    to_hf.add_argument("--overwrite", action="store_true",
                       help="replace a non-empty output directory (once the new one is complete)")

    from_gguf = sub.add_parser("gguf-to-hf", help="GGUF file (dequantized by transformers) -> HF safetensors directory")
    from_gguf.add_argument("--input", required=True, help="a .gguf file")
    from_gguf.add_argument("--output", required=True, help="HF directory to write")
    from_gguf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                           help="dtype of the written weights (default: float32, as dequantized)")
    from_gguf.add_argument("--overwrite", action="store_true",
                           help="replace a non-empty output directory (once the new one is complete)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megatron_wedlm.conversion import (
        ConversionError,
        convert_gguf_to_hf,
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )
    from megatron_wedlm.model.hf_config import UnsupportedModelError
    from megatron_wedlm.runtime.atomic_output import DiskFullError, OutputDirError
    from megatron_wedlm.training.hf_export import training_checkpoint

    try:
        if args.command == "hf-to-megatron":
            model = convert_hf_to_megatron(
                args.input, args.output,
                tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                expert_model_parallel_size=args.ep,
                mask_token=args.mask_token, add_mask_token=not args.no_add_mask_token,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                dtype=args.dtype, overwrite=args.overwrite,
            )
            print(
                f"wrote {args.output}: {model.architecture}, {model.num_layers} layers, vocab {model.vocab_size} "
                f"(padded {model.padded_vocab_size}), mask_token_id={model.mask_token_id}, {model.dtype}"
            )
        elif args.command == "gguf-to-hf":
            convert_gguf_to_hf(args.input, args.output, dtype=args.dtype, overwrite=args.overwrite)
            print(f"wrote {args.output} from {args.input}")
        else:
            checkpoint = training_checkpoint(args.input) or args.input  # a run directory: its newest checkpoint
            files = convert_megatron_to_hf(
                checkpoint, args.output, model_args=args.model_args, tokenizer_dir=args.tokenizer,
                max_shard_size=args.max_shard_size, dtype=args.dtype,
                require_mask_token=not args.allow_no_mask_token, overwrite=args.overwrite,
            )
            print(f"wrote {args.output} from {checkpoint}: {len(files)} safetensors file(s)")
    except (ConversionError, UnsupportedModelError, OutputDirError, DiskFullError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
