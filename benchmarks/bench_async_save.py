"""How long a checkpoint save blocks training: ``async_save=True`` against the synchronous save.

    python benchmarks/bench_async_save.py [--rounds 2] [--steps 12] [--every 3] [--n-embd 512] [--n-layer 8]

Each run is this script again (``--run sync|async``) as a user launches a training script: ``Trainer(devices=2,
strategy=Par3DStrategy(dp_shard=2, async_save=...))``, whose ranks Lightning's launcher starts, with a
``ModelCheckpoint`` saving ``last.ckpt`` every ``--every`` steps. The example GPT is made large enough that a save
takes a measurable time (the default: 25.5 M parameters, with AdamW about 300 MB of model and optimizer state over
the two ranks). Rank 0 times each call of the strategy's ``save_checkpoint`` (what the training loop waits for) and
each training step; the runs alternate sync and async, ``--rounds`` times, and the table gives medians and the ratio
async / sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def launched_run(mode: str, steps: int, every: int, n_embd: int, n_layer: int, out: Path) -> None:
    """One run (the ranks Lightning launches run this too); rank 0 writes its timings to ``out``."""
    import lightning as L

    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy

    class Timings(L.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.steps.append(time.perf_counter() - self._start)

    L.seed_everything(0, verbose=False)
    strategy = Par3DStrategy(dp_shard=2, async_save=mode == "async", timeout_s=600)
    saves: list[float] = []
    save = strategy.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        save(*args, **kwargs)
        saves.append(time.perf_counter() - start)

    strategy.save_checkpoint = timed_save  # type: ignore[method-assign]
    timings = Timings()
    with tempfile.TemporaryDirectory() as ckpt:
        saver = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=ckpt, save_last=True, save_top_k=0, every_n_train_steps=every
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=[timings, saver],
            logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0,
        )  # fmt: skip
        module = GPTModule(block_size=64, n_layer=n_layer, n_head=8, n_embd=n_embd)
        started = time.perf_counter()
        trainer.fit(module, ShakespeareDataModule(block_size=64, batch_size=4, max_bytes=200_000))
        total = time.perf_counter() - started
    if trainer.is_global_zero:
        params = sum(p.numel() for p in module.parameters())  # DTensors: the whole parameters' sizes
        out.write_text(json.dumps({"saves": saves, "steps": timings.steps, "total": total, "params": params}))


def run_once(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        sizes = ["--steps", str(args.steps), "--every", str(args.every), "--n-embd", str(args.n_embd)]
        command = [sys.executable, __file__, "--run", mode, "--out", str(out), *sizes, "--n-layer", str(args.n_layer)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--run", choices=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        launched_run(args.run, args.steps, args.every, args.n_embd, args.n_layer, args.out)
        return
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for round_ in range(args.rounds):
        for mode in ("sync", "async") if round_ % 2 == 0 else ("async", "sync"):
            results[mode].append(run_once(mode, args))
            print(f"round {round_ + 1}: {mode} done", flush=True)
    params = results["sync"][0]["params"]
    print(f"\nGPT of {params / 1e6:.1f} M parameters, dp_shard=2 on 2 CPU ranks, a save every {args.every} steps")
    print("| save | blocked per save (median) | training step, save excluded (median) | whole run (median) |")
    print("|---|---:|---:|---:|")
    medians = {}
    for mode, runs in results.items():
        blocked = statistics.median(s for run in runs for s in run["saves"])
        step = statistics.median(s for run in runs for s in run["steps"])
        total = statistics.median(run["total"] for run in runs)
        medians[mode] = (blocked, total)
        print(f"| {mode} | {blocked:.3f} s | {step:.3f} s | {total:.1f} s |")
    print(f"\nasync / sync: blocked {medians['async'][0] / medians['sync'][0]:.2f}×, "
          f"whole run {medians['async'][1] / medians['sync'][1]:.2f}×")  # fmt: skip


if __name__ == "__main__":
    main()
