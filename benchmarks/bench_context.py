"""Context parallelism: how long a sequence fits a rank's activation memory at cp = 1, 2, 4, and what a step costs.

    python benchmarks/bench_context.py [--seqs 512,1024,2048,4096] [--budget-mib 64] [--steps 6] [--warmup 2]

The model is transformers' own Llama, unchanged (``examples.hf_llama.CausalLMModule``, random weights, SDPA
attention): hidden 256, 4 layers, 4 query heads over 2 key/value heads, vocabulary 256, fp32 with AdamW. Each job
trains on 4 ranks with one row per data-parallel rank a step, at ``cp`` = 1 (``dp_shard=4``: each rank holds whole
rows), 2 (``dp_shard=2 × cp=2``: each rank half of its rows' tokens) and 4 (``cp=4``), so that a rank's activations
are those of ``seq / cp`` tokens (plus the whole row's keys and values, which context parallelism gathers).

Each cp is one job, ``python benchmarks/bench_context.py --launched-run CP``: ``Trainer(devices=4)``, whose ranks
Lightning's launcher starts, as a user's ``python train.py`` does; it trains at each sequence length in turn, from
the shortest, and stops after the first whose activations exceed the budget. A step's time is the slowest rank's
(the median of the kept steps); activations are the peak bytes a batch saves for backward on the largest rank
(par3d's ``SavedTensorMeter``), and on CUDA the allocator's peak. The table gives every sequence each cp ran, and the
longest that fit the budget per cp.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch

from benchmarks.bench_moe import MemoryProbe
from benchmarks.bench_strategies import StepTimer, quiet_trainer

MODEL = dict(
    architecture="llama",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
WORLD = 4
CPS = (1, 2, 4)
ACCELERATOR = "gpu" if torch.cuda.device_count() >= WORLD else "cpu"


def launched_run(cp: int, seqs: list[int], budget: float, steps: int, warmup: int, out: str) -> None:
    """Inside a job Lightning's launcher started (every rank runs this); rank 0 writes the figures to ``out``."""
    import torch.distributed as dist

    from examples.data import ShakespeareDataModule
    from examples.hf_llama import CausalLMModule
    from lightning_par3d import Par3DStrategy

    rows = []
    for seq in seqs:
        L.seed_everything(0, verbose=False)
        strategy = Par3DStrategy(cp=cp, dp_shard=WORLD // cp)
        timer, probe = StepTimer(), MemoryProbe()
        trainer = quiet_trainer(strategy, WORLD, steps, [timer, probe], ACCELERATOR)
        data = ShakespeareDataModule(block_size=seq, batch_size=1, max_bytes=(steps + 1) * WORLD * (seq + 1))
        if ACCELERATOR == "gpu":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(CausalLMModule(block_size=seq, **MODEL), data)  # type: ignore[arg-type]
        times = torch.tensor(timer.times[warmup:])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        cuda_peak = torch.cuda.max_memory_allocated() if ACCELERATOR == "gpu" else 0
        memory = torch.tensor([probe.activations, probe.state, cuda_peak], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        activations, state, peak = memory.tolist()
        rows.append({"seq": seq, "times": times.tolist(), "activations": activations, "state": state, "cuda": peak})
        if activations > budget:
            break
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def launch_once(cp: int, seqs: list[int], budget: float, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One fresh ``python`` job whose ranks Lightning's launcher starts, with nothing set in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        command = [sys.executable, __file__, "--launched-run", str(cp), "--seqs", ",".join(map(str, seqs))]
        command += ["--budget-mib", str(budget / 2**20), "--steps", str(steps), "--warmup", str(warmup)]
        done = subprocess.run([*command, "--out", str(out)], env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"cp={cp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return list(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="512,1024,2048,4096", help="sequence lengths, shortest first")
    parser.add_argument("--budget-mib", type=float, default=64.0, help="activation memory a rank may use")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cps", default=",".join(map(str, CPS)), help="the context-parallel degrees to run")
    parser.add_argument("--launched-run", type=int, default=None, help=argparse.SUPPRESS)  # one job (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seqs, budget = [int(s) for s in args.seqs.split(",")], args.budget_mib * 2**20
    if args.launched_run is not None:
        launched_run(args.launched_run, seqs, budget, args.steps, args.warmup, args.out)
        return

    cps = [int(c) for c in args.cps.split(",")]
    results = {cp: launch_once(cp, seqs, budget, args.steps, args.warmup) for cp in cps}
    machine = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}"
    print(
        f"\nLlama (hidden 256, 4 layers, 4 heads over 2 kv heads), one row per data-parallel rank; {WORLD} "
        f"{ACCELERATOR.upper()} ranks a job, launched as users launch it, on {machine}; {args.steps - args.warmup} "
        f"kept steps; activation budget {args.budget_mib:g} MiB a rank\n"
    )
    print(
        "| cp | layout | sequence | ms/step | tokens/s | activations MiB/rank | model state MiB/rank | CUDA peak MiB |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for cp in cps:
        for row in results[cp]:
            step = statistics.median(row["times"])
            tokens = (WORLD // cp) * row["seq"] / step
            cuda = f"{row['cuda'] / 2**20:.1f}" if ACCELERATOR == "gpu" else "—"
            print(
                f"| {cp} | dp_shard={WORLD // cp} × cp={cp} | {row['seq']} | {step * 1e3:.1f} | {tokens:,.0f} | "
                f"{row['activations'] / 2**20:.2f} | {row['state'] / 2**20:.2f} | {cuda} |"
            )
    print("\n| cp | longest sequence within the budget |")
    print("|---:|---:|")
    for cp in cps:
        fitting = [row["seq"] for row in results[cp] if row["activations"] <= budget]
        print(f"| {cp} | {max(fitting) if fitting else 'none'} |")


if __name__ == "__main__":
    main()
