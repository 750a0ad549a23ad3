"""Does the bottleneck report's advice make the job faster? Its top suggestion, predicted and then measured.

    python benchmarks/bench_advice.py [--cases demo,dp2_tp2_ac,pp2_m2] [--rounds 1] [--steps 30]

Each case is the Hydra app as a user runs it, ``python examples/train.py ... mode=advise advise.recheck=true``
(Lightning's launcher starts the ranks): a short run of the configured layout, measured by ``BottleneckReport``
(which predicts every change it weighs and suggests those predicted to help), then the same short run with its top
suggestion, then the configured run again, all in the same processes. It prints, per case, the suggestion, its
predicted and measured step, and the noise of the pair of configured runs; then:

* whether each suggestion made improves the measured step beyond that noise (the goal: all of them);
* how far the predicted effect is from the measured one (the goal: within 25 %).

The cases (the GPT of the demo, on this machine's CPU processes):

* ``demo``: the demo's layout, pp=2 × dp_shard=2 × tp=2 (1F1B, 4 microbatches) on 8 ranks;
* ``dp2_tp2_ac``: dp_shard=2 × tp=2 with full activation checkpointing on 4 ranks;
* ``pp2_m2``: pp=2 × dp_shard=2 with 2 microbatches on 4 ranks.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "demo": ["experiment=demo"],
    "dp2_tp2_ac": ["experiment=dp2_tp2", "strategy.activation_checkpointing=full"],
    "pp2_m2": ["strategy.pp=2", "strategy.dp_shard=2", "strategy.microbatches=2", "trainer.devices=4"],
}
LINES = {
    "suggestion": r"par3d advice, checked: (.+)",
    "before": r"measured step, as configured: ([\d,.]+) ms",
    "predicted": r"predicted with the change: +([\d,.]+) ms",
    "after": r"measured with the change: +([\d,.]+) ms",
    "again": r"measured as configured again: ([\d,.]+) ms",
    "none": r"par3d advice: (.+); measured step ([\d,.]+) ms",
}


def run_case(name: str, steps: int) -> dict[str, object]:
    """One ``mode=advise`` run of the case, as a user launches it; what it printed, parsed."""
    with tempfile.TemporaryDirectory(prefix="par3d-bench-advice-") as folder:
        command = [sys.executable, "examples/train.py", *CASES[name], "mode=advise", "advise.recheck=true",
                   f"advise.steps={steps}", f"advise.skip_first={steps // 3}", f"advise.sampled={steps // 2}",
                   "callbacks=none", "logger=none", "+trainer.enable_progress_bar=false",
                   f"hydra.run.dir={folder}"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exited {done.returncode}\n{text[-3000:]}")
    found: dict[str, object] = {}
    for key, pattern in LINES.items():
        match = re.search(pattern, text)
        if match:
            found[key] = (
                match.group(1)
                if key == "suggestion"
                else (match.group(1) if key == "none" else float(match.group(1).replace(",", "")))
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        for r in range(args.rounds):
            got = run_case(name, args.steps)
            print(f"{name} round {r + 1}: {got}", flush=True)
            rows.append((name, got))
    print(f"\n{os.cpu_count()} cores ({platform.machine()}); {args.steps} steps a run, the report sampling "
          f"{args.steps // 2} after {args.steps // 3}\n")  # fmt: skip
    print("| case | suggestion | as configured ms | predicted ms | measured ms | measured effect | predicted effect "
          "| pair noise | improved beyond noise | prediction off by |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    offs = []
    for name, got in rows:
        if "suggestion" not in got:
            print(f"| {name} | none ({got.get('none', '?')}) | | | | | | | — | |")
            continue
        before, predicted, after = float(got["before"]), float(got["predicted"]), float(got["after"])  # type: ignore[arg-type]
        again = float(got.get("again", before))  # type: ignore[arg-type]
        noise = abs(again / before - 1)
        measured_effect, predicted_effect = after / before - 1, predicted / before - 1
        off = abs(predicted - after) / after
        offs.append(off)
        improved = "yes" if measured_effect < -noise else "no"
        print(f"| {name} | {got['suggestion']} | {before:,.1f} | {predicted:,.1f} | {after:,.1f} | "
              f"{measured_effect:+.1%} | {predicted_effect:+.1%} | {noise:.1%} | {improved} | {off:.0%} |")  # fmt: skip
    if offs:
        print(f"\nprediction off by (median): {statistics.median(offs):.0%}")


if __name__ == "__main__":
    main()
