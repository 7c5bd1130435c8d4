#!/usr/bin/env python
"""Run the quickstart for several seeds (optionally twice each) and print its figures and targets per seed.

    python tools/bench_quickstart.py [--preset full] [--seeds 0,1,2] [--out DIR] [--repeat]

One seed's numbers say little: the same seed trains a different model on another machine, and a
minutes-trained model is chaotic in its seed. This script runs the quickstart as a user would,
once per seed, one after the other (each in ``DIR/seed-N``), prints each run's targets, per-stage
wall and CPU seconds and the machine's load (a shared machine makes wall-clock numbers
pessimistic), and then one table: every headline figure (``quickstart.figures`` in report.json)
and every target's status per seed, with the min / median / max of each figure over the seeds.
With ``--repeat`` each seed runs a second time (``DIR/seed-N-repeat``), compared with the first
through ``--compare-with``: its "same seed, same numbers" target is then checked, not just
reported, and the table shows the repeat runs.
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

from megatron_wedlm.quickstart.settings import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def run_once(out: Path, preset: str, seed: int, compare_with: Path | None) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "quickstart.py"), "--preset", preset, "--seed", str(seed),
           "--out", str(out)]
    if compare_with is not None:
        cmd += ["--compare-with", str(compare_with)]
    print("$ " + " ".join(cmd), flush=True)
    load_before = os.getloadavg()
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"quickstart (seed {seed}) failed with exit status {code}; see {out}/logs")
    data = json.loads((out / "report.json").read_text())
    print_run(data, wall, load_before, os.getloadavg())
    return data


def print_run(data: dict, wall: float, load_before: tuple, load_after: tuple) -> None:
    q = data["quickstart"]
    print(f"\n=== {q['preset']} preset, seed {q['seed']}: {wall:.0f} s wall for the whole command; "
          f"1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores: above 2 means "
          "other work shared them)")
    cpu = 0.0
    print(f"{'stage':<16}{'wall s':>9}{'CPU s':>9}")
    for s in q["stages"]:
        cpu += s["cpu_seconds"]
        print(f"{s['name']:<16}{s['wall_seconds']:>9.1f}{s['cpu_seconds']:>9.1f}")
    print(f"{'total':<16}{sum(s['wall_seconds'] for s in q['stages']):>9.1f}{cpu:>9.1f}")
    print("\ntargets:")
    for t in q["targets"]:
        print(f"  [{t['status']:^11}] {t['name']}: {t['measured']}")


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def seeds_table(reports: dict[int, dict]) -> str:
    """Figures and target statuses (rows) per seed (columns), then min / median / max of each figure."""
    seeds = list(reports)
    figures = {seed: reports[seed]["quickstart"]["figures"] for seed in seeds}
    targets = {seed: {t["name"]: t["status"] for t in reports[seed]["quickstart"]["targets"]} for seed in seeds}
    names = list(dict.fromkeys(name for seed in seeds for name in figures[seed]))
    width = max(len(n) for n in names + [n for seed in seeds for n in targets[seed]]) + 2
    head = f"{'':<{width}}" + "".join(f"{f'seed {s}':>10}" for s in seeds) + f"{'min':>10}{'median':>10}{'max':>10}"
    lines = [head, "-" * len(head)]
    for name in names:
        values = [figures[seed].get(name) for seed in seeds]
        known = [v for v in values if v is not None]
        summary = (min(known), statistics.median(known), max(known)) if known else (None, None, None)
        lines.append(f"{name:<{width}}" + "".join(f"{_cell(v):>10}" for v in values + list(summary)))
    lines += ["", f"{'target':<{width}}" + "".join(f"{f'seed {s}':>12}" for s in seeds) + f"{'met':>8}"]
    for name in dict.fromkeys(n for seed in seeds for n in targets[seed]):
        statuses = [targets[seed].get(name, "-") for seed in seeds]
        met = f"{statuses.count('met')}/{len(seeds)}"
        lines.append(f"{name:<{width}}" + "".join(f"{s:>12}" for s in statuses) + f"{met:>8}")
    return "\n".join(lines)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs distinct seeds >= 0, got {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full", choices=PRESETS)
    p.add_argument("--seeds", type=_seeds, default=[0], help="comma-separated seeds, run one after the other")
    p.add_argument("--out", default="bench_quickstart_out", help="directory of the runs (one seed-N per seed)")
    p.add_argument("--repeat", action="store_true", help="run each seed twice and check same seed -> same numbers")
    args = p.parse_args(argv)
    root = Path(args.out).resolve()
    reports = {}
    for seed in args.seeds:
        out = root / f"seed-{seed}"
        reports[seed] = run_once(out, args.preset, seed, None)
        if args.repeat:
            second = run_once(root / f"seed-{seed}-repeat", args.preset, seed, out / "report.json")
            first_fp, second_fp = reports[seed]["quickstart"]["fingerprint"], second["quickstart"]["fingerprint"]
            print(f"\nseed {seed}: same seed, same numbers: {'yes' if first_fp == second_fp else 'NO'} "
                  f"({first_fp} vs {second_fp})")
            reports[seed] = second  # its "same seed, same numbers" target is checked, not just reported
    print(f"\n=== {args.preset} preset over seeds {','.join(map(str, args.seeds))} "
          f"({os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})\n" + seeds_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
