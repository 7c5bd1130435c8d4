"""Check that a TP / PP / CP / SP / EP layout trains a tiny WeDLM model exactly like a single process.

    python tools/verify_parallel.py --tp 2 --pp 2 [--vpp 2] [--cp 2] [--sp] [--recompute full] [--tied]
    python tools/verify_parallel.py --experts 8 --ep 2 [--tp 2] [--etp 1]     # a tiny Qwen3-MoE

Launches real worker processes (gloo, CPU): one at TP=PP=1 that saves random weights and
runs one training step and a forward-only evaluation (the validation path), then TP x PP x CP
ranks that load the same weights and run the same dual-stream global batch and evaluation. Both build the model with training's own ``build_model_chunks`` and
step it with training's DDP wrapping and forward step (Megatron's pipeline schedule and
finalize_model_grads), so the check covers the code that trains.
Prints JSON with the largest loss and gradient differences; exit status 1 when a difference
exceeds ``--tolerance``. Use it to trust a layout (and this code base's WeDLM pieces in it)
before spending cluster time on it; it checks the math of the layout, not the GPU kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage (interleaved schedule)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (each rank holds 1/CP of every row)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--experts", type=int, default=None, help="a MoE model: experts per layer (top-2 routed)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (needs --experts)")
    p.add_argument("--etp", type=int, default=None, help="tensor-parallel size inside each expert (default: --tp)")
    p.add_argument("--z-loss", type=float, default=None, help="router z-loss weight of the MoE model (default: none)")
    p.add_argument("--recompute", choices=["full", "selective"], default=None, help="activation recomputation")
    p.add_argument("--tied", action="store_true", help="tie input embeddings and output layer")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (a multiple of --pp)")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches in the global batch")
    p.add_argument("--tolerance", type=float, default=1e-5, help="max allowed absolute difference")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = p.parse_args(argv)
    if args.tp < 1 or args.pp < 1 or args.cp < 1:
        p.error("--tp, --pp and --cp must be >= 1")
    if args.sp and args.tp == 1:
        p.error("--sp needs --tp > 1")
    if (args.ep > 1 or args.etp is not None) and args.experts is None:
        p.error("--ep and --etp need --experts")
    if args.experts is not None and args.experts % args.ep:
        p.error(f"--ep {args.ep} must divide --experts {args.experts}")
    if args.vpp is not None and (args.vpp < 2 or args.pp < 2):
        p.error("--vpp needs --pp > 1 and at least 2 chunks per stage")
    if args.layers % (args.pp * (args.vpp or 1)):
        p.error(f"--layers {args.layers} must be a multiple of --pp x --vpp = {args.pp} x {args.vpp or 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_wedlm.testing import wedlm_equivalence as we
    from megatron_wedlm.runtime.multiprocess import run_distributed

    args = parse_args(argv)
    spec = we.TinyWeDLMSpec(
        num_layers=args.layers,
        tied_embeddings=args.tied,
        global_microbatches=args.microbatches,
        num_experts=args.experts,
        moe_z_loss_coeff=args.z_loss,
    )
    specs = {"spec": spec.to_dict()}
    name = f"tp{args.tp}-pp{args.pp}" + (f"-vpp{args.vpp}" if args.vpp else "") + f"-cp{args.cp}" + ("-sp" if args.sp else "") + (f"-{args.recompute}" if args.recompute else "") \
        + (f"-moe{args.experts}-ep{args.ep}" + (f"-etp{args.etp}" if args.etp else "") if args.experts else "")
    layout = {
        "name": name, "spec": "spec", "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "cp": args.cp,
        "sp": args.sp, "recompute": args.recompute, "ep": args.ep, "etp": args.etp,
    }
    world_size = args.tp * args.pp * args.cp
    expert_ranks = args.ep * (args.etp or args.tp)
    while world_size % expert_ranks or (world_size // args.pp) % expert_ranks:
        world_size += args.tp * args.pp * args.cp  # more data-parallel replicas, until the experts fit
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wedlm-verify-") as root:
        ref = run_distributed(we.reference_worker, 1, specs, root, timeout_s=args.timeout)[0]["spec"]
        results = run_distributed(we.layouts_worker, world_size, specs, root, [layout], timeout_s=args.timeout)
    got = [r[name] for r in results]
    summaries = [g["summary"] for g in got if g["summary"] is not None]
    grads = got[0]["grads"]
    keys = ["total", "mlm", "ar"] + sorted(k for k in ref["summary"] if k.startswith("moe_"))
    loss_diffs = {key: max(abs(s[key] - ref["summary"][key]) for s in summaries) for key in keys}
    evaluations = [g["eval"] for g in got if g["eval"] is not None]
    eval_diffs = {key: max(abs(e[key] - ref["eval"][key]) for e in evaluations) for key in ("total", "mlm", "ar")}
    grad_diffs = {n: float((grads[n] - ref["grads"][n]).abs().max()) for n in ref["grads"]}
    worst = max(grad_diffs, key=grad_diffs.get)
    report = {
        "layout": layout,
        "world_size": world_size,
        "reference_loss": {k: ref["summary"][k] for k in [*keys, "mlm_tokens", "ar_tokens"]},
        "max_loss_abs_diff": loss_diffs,
        "max_eval_loss_abs_diff": eval_diffs,  # the forward-only evaluation (validation) of another batch
        "eval_kept_grads": all(g["eval_kept_grads"] for g in got),
        "max_grad_abs_diff": grad_diffs[worst],
        "worst_param": worst,
        "max_grad_abs": max(float(g.abs().max()) for g in ref["grads"].values()),
        "num_params": len(grad_diffs),
        "tolerance": args.tolerance,
        "seconds": round(time.perf_counter() - start, 1),
    }
    report["ok"] = max(*loss_diffs.values(), *eval_diffs.values(), report["max_grad_abs_diff"]) <= args.tolerance \
        and report["eval_kept_grads"]
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
