"""What watching costs: training throughput with MemoryStats on every step and BottleneckReport sampling 3 steps,
against the same run with no callbacks.

    python benchmarks/bench_callbacks.py [--rounds 4] [--steps 300] [--log-every 50]

One pool of 4 gloo processes trains the GPT (4 layers, 128 wide) at dp_shard=2 × tp=2, alternating the two
configurations in every round (which goes first swaps each round). A run's throughput is its steps divided by the
time from ``on_train_start`` to ``on_train_end`` (the slowest rank's); the reports are written after that, at the end
of fit, and the memory estimate runs then too, so what is timed is what training pays. MemoryStats measures every
step and logs at the Trainer's ``log_every_n_steps`` (50); ``--log-every 1`` logs every step.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule

MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 16
WORLD = 4


class TrainTimer(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def throughput_run(observe: bool, steps: int, log_every: int = 50, end_of_fit: bool = True) -> float:
    """Steps per second of one run (the slowest rank's time), with or without the callbacks (``end_of_fit``:
    MemoryStats' estimate and the report's advice, at the end of fit, outside the timed window)."""
    import torch.distributed as dist

    from benchmarks.bench_strategies import quiet_trainer
    from lightning_par3d import Par3DStrategy
    from lightning_par3d.callbacks import BottleneckReport, MemoryStats

    L.seed_everything(0, verbose=False)
    timer = TrainTimer()
    callbacks: list[L.Callback] = [timer]
    if observe:
        out = tempfile.mkdtemp(prefix="par3d-bench-callbacks-")
        callbacks += [
            MemoryStats(dirpath=out, log_every_n_steps=log_every, estimate=end_of_fit, verbose=False),
            BottleneckReport(skip_first=5, steps=3, dirpath=out, verbose=False, advise=end_of_fit),
        ]
    trainer = quiet_trainer(Par3DStrategy(dp_shard=2, tp=2), WORLD, steps, callbacks, accelerator="cpu")
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // 2, max_bytes=200_000)
    trainer.fit(GPTModule(**MODEL), data)
    seconds = torch.tensor(timer.seconds)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return steps / seconds.item()


def main() -> None:
    from tests.harness import DistPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()
    rates: dict[bool, list[float]] = {False: [], True: []}
    paired: list[float] = []
    pool = DistPool(WORLD)
    try:
        for observe in (False, True):  # unmeasured: first-run costs
            pool.run(throughput_run, timeout=900, observe=observe, steps=8)
        for r in range(args.rounds):
            for observe in (False, True) if r % 2 == 0 else (True, False):
                rate = pool.run(
                    throughput_run, timeout=1800, observe=observe, steps=args.steps, log_every=args.log_every
                )[0]
                rates[observe].append(rate)
                label = "with callbacks" if observe else "no callbacks  "
                print(f"round {r + 1}/{args.rounds}  {label} {rate:.3f} steps/s", flush=True)
            paired.append(rates[True][-1] / rates[False][-1])  # the round's two runs, back to back
    finally:
        pool.close()
    plain, observed = statistics.median(rates[False]), statistics.median(rates[True])
    machine = f"{os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, {WORLD} gloo ranks"
    print(f"\nGPT {MODEL}, dp_shard=2 × tp=2, global batch {GLOBAL_BATCH}; {machine}")
    print(f"{args.rounds} rounds × {args.steps} steps per run\n")
    print("| run | steps/s (median) | vs no callbacks |")
    print("|---|---:|---:|")
    print(f"| no callbacks | {plain:.3f} | 1.000 |")
    label = f"MemoryStats (logging every {args.log_every}) + BottleneckReport (3 steps)"
    print(f"| {label} | {observed:.3f} | {observed / plain:.3f} |")
    print(f"\nthroughput change, medians: {(observed / plain - 1) * 100:+.1f} %")
    rounds = ", ".join(f"{(p - 1) * 100:+.1f} %" for p in paired)
    print(f"per round (with / without, back to back): {rounds}; median {(statistics.median(paired) - 1) * 100:+.1f} %")


if __name__ == "__main__":
    main()
