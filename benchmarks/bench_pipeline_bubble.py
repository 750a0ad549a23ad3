"""The pipeline bubble, measured: each schedule at pp=4 with 4, 8 and 16 microbatches.

    python benchmarks/bench_pipeline_bubble.py [--steps 6]

Every run trains the example GPT (8 blocks) with ``Trainer(strategy=Par3DStrategy(pp=4, ...))`` in one pool of 4
gloo processes. On each rank the torch ``PipelineStage`` compute calls (forward, input-gradient backward, weight-
gradient backward) are timed, and so is the whole ``schedule.step``; the idle fraction is
``1 − compute / step`` averaged over ranks and over the steps after the first two. It is printed beside the
textbook value: ``(p−1)/(m+p−1)`` for GPipe and 1F1B, ``(p−1)/(v·m+p−1)`` for looped and interleaved schedules
(``v`` stages per rank); zero-bubble schedules have no simple closed form and show "—".

Activation memory is measured too: every tensor autograd saves for backward (parameters excluded) is counted from
the moment it is saved until autograd frees it, and the peak of the live total per rank is reported with the peak
number of microbatches in flight (forwards done minus backwards done). GPipe holds all ``m`` microbatches at once;
1F1B at most ``p``.

On a 2-core CPU machine four ranks share two cores, so compute stretches while a rank waits for the CPU as well as
for its neighbours: the measured bubble is an upper bound there. Run it on 4 GPUs for clean figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule

PP = 4
MODEL = dict(block_size=64, n_layer=8, n_head=4, n_embd=128)
BATCH = 16  # per data-parallel rank (there is one): divisible by 4, 8 and 16 microbatches
RUNS = [  # (schedule, stages per rank)
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2),
    ("zbv_zero_bubble", 2),
]


def theory(schedule: str, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (PP - 1) / (m + PP - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (PP - 1) / (v * m + PP - 1)
    return None


class BubbleProbe(L.Callback):
    """Times the stage compute calls and each schedule step; tracks live saved activations and microbatches in
    flight."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.idle: list[float] = []
        self.compute = 0.0
        self.live = self.peak = 0
        self.inflight = self.peak_inflight = 0
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        runner = trainer.strategy.engine.pipeline
        schedule = runner.schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, +1)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, -1)
            if hasattr(stage, "backward_weight_one_chunk"):
                stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, 0)
        step, evaluate = schedule.step, schedule.eval

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return evaluate(*args, **kwargs)
            self.compute = 0.0
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                t0 = time.perf_counter()
                out = step(*args, **kwargs)
                wall = time.perf_counter() - t0
            self.steps += 1
            if self.steps > self.warmup:
                self.idle.append(1.0 - self.compute / wall)
            return out

        schedule.step = timed_step

    def _timed(self, fn: Any, inflight_delta: int) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.compute += time.perf_counter() - t0
            self.inflight += inflight_delta
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            return out

        return wrapper

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
            return t
        holder = _Saved(t)
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, nbytes)
        return holder

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


WARMUP = 2
"""Steps per run not measured (the first allocates, and infers the stages' shapes)."""


def bubble_run(schedule: str, microbatches: int, virtual: int, steps: int) -> dict[str, float]:
    import torch.distributed as dist

    from benchmarks.bench_strategies import quiet_trainer
    from lightning_par3d import Par3DStrategy

    L.seed_everything(0, verbose=False)
    probe = BubbleProbe(warmup=WARMUP)
    strategy = Par3DStrategy(pp=PP, pipeline_schedule=schedule, microbatches=microbatches, virtual_stages=virtual)
    trainer = quiet_trainer(strategy, PP, steps, probe, accelerator="cpu")
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=BATCH, max_bytes=100_000)
    trainer.fit(GPTModule(**MODEL), data)
    mine = torch.tensor([statistics.mean(probe.idle), probe.peak / 2**20, probe.peak_inflight], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone)
    return {
        "idle": table[:, 0].mean().item(),
        "idle_max": table[:, 0].max().item(),
        "peak_mib": table[:, 1].max().item(),
        "inflight": table[:, 2].max().item(),
    }


def main() -> None:
    from lightning_par3d import Par3DConfig, resolve_layout
    from tests.harness import DistPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help=f"steps per run, the first {WARMUP} not measured")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: the first {WARMUP} steps are not measured; give at least {WARMUP + 1}.")
    pool = DistPool(PP)
    rows = []
    try:
        for schedule, v in RUNS:
            for m in args.microbatches:
                try:
                    resolve_layout(Par3DConfig(pp=PP, pipeline_schedule=schedule, microbatches=m, virtual_stages=v))
                except ValueError as e:
                    print(f"{schedule:24s} v={v} m={m:2d}  not run: {str(e).splitlines()[-1].strip()}")
                    continue
                got = pool.run(bubble_run, timeout=900, schedule=schedule, microbatches=m, virtual=v, steps=args.steps)
                rows.append((schedule, v, m, got[0]))
                print(f"{schedule:24s} v={v} m={m:2d}  idle {got[0]['idle']:.3f}", flush=True)
    finally:
        pool.close()
    print(
        f"\npp={PP} on {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, GPT {MODEL}, "
        f"batch {BATCH}; idle = mean over ranks of 1 − compute/step\n"
    )
    print("| schedule | v | m | idle (measured) | idle (max rank) | theory | peak activations (MiB) | in flight |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, v, m, r in rows:
        t = theory(schedule, m, v)
        expected = f"{t:.3f}" if t is not None else "—"
        print(
            f"| {schedule} | {v} | {m} | {r['idle']:.3f} | {r['idle_max']:.3f} | {expected} | "
            f"{r['peak_mib']:.1f} | {r['inflight']:.0f} |"
        )


if __name__ == "__main__":
    main()
