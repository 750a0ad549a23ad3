"""How long ``par3d plan`` takes on real-sized models, launched as a user launches it.

    python benchmarks/bench_plan_scale.py [--cases 1.5b,8b,70b] [--rounds 1] [--save FILE.json]

Each case is a transformers Llama built from its config by ``examples/hf_llama.py`` (never materialised: the
planner builds it on fake and meta tensors), planned with every layout of its world on the ``h100-sxm-8`` profile in
bf16-mixed, by the ``par3d plan`` console script in its own interpreter, as from a shell; the time is the command's
wall time (interpreter start and imports included), the median over ``--rounds``:

| case | shape (hidden, layers, heads / key-value, MLP, vocabulary) | world | batch × sequence | goal |
|---|---|---:|---|---:|
| ``1.5b`` | 1,536, 28, 12 / 2, 8,960, 151,936 | 8 | 64 × 2,048 | 20 s |
| ``8b`` | Llama-3-8B: 4,096, 32, 32 / 8, 14,336, 128,256 | 64 | 512 × 8,192 | 60 s |
| ``70b`` | Llama-3-70B: 8,192, 80, 64 / 8, 28,672, 128,256 | 512 | 1,024 × 8,192 | 120 s |
| ``tiny`` | 256, 4, 4 / 2, 512, 1,000 (the suite's short run) | 8 | 16 × 256 | — |

It prints each plan's first lines (the model, its best layouts), then one row per case: the layouts ranked, the
memory estimator's runs, the time and whether the goal is met. ``--save`` writes the rows and every plan's output.
The goals are the 2-core development machine's (docs/benchmarks.md); a plan is one process, one core.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int) -> dict[str, int]:
    """``examples/hf_llama.py``'s arguments for a Llama of this shape."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=mlp, vocab_size=vocab)  # fmt: skip


CASES: dict[str, dict[str, Any]] = {
    "1.5b": {"model": _llama(1536, 28, 12, 2, 8960, 151936), "world": 8, "batch": 64, "seq": 2048, "goal": 20.0},
    "8b": {"model": _llama(4096, 32, 32, 8, 14336, 128256), "world": 64, "batch": 512, "seq": 8192, "goal": 60.0},
    "70b": {"model": _llama(8192, 80, 64, 8, 28672, 128256), "world": 512, "batch": 1024, "seq": 8192, "goal": 120.0},
    "tiny": {"model": _llama(256, 4, 4, 2, 512, 1000), "world": 8, "batch": 16, "seq": 256, "goal": None},
}


def command(case: dict[str, Any]) -> list[str]:
    """The ``par3d plan`` command line of ``case``: the console script beside this interpreter."""
    script = Path(sys.executable).with_name("par3d")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_par3d.tools.cli"]
    model = [arg for key, value in case["model"].items() for arg in ("--model-arg", f"{key}={value}")]
    return [
        *launcher, "plan", "--module", "examples.hf_llama:CausalLMModule", *model,
        "--model-arg", f"block_size={case['seq']}", "--world-size", str(case["world"]), "--devices-per-node", "8",
        "--profile", "h100-sxm-8", "--batch", str(case["batch"]), "--seq", str(case["seq"]),
        "--precision", "bf16-mixed",
    ]  # fmt: skip


def plan_once(case: dict[str, Any]) -> tuple[float, str]:
    """One ``par3d plan`` of ``case`` from the repository's root (``--module examples...`` found there, as from a
    user's shell): its wall time and what it printed (raises where it failed)."""
    start = time.perf_counter()
    done = subprocess.run(command(case), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"par3d plan failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return took, done.stdout


def summary(output: str) -> dict[str, Any]:
    """The plan's counts and choice, read from what it printed."""
    found = re.search(r"\((\d+) estimator runs for (\d+) layouts\.\)", output)
    fitting = re.search(r"Layouts that fit \(([\d,]+)\)", output)
    best = re.search(r"^best: .*# (.+)$", output, re.MULTILINE)
    return {
        "estimator_runs": int(found.group(1)) if found else None,
        "layouts": int(found.group(2)) if found else None,
        "fitting": int(fitting.group(1).replace(",", "")) if fitting else None,
        "best": best.group(1).strip() if best else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1.5b,8b,70b", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names or args.rounds < 1:
        parser.error(f"--cases {args.cases!r}: give some of {', '.join(CASES)}; --rounds 1 or more.")
    rows = []
    for name in names:
        case = CASES[name]
        times, output = [], ""
        for _ in range(args.rounds):
            took, output = plan_once(case)
            times.append(took)
        head = [line for line in output.splitlines() if line.strip()][:12]
        print(f"--- {name}: par3d plan ... --world-size {case['world']} (first lines)\n" + "\n".join(head), flush=True)
        median = statistics.median(times)
        goal = case["goal"]
        met = None if goal is None else median <= goal
        rows.append({"case": name, **summary(output), "times_s": times, "median_s": median, "goal_s": goal,
                     "met": met, "world": case["world"], "output": output})  # fmt: skip
    print("\n| case | world | layouts | fitting | estimator runs | time (s) | goal (s) | met | best |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        goal = "—" if row["goal_s"] is None else f"{row['goal_s']:.0f}"
        met = "—" if row["met"] is None else ("yes" if row["met"] else "no")
        print(
            f"| {row['case']} | {row['world']} | {row['layouts']:,} | {row['fitting']:,} | {row['estimator_runs']} | "
            f"{row['median_s']:.1f} | {goal} | {met} | {row['best']} |"
        )
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
