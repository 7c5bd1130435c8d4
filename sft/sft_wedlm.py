#!/usr/bin/env python
"""WeDLM supervised fine-tuning on Megatron-Core: prompt tokens are never masked and carry no loss.

    torchrun --nproc_per_node 8 sft/sft_wedlm.py --config configs/sft/qwen3_8b.yaml \\
        model.init_from=/ckpt/wedlm-8b-base data.path=/data/sft_shards

Data: ``tools/prepare_data.py --task sft``. See docs/training.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_wedlm.training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], task="sft"))
