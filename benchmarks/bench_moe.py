"""Expert parallelism against tensor parallelism and FSDP2 alone, on the same mixture-of-experts model and global batch.

    python benchmarks/bench_moe.py [--rounds 3] [--steps 20] [--warmup 5] [--only ep]

The model is transformers' own Qwen3-MoE, unchanged (``examples.hf_llama.CausalLMModule``, random weights): hidden
256, 4 layers, 8 experts of hidden 256 in every layer, top-2 renormalised, sequence 128, global batch 16, fp32 with
AdamW. Four layouts of 4 ranks each:

* ``fsdp``: ``dp_shard=4``, every expert sharded by FSDP2 like every other weight (gathered whole on every rank in
  each forward and backward);
* ``ep=4``: ``dp_shard=4, ep=4``, two whole experts a rank, tokens exchanged by all-to-all, no expert gathered;
* ``ep=2``: ``dp_shard=4, ep=2``, four experts a rank, FSDP2 over the two ranks that hold them;
* ``tp``: ``dp_shard=2, tp=2`` with the model's own plan, every expert cut along its hidden size
  (``moe_tp_experts``).

Each run is ``python benchmarks/bench_moe.py --launched-run NAME``: ``Trainer(devices=4)``, whose ranks Lightning's
launcher starts, as a user's ``python train.py`` does. Rounds interleave the layouts, each round in another order. A
step's time is the slowest rank's; the table gives the median of every kept step of every round, the tokens per
second of the global batch, and the ratio to ``fsdp``; memory per rank is the model state (parameters, gradients and
AdamW state each rank holds, by par3d's meter, the largest rank's) and the peak bytes a batch saves for backward
(the largest rank's), and on CUDA the allocator's peak.
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

from benchmarks.bench_strategies import StepTimer, quiet_trainer

MODEL = dict(
    architecture="qwen3_moe",
    vocab_size=256,
    block_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    config_overrides=dict(
        head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
        norm_topk_prob=True,
    ),
)  # fmt: skip
GLOBAL_BATCH = 16
WORLD = 4
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp": dict(dp_shard=4),
    "ep=4": dict(dp_shard=4, ep=4),
    "ep=2": dict(dp_shard=4, ep=2),
    "tp": dict(dp_shard=2, tp=2, tp_plan="auto"),
}
ACCELERATOR = "gpu" if torch.cuda.device_count() >= WORLD else "cpu"


class MemoryProbe(L.Callback):
    """The model state each rank holds before its second step, and the peak bytes a batch saves for backward."""

    def __init__(self) -> None:
        self.state = 0
        self.activations = 0
        self.meter: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_par3d.memory.meters import SavedTensorMeter

        self.meter = SavedTensorMeter().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.meter.__exit__(None, None, None)
        self.activations = max(self.activations, self.meter.peak)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        from lightning_par3d.memory.meters import model_state_bytes

        if trainer.global_step == 1:
            state = model_state_bytes(pl_module, trainer.optimizers)
            self.state = state.params + state.grads + state.optimizer


def launched_run(name: str, steps: int, warmup: int, out: str) -> None:
    """Inside a job Lightning's launcher started (every rank runs this); rank 0 writes the figures to ``out``."""
    import torch.distributed as dist

    from examples.data import ShakespeareDataModule
    from examples.hf_llama import CausalLMModule
    from lightning_par3d import Par3DStrategy

    L.seed_everything(0, verbose=False)
    strategy = Par3DStrategy(**LAYOUTS[name])
    timer, probe = StepTimer(), MemoryProbe()
    trainer = quiet_trainer(strategy, WORLD, steps, [timer, probe], ACCELERATOR)
    dp = strategy.layout.dp
    data = ShakespeareDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, max_bytes=400_000)
    trainer.fit(CausalLMModule(**MODEL), data)
    times = torch.tensor(timer.times[warmup:])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    cuda_peak = torch.cuda.max_memory_allocated() if ACCELERATOR == "gpu" else 0
    memory = torch.tensor([probe.state, probe.activations, cuda_peak], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        state, activations, peak = memory.tolist()
        figures = {"times": times.tolist(), "state": state, "activations": activations, "cuda_peak": peak}
        Path(out).write_text(json.dumps(figures))


def launch_once(name: str, steps: int, warmup: int) -> dict[str, Any]:
    """One fresh ``python`` job whose ranks Lightning's launcher starts, with nothing set in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        command = [sys.executable, __file__, "--launched-run", name, "--steps", str(steps)]
        command += ["--warmup", str(warmup), "--out", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default=None, help="only the layouts whose name contains this (and fsdp)")
    parser.add_argument("--launched-run", default=None, help=argparse.SUPPRESS)  # one job (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launched_run is not None:
        launched_run(args.launched_run, args.steps, args.warmup, args.out)
        return

    names = [n for n in LAYOUTS if args.only is None or args.only in n or n == "fsdp"]
    figures: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            got = launch_once(name, args.steps, args.warmup)
            figures[name].append(got)
            print(f"round {r + 1}/{args.rounds}  {name:6s} median {statistics.median(got['times']) * 1e3:8.1f} ms")
    machine = f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}"
    print(
        f"\nQwen3-MoE (8 experts, top-2, hidden 256, 4 layers), sequence {MODEL['block_size']}, global batch "
        f"{GLOBAL_BATCH}; {WORLD} {ACCELERATOR.upper()} ranks a job, each launched as users launch it, on {machine}; "
        f"{args.rounds} interleaved rounds of {args.steps - args.warmup} kept steps\n"
    )
    print("| layout | ms/step | tokens/s | time / fsdp | model state MiB/rank | activations MiB/rank | CUDA peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(t for run in figures["fsdp"] for t in run["times"])
    for name in names:
        step = statistics.median(t for run in figures[name] for t in run["times"])
        tokens = GLOBAL_BATCH * MODEL["block_size"] / step
        state = max(run["state"] for run in figures[name]) / 2**20
        activations = max(run["activations"] for run in figures[name]) / 2**20
        peak = max(run["cuda_peak"] for run in figures[name]) / 2**20
        cuda = f"{peak:.1f}" if ACCELERATOR == "gpu" else "—"
        print(
            f"| {name} | {step * 1e3:.1f} | {tokens:,.0f} | {step / base:.3f} | {state:.2f} | {activations:.2f} "
            f"| {cuda} |"
        )


if __name__ == "__main__":
    main()
