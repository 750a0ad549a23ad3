"""``compile=True`` against eager at the same layout, as launched: step time, compile time and their ratio.

    python benchmarks/bench_compile.py [--rounds 2] [--steps 30] [--warmup 5] [--only dp2xtp2]

Each run is a fresh ``python benchmarks/bench_compile.py --launched-run NAME`` job: ``Trainer(devices=4)`` with
Lightning's own launcher starting the 4 ranks, as a user's ``python train.py`` does, nothing set in the environment.
It trains ``bench_strategies``' GPT (4 blocks of width 128, sequence 64, global batch 16) with par3d at one layout,
eager or ``compile=True`` (torch's default backend, inductor: C++ on CPU, Triton on GPU). Per run: the first
step's time (it includes compiling every block; torch's compile cache is left as a user has it, so a second run
of the same layout finds its kernels cached), and the median of the steps after ``--warmup``, the slowest rank's.
Rounds alternate which of the pair goes first. The table gives, per layout, the median step eager and compiled,
their ratio (below 1: compiling pays), and the first step of each (its excess over the median is the compile cost).

Layouts: dp_shard=4 (ZeRO-3), dp_shard=2 × tp=2, pp=2 × dp_shard=2 (1F1B, 4 microbatches).
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

import torch

from benchmarks.bench_strategies import GLOBAL_BATCH, MODEL, WORLD, quiet_trainer

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard=4": dict(dp_shard=4),
    "dp2xtp2": dict(dp_shard=2, tp=2),
    "pp2xdp2": dict(pp=2, dp_shard=2, microbatches=4),
}
ACCELERATOR = "gpu" if torch.cuda.device_count() >= WORLD else "cpu"


class FirstAndSteps:
    """Each training step's wall time, the first one included (it compiles)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def start(self) -> None:
        if ACCELERATOR == "gpu":
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def end(self) -> None:
        if ACCELERATOR == "gpu":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def timed_run(layout: str, compiled: bool, steps: int) -> list[float]:
    """One run inside a launched job; every step's time, the slowest rank's."""
    import lightning as L
    import torch.distributed as dist

    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy

    clock = FirstAndSteps()

    class Timer(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            clock.start()

        def on_train_batch_end(self, *args: Any) -> None:
            clock.end()

    L.seed_everything(0, verbose=False)
    strategy = Par3DStrategy(compile=compiled, **LAYOUTS[layout])
    trainer = quiet_trainer(strategy, WORLD, steps, Timer(), ACCELERATOR)
    dp = WORLD // (LAYOUTS[layout].get("tp", 1) * LAYOUTS[layout].get("pp", 1))
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, max_bytes=200_000)
    trainer.fit(GPTModule(**MODEL), data)
    local = torch.tensor(clock.times)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def launched_run(layout: str, compiled: bool, steps: int, out: str) -> None:
    import torch.distributed as dist

    times = timed_run(layout, compiled, steps)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))


def launch_once(layout: str, compiled: bool, steps: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        command = [sys.executable, __file__, "--launched-run", layout, "--steps", str(steps), "--out", str(out)]
        command += ["--compiled"] if compiled else []
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=1800)
        return list(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default=None, help="only the layouts whose name contains this")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (the default)")
    parser.add_argument("--launched-run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launched_run is not None:
        launched_run(args.launched_run, args.compiled, args.steps, args.out)
        return
    layouts = [name for name in LAYOUTS if args.only is None or args.only in name]
    asked = set(args.modes.split(","))
    if not asked or asked - {"eager", "compiled"}:
        parser.error(f"--modes {args.modes}: give eager, compiled, or eager,compiled.")
    modes = [mode == "compiled" for mode in ("eager", "compiled") if mode in asked]
    kept: dict[tuple[str, bool], list[float]] = {(n, c): [] for n in layouts for c in (False, True)}
    first: dict[tuple[str, bool], list[float]] = {(n, c): [] for n in layouts for c in (False, True)}
    for r in range(args.rounds):
        for name in layouts:
            for compiled in modes if r % 2 == 0 else modes[::-1]:
                times = launch_once(name, compiled, args.steps)
                kept[(name, compiled)] += times[args.warmup :]
                first[(name, compiled)].append(times[0])
                mode = "compiled" if compiled else "eager"
                median = statistics.median(times[args.warmup :]) * 1e3
                where = f"round {r + 1}/{args.rounds}  {name:11s} {mode:8s}"
                print(f"{where}  first step {times[0]:6.1f} s  median {median:7.1f} ms")
    machine = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, {ACCELERATOR.upper()} ranks"
    print(f"\n{WORLD} ranks as launched on {machine}; GPT {MODEL}, global batch {GLOBAL_BATCH}; {args.rounds} rounds\n")
    columns = ["layout", "eager (ms/step)", "compiled (ms/step)", "compiled / eager", "first step eager (s)"]
    print("| " + " | ".join([*columns, "first step compiled (s)"]) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in layouts:
        eager, comp = (statistics.median(kept[(name, c)]) * 1e3 if kept[(name, c)] else None for c in (False, True))
        f_eager, f_comp = (statistics.median(first[(name, c)]) if first[(name, c)] else None for c in (False, True))
        ratio = comp / eager if comp is not None and eager is not None else None
        cells = [_cell(eager, 1), _cell(comp, 1), _cell(ratio, 3), _cell(f_eager, 2), _cell(f_comp, 2)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _cell(value: float | None, digits: int) -> str:
    """A table cell: the figure, or a dash for a mode not run (``--modes``)."""
    return "—" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
