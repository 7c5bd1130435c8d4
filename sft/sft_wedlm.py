#!/usr/bin/env python
"""WeDLM supervised fine-tuning: prompt tokens are never masked and carry no loss.

    torchrun --nproc_per_node 8 sft/sft_wedlm.py --config configs/sft/qwen3_8b.yaml \\
        model.init_from=/ckpt/wedlm-8b-base data.path=/data/sft_shards

Megatron-Core by default; ``trainer.backend=deepspeed`` (on the command line or in the YAML)
fine-tunes a HF checkpoint under DeepSpeed ZeRO instead (``megatron_wedlm.deepspeed_backend``).
Data: ``tools/prepare_data.py --task sft``. See docs/training.md.
"""

import sys

from megatron_wedlm.deepspeed_backend.cli import DEEPSPEED
from megatron_wedlm.training.cli import MEGATRON, run_entry_point


def run(argv: list[str]) -> int:
    return run_entry_point(argv, "sft", {**MEGATRON, **DEEPSPEED})


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
