"""par3d against Lightning's own strategies at the same layout: median step times and ratios.

    python benchmarks/bench_strategies.py [--rounds 5] [--steps 30] [--launched-rounds 3]

Two measurements. **As launched** (``--launched-rounds``, the one users see): each run is ``python
benchmarks/bench_strategies.py --launched-run NAME`` with ``Trainer(devices=4)``, and Lightning's own subprocess
launcher starts its 4 ranks, exactly as a user's ``python train.py`` does; nothing in the environment is set for
it (no ``OMP_NUM_THREADS``), so each side gets the threads its own launcher gives. The same pairs alternate which
goes first every round. **Pooled**: all runs share one pool of 4 gloo processes (one process tree), the same GPT,
the same global batch and the same data. The pool sets each rank's threads itself, so it compares the strategies'
own code, not what a user launching them gets (it did not see the thread bug that made par3d's ranks 1–3 use every
core each). Each round runs every pair A/B back to back, swapping which goes first, so that slow drift of the machine
hits both sides alike. Each configuration first runs once, unmeasured (first-run costs such as thread pools and
lazy initialization), and each run drops its warm-up steps. A step's time is the slowest rank's time for that
step; the table gives the median over all kept steps of all rounds, and the ratio par3d / peer (target: ≤ 1.05).

Pairs:
  * dp=2 × tp=2: par3d against ``ModelParallelStrategy`` whose ``configure_model`` applies the same plan by hand;
  * dp=4 sharded: par3d (``dp_shard=4``) against ``FSDPStrategy`` (FULL_SHARD, one unit per block). Lightning's
    FSDPStrategy refuses ``accelerator="cpu"`` ("requires a GPU accelerator"), so on CPU the peer is Lightning's
    other sharded strategy, ``ModelParallelStrategy(data_parallel_size=4)`` with FSDP2 applied by hand;
  * dp=4 replicated: par3d (``dp_replicate=4``) against ``DDPStrategy``.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch

from examples.data import ShakespeareDataModule
from examples.gpt import GPT, Block, GPTModule

MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 16
WORLD = 4


class HandWiredGPT(GPTModule):
    """What a ModelParallelStrategy user writes today: the same TP plan and FSDP2 wrapping, by hand."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.model is not None:
            return
        self.model = GPT(self.gpt_config)
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        plan: dict[str, Any] = {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
        for i in range(len(self.model.transformer.h)):
            plan.update(
                {
                    f"transformer.h.{i}.attn.q_proj": ColwiseParallel(),
                    f"transformer.h.{i}.attn.k_proj": ColwiseParallel(),
                    f"transformer.h.{i}.attn.v_proj": ColwiseParallel(),
                    f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                    f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                    f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
                }
            )
        if tp_mesh.size() > 1:
            parallelize_module(self.model, tp_mesh, plan)
        for block in self.model.transformer.h.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def make_strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_par3d import Par3DStrategy

    if name == "par3d dp2×tp2":
        return Par3DStrategy(dp_shard=2, tp=2)
    if name == "ModelParallel dp2×tp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    if name == "par3d dp_shard=4":
        return Par3DStrategy(dp_shard=4)
    if name == "FSDP dp=4":
        return FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    if name == "ModelParallel dp=4":
        return ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    if name == "par3d dp_replicate=4":
        return Par3DStrategy(dp_replicate=4, dp_shard=1)
    if name == "DDP dp=4":
        return DDPStrategy()
    raise ValueError(name)


def quiet_trainer(
    strategy: Any, devices: int, steps: int, callback: L.Callback | list[L.Callback], accelerator: str
) -> L.Trainer:
    """A Trainer that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=callback if isinstance(callback, list) else [callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


def timed_run(name: str, steps: int, warmup: int) -> list[float]:
    """One training run in a pool worker; returns each kept step's time, the max over ranks."""
    import torch.distributed as dist

    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = quiet_trainer(make_strategy(name), WORLD, steps, timer, ACCELERATOR)
    module_cls = HandWiredGPT if name.startswith("ModelParallel") else GPTModule
    dp = 2 if "tp2" in name else WORLD
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, max_bytes=200_000)
    trainer.fit(module_cls(**MODEL), data)
    local = torch.tensor(timer.times[warmup:])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


ACCELERATOR = "gpu" if torch.cuda.device_count() >= WORLD else "cpu"
PAIRS = [
    ("par3d dp2×tp2", "ModelParallel dp2×tp2"),
    ("par3d dp_shard=4", "FSDP dp=4" if ACCELERATOR == "gpu" else "ModelParallel dp=4"),
    ("par3d dp_replicate=4", "DDP dp=4"),
]


def launched_run(name: str, steps: int, warmup: int, out: str) -> None:
    """Inside a job Lightning's launcher started (every rank runs this): :func:`timed_run`, and rank 0 writes the
    kept steps' times to ``out``, with the torch threads each rank trained with (what its launcher gave it)."""
    import torch.distributed as dist

    times = timed_run(name, steps, warmup)
    threads: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(threads, torch.get_num_threads())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "threads": threads}))


def launch_once(name: str, steps: int, warmup: int, threads: int | None = None) -> dict[str, Any]:
    """One fresh ``python`` job whose ranks Lightning's launcher starts, as a user launches it: the kept steps' times
    (the slowest rank's) and the torch threads each rank trained with. ``threads`` exports ``OMP_NUM_THREADS`` to
    every rank, as a user who sets it does; None leaves each side's launcher to choose."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        command = [sys.executable, __file__, "--launched-run", name, "--steps", str(steps)]
        command += ["--warmup", str(warmup), "--out", str(out)]
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=1800)
        return dict(json.loads(out.read_text()))


def as_launched(pairs: list[tuple[str, str]], rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Every run a fresh ``python`` job whose ranks Lightning's launcher starts, as a user launches it."""
    times: dict[str, list[float]] = {name: [] for pair in pairs for name in pair}
    for r in range(rounds):
        for a, b in pairs:
            for name in (a, b) if r % 2 == 0 else (b, a):
                got = launch_once(name, steps, warmup)
                times[name].extend(got["times"])
                median, threads = statistics.median(got["times"]) * 1e3, got["threads"]
                print(f"launched {r + 1}/{rounds}  {name:24s} median {median:7.1f} ms  threads by rank {threads}")
    return times


def print_table(title: str, pairs: list[tuple[str, str]], times: dict[str, list[float]]) -> None:
    print(f"\n{title}\n")
    print("| layout | par3d (ms/step) | peer | peer (ms/step) | par3d / peer |")
    print("|---|---:|---|---:|---:|")
    for a, b in pairs:
        ma, mb = statistics.median(times[a]) * 1e3, statistics.median(times[b]) * 1e3
        print(f"| {a.removeprefix('par3d ')} | {ma:.1f} | {b} | {mb:.1f} | {ma / mb:.3f} |")


def main() -> None:
    from tests.harness import DistPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="pooled rounds (0: skip the pooled measurement)")
    parser.add_argument("--launched-rounds", type=int, default=3, help="as-launched rounds (0: skip them)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default=None, help="run only the pairs whose par3d name contains this")
    parser.add_argument("--launched-run", default=None, help=argparse.SUPPRESS)  # one as-launched job (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launched_run is not None:
        launched_run(args.launched_run, args.steps, args.warmup, args.out)
        return

    pairs = [p for p in PAIRS if args.only is None or args.only in p[0]]
    machine = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}"
    setting = f"GPT {MODEL}, global batch {GLOBAL_BATCH}, {args.steps - args.warmup} kept steps per run"
    if args.launched_rounds:
        launched = as_launched(pairs, args.launched_rounds, args.steps, args.warmup)
        title = f"As launched: {WORLD} {ACCELERATOR.upper()} ranks per job on {machine}; {setting}; "
        print_table(title + f"{args.launched_rounds} rounds", pairs, launched)
    if not args.rounds:
        return
    times: dict[str, list[float]] = {name: [] for pair in pairs for name in pair}
    pool = DistPool(WORLD)
    try:
        for a, b in pairs:  # one discarded run each: first-run costs (thread pools, lazy init) hit no measurement
            for name in (a, b):
                pool.run(timed_run, timeout=900, name=name, steps=args.warmup + 1, warmup=args.warmup)
        for r in range(args.rounds):
            for a, b in pairs:
                for name in (a, b) if r % 2 == 0 else (b, a):
                    got = pool.run(timed_run, timeout=900, name=name, steps=args.steps, warmup=args.warmup)[0]
                    times[name].extend(got)
                    print(f"round {r + 1}/{args.rounds}  {name:24s} median {statistics.median(got) * 1e3:7.1f} ms")
    finally:
        pool.close()

    print_table(
        f"Pooled: {WORLD} {ACCELERATOR.upper()} ranks on {machine}; {setting}; {args.rounds} rounds", pairs, times
    )


if __name__ == "__main__":
    main()
