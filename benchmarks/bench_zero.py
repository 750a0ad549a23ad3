"""ZeRO stages side by side: the bytes each rank holds beside the ZeRO formula and the estimator, and step times.

    python benchmarks/bench_zero.py [--dp 2 4 8] [--rounds 3] [--steps 12]

For each data-parallel size, one pool of ``dp`` gloo processes trains the same GPT (global batch 16) at zero_stage
0, 1, 2 and 3, in an order that rotates every round, so that drift of the machine hits every stage alike. Each run
counts, on every rank just before its second optimizer step, the parameters, gradients and optimizer state it
holds (:func:`lightning_par3d.memory.meters.model_state_bytes`: storages, each once, padding included), and times every
step (the slowest rank's time). The table shows dp_shard rank 0 (the one holding the most) beside the ZeRO formula
(:mod:`lightning_par3d.zero.formula`) and beside :func:`lightning_par3d.estimate_memory`, and the median step time
relative to stage 0 at the same dp.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
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
STAGES = (0, 1, 2, 3)


class Probe(L.Callback):
    """Step times, and the model state held before the second optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.state: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        from lightning_par3d.memory.meters import model_state_bytes

        if trainer.global_step == 1:
            self.state = model_state_bytes(pl_module, trainer.optimizers)


def zero_run(stage: int, devices: int, steps: int, warmup: int) -> dict[str, Any]:
    """One run in a pool worker: the slowest rank's kept step times, and this rank's bytes (rank 0's is reported)."""
    import torch.distributed as dist

    from benchmarks.bench_strategies import quiet_trainer
    from lightning_par3d import Par3DStrategy

    L.seed_everything(0, verbose=False)
    probe = Probe()
    trainer = quiet_trainer(Par3DStrategy(zero_stage=stage), devices, steps, probe, accelerator="cpu")
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // devices, max_bytes=200_000)
    module = GPTModule(**MODEL)
    trainer.fit(module, data)
    times = torch.tensor(probe.times[warmup:])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"times": times.tolist(), "state": probe.state, "shapes": [tuple(p.shape) for p in module.parameters()]}


def predicted(stage: int, dp: int, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(formula, estimator) total model-state bytes of dp_shard rank 0."""
    from lightning_par3d import Par3DConfig, estimate_memory
    from lightning_par3d.zero.formula import model_state_formula

    formula = model_state_formula(shapes, stage, dp if stage else 1).total
    batch = (GLOBAL_BATCH // dp, MODEL["block_size"])
    estimate = estimate_memory(GPTModule(**MODEL), Par3DConfig(zero_stage=stage), dp, batch).rows[0].state.total
    return formula, estimate


def bench_dp(dp: int, rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    from tests.harness import DistPool

    times: dict[int, list[float]] = {s: [] for s in STAGES}
    first: dict[int, dict[str, Any]] = {}
    pool = DistPool(dp)
    try:
        for stage in STAGES:  # one unmeasured run each: first-run costs hit no measurement
            first[stage] = pool.run(zero_run, timeout=900, stage=stage, devices=dp, steps=warmup + 2, warmup=warmup)[0]
        for r in range(rounds):
            order = STAGES[r % len(STAGES) :] + STAGES[: r % len(STAGES)]
            for stage in order:
                got = pool.run(zero_run, timeout=900, stage=stage, devices=dp, steps=steps, warmup=warmup)[0]
                times[stage].extend(got["times"])
                print(f"dp={dp} round {r + 1}/{rounds} stage {stage}: {statistics.median(got['times']) * 1e3:.1f} ms")
    finally:
        pool.close()
    rows = []
    for stage in STAGES:
        formula, estimate = predicted(stage, dp, first[stage]["shapes"])
        rows.append(
            {"dp": dp, "stage": stage, "state": first[stage]["state"], "formula": formula, "estimate": estimate}
            | {"ms": statistics.median(times[stage]) * 1e3}
        )
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    rows = [row for dp in args.dp for row in bench_dp(dp, args.rounds, args.steps, args.warmup)]

    machine = f"{os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, gloo"
    print(f"\nGPT {MODEL}, global batch {GLOBAL_BATCH}, AdamW, fp32; {machine}; rank 0 of each run;")
    print(f"{args.rounds} rounds × {args.steps - args.warmup} kept steps per run, stage order rotating\n")
    print(
        "| dp | stage | params (MiB) | grads (MiB) | optimizer (MiB) | total measured | formula | estimator "
        "| measured / formula | step (ms) | step vs stage 0 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {row["dp"]: row["ms"] for row in rows if row["stage"] == 0}
    for row in rows:
        state = row["state"]
        print(
            f"| {row['dp']} | {row['stage']} | {_mib(state.params)} | {_mib(state.grads)} | {_mib(state.optimizer)} "
            f"| {_mib(state.total)} | {_mib(row['formula'])} | {_mib(row['estimate'])} "
            f"| {state.total / row['formula']:.3f} | {row['ms']:.1f} | {row['ms'] / base[row['dp']]:.2f} |"
        )


if __name__ == "__main__":
    main()
