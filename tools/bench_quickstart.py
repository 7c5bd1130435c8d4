#!/usr/bin/env python
"""Run the full quickstart (optionally twice, to check same seed -> same numbers) and print its targets.

    python tools/bench_quickstart.py [--preset full] [--seed 0] [--out DIR] [--repeat]

The quickstart itself measures and judges every target (see ``megatron_wedlm/quickstart/summary.py``);
this script runs it as a user would, and prints the targets, per-stage wall and CPU seconds and
the machine's load, because a shared machine makes wall-clock numbers pessimistic. With
``--repeat`` a second run (same seed, another directory) is compared with the first through
``--compare-with``: its "same seed, same numbers" target is then checked, not just reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
        raise SystemExit(f"quickstart failed with exit status {code}; see {out}/logs")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="full", choices=("full", "ci"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_quickstart_out", help="run directory (a second run adds -repeat)")
    p.add_argument("--repeat", action="store_true", help="run twice and check same seed -> same numbers")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    first = run_once(out, args.preset, args.seed, None)
    if args.repeat:
        second = run_once(out.with_name(out.name + "-repeat"), args.preset, args.seed, out / "report.json")
        same = first["quickstart"]["fingerprint"] == second["quickstart"]["fingerprint"]
        print(f"\nsame seed, same numbers: {'yes' if same else 'NO'} "
              f"({first['quickstart']['fingerprint']} vs {second['quickstart']['fingerprint']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
