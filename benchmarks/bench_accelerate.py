"""par3d's Accelerate loop against Accelerate's own path at the same layout: median step times and ratios.

    python benchmarks/bench_accelerate.py [--rounds 5] [--steps 30]

One pool of 4 gloo processes (one process tree), the same GPT, global batch, data and AdamW for every run. Each
round runs every pair back to back, alternating which goes first; each configuration first runs once unmeasured,
and each run drops its warm-up steps. A step's time is the slowest rank's; the table gives the median over all
kept steps of all rounds, and the ratio par3d / peer (target: ≤ 1.05).

Pairs on CPU:
  * dp=4 replicated: ``Par3DAccelerator(par3d=Par3DConfig(dp_replicate=4))`` against a plain ``Accelerator``
    (Accelerate's DDP);
  * dp2×tp2, the front-end's own cost: the same loop through ``Par3DAccelerator`` against Lightning Fabric with
    ``Par3DFabricStrategy`` at the same layout (one engine behind both).

Accelerate's native FSDP2 and tensor parallelism (``ParallelismConfig``, ``fsdp_plugin``) are refused on CPU by
Accelerate itself ("ParallelismConfig is only compatible with DistributedType.FSDP ... or Multi{Device}"), and its
tensor parallelism needs a transformers model loaded with ``from_pretrained(tp_plan=...)``: those comparisons need
4 GPUs and are not in this script yet.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader

from examples.data import ShakespeareDataModule
from examples.fabric_train import gpt_loss
from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig

MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 16
WORLD = 4
PAIRS = [
    ("par3d-accelerate dp_replicate=4", "accelerate DDP dp=4"),
    ("par3d-accelerate dp2×tp2", "par3d-fabric dp2×tp2"),
]


def _loader(batch_size: int) -> DataLoader:
    data = ShakespeareDataModule(block_size=MODEL["block_size"], max_bytes=200_000, val_fraction=0.0)
    data.setup()
    return DataLoader(data.train_set, batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def _accelerator(name: str) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_par3d import Par3DConfig
    from lightning_par3d.accelerate import Par3DAccelerator

    AcceleratorState._reset_state(True)  # one Accelerator per run in the long-lived pool workers
    GradientState._reset_state()
    if name == "accelerate DDP dp=4":
        return Accelerator(cpu=not torch.cuda.is_available())
    layout = dict(dp_replicate=4, dp_shard=1) if "dp_replicate=4" in name else dict(dp_shard=2, tp=2)
    return Par3DAccelerator(par3d=Par3DConfig(tp_plan=GPT_TP_PLAN, **layout))


def timed_run(name: str, steps: int, warmup: int) -> list[float]:
    """One training loop in a pool worker; each kept step's time, the max over ranks."""
    import torch.distributed as dist

    torch.manual_seed(0)
    times: list[float] = []
    if name.startswith("par3d-fabric"):
        step, loader = _fabric_loop()
    else:
        step, loader = _accelerate_loop(name)
    for x, y in itertools.islice(loader, steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    local = torch.tensor(times[warmup:])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def _accelerate_loop(name: str) -> tuple[Any, Any]:
    accelerator = _accelerator(name)
    native = not hasattr(accelerator, "engine")
    if native:
        model = GPT(GPTConfig(**MODEL))
    else:
        with accelerator.init_empty_weights():
            model = GPT(GPTConfig(**MODEL))
    dp = accelerator.num_processes if native else accelerator.dp_size
    optimizer = _optimizer(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(GLOBAL_BATCH // dp))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if native:
            accelerator.backward(gpt_loss(model(x), y))
        else:
            accelerator.train_step(model, x, y, gpt_loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, loader


def _fabric_loop() -> tuple[Any, Any]:
    import lightning as L

    from lightning_par3d import Par3DFabricStrategy

    fabric = L.Fabric(
        accelerator="cpu", devices=WORLD, strategy=Par3DFabricStrategy(dp_shard=2, tp=2, tp_plan=GPT_TP_PLAN)
    )
    fabric.launch()
    with fabric.init_module():
        model = GPT(GPTConfig(**MODEL))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(_optimizer(model.parameters()))
    engine = fabric.strategy.engine
    loader = itertools.islice(_loader(GLOBAL_BATCH // engine.dp_size), engine.dp_rank, None, engine.dp_size)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        fabric.strategy.train_step(model, x, y, gpt_loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, loader


def main() -> None:
    from tests.harness import DistPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    times: dict[str, list[float]] = {name: [] for pair in PAIRS for name in pair}
    pool = DistPool(WORLD)
    try:
        for name in times:  # one discarded run each: first-run costs hit no measurement
            pool.run(timed_run, timeout=900, name=name, steps=args.warmup + 1, warmup=args.warmup)
        for r in range(args.rounds):
            for a, b in PAIRS:
                for name in (a, b) if r % 2 == 0 else (b, a):
                    got = pool.run(timed_run, timeout=900, name=name, steps=args.steps, warmup=args.warmup)[0]
                    times[name].extend(got)
                    print(f"round {r + 1}/{args.rounds}  {name:32s} median {statistics.median(got) * 1e3:7.1f} ms")
    finally:
        pool.close()

    machine = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}"
    print(f"\n{WORLD} CPU ranks on {machine}; GPT {MODEL}, global batch {GLOBAL_BATCH}; ")
    print(f"{args.rounds} rounds × {args.steps - args.warmup} kept steps per run\n")
    print("| par3d | ms/step | peer | ms/step | par3d / peer |")
    print("|---|---:|---|---:|---:|")
    for a, b in PAIRS:
        ma, mb = statistics.median(times[a]) * 1e3, statistics.median(times[b]) * 1e3
        print(f"| {a} | {ma:.1f} | {b} | {mb:.1f} | {ma / mb:.3f} |")


if __name__ == "__main__":
    main()
