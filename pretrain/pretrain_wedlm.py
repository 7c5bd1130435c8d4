#!/usr/bin/env python
"""WeDLM continued pretraining (or AR pretraining with wedlm.enabled=false) on Megatron-Core.

    torchrun --nproc_per_node 2 pretrain/pretrain_wedlm.py --config configs/pretrain/tiny_cpu.yaml
    torchrun --nnodes 4 --nproc_per_node 8 ... pretrain/pretrain_wedlm.py \\
        --config configs/pretrain/qwen3_8b.yaml --resume auto data.path=/data/shards

See docs/training.md.
"""

import sys

from megatron_wedlm.training.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], task="pretrain"))
