"""One GPU: par3d under the Trainer against plain torch on the same model, and the CPU thread sweep of par3d's ranks.

    python benchmarks/bench_gpu.py                      # both parts (about 7 minutes on one H100 or H200)
    python benchmarks/bench_gpu.py --part gpu           # the GPU table only
    python benchmarks/bench_gpu.py --part threads       # the thread sweep only
    python benchmarks/bench_gpu.py --size tiny          # a reduced model: runs on a CPU in a minute or two

**The GPU table.** A Llama-shaped transformers model (``--size 1b``: hidden 2048, 16 layers, 32 heads, 8 KV heads,
MLP 8192, vocabulary 32000; 1.1 B parameters) trains in ``bf16-mixed`` (fp32 weights and AdamW state, the forward
and backward under ``torch.autocast``) at world size 1, on random tokens, ``--batch`` × ``--seq`` tokens a step:

* ``torch eager`` / ``torch compiled``: the limit. The same model and optimizer in a hand-written loop (forward,
  cross-entropy, backward, ``AdamW.step``, ``zero_grad``); compiled means every decoder layer compiled in place
  (``layer.compile()``), the recipe par3d applies;
* ``par3d …``: ``Trainer(devices=1, strategy=Par3DStrategy(...), precision="bf16-mixed")`` fitting the example's
  ``CausalLMModule``, eager or ``compile=True``, without or with ``activation_checkpointing="full"``.

Each run is its own ``python`` process, as a user launches it, one after the other (one GPU). A step's time is
between two ends of steps with the GPU synchronized; the first ``--warmup`` steps (the compilation among them) are
dropped and the median of the rest is reported, with the first step's time apart. Tokens/s is tokens a step over the
median step; MFU is the model's FLOPs a token (``6 N + 12 L d T``: ``N`` the parameters outside the embedding, ``L``
layers, ``d`` the width, ``T`` the sequence; activation recompute not counted, as MFU is defined) times tokens/s over
the card's dense bf16 peak; peak memory is ``torch.cuda.max_memory_allocated`` over the run. Every ratio is to
``torch eager`` of the same invocation.

**The thread sweep** (CPU; what the GPU machine's 16 cores say about the per-rank thread rule): 4 CPU ranks train the
example GPT (``bench_strategies``' model and batch) at dp2×tp2 and dp_shard=4, each run a job launched as users launch
it, with ``OMP_NUM_THREADS`` = 1, 2, 4, 8 for every par3d rank, against Lightning's own strategy at the same layout as
its launcher starts it (which gives its rule, cores ÷ ranks, to rank 0 only). ``--rounds`` interleaved rounds.
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

SIZES: dict[str, dict[str, int]] = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        seq=2048,
        batch=4,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        seq=128,
        batch=4,
    ),
}
RUNS = (
    "torch eager",
    "torch compiled",
    "par3d eager",
    "par3d compiled",
    "par3d eager +AC",
    "par3d compiled +AC",
)
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H20": 148.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}
"""Dense bf16 peak of a card (datasheet, TFLOP/s), by a name its ``torch.cuda.get_device_name()`` contains."""
LR = 1e-4


def peak_tflops(device_name: str) -> float | None:
    for key, value in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in device_name:
            return value
    return None


def module_for(size: dict[str, int]) -> Any:
    from examples.hf_llama import CausalLMModule

    shape = {k: v for k, v in size.items() if k not in ("seq", "batch")}
    return CausalLMModule(block_size=size["seq"], lr=LR, **shape)


def random_tokens(size: dict[str, int], steps: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size["vocab_size"], (steps * size["batch"], size["seq"] + 1), generator=generator)
    return torch.utils.data.TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def model_figures(model: Any, size: dict[str, int]) -> dict[str, float]:
    """The parameters, and the FLOPs a token: ``6 N + 12 L d T`` (N: the parameters outside the input embedding)."""
    total = sum(p.numel() for p in model.parameters())
    n = total - model.get_input_embeddings().weight.numel()
    flops = 6 * n + 12 * size["num_hidden_layers"] * size["hidden_size"] * size["seq"]
    return {"params": total, "flops_per_token": flops}


class StepClock:
    """Times between the ends of consecutive steps, the device synchronized at each end."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.ends: list[float] = []
        self.start = time.perf_counter()

    def tick(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ends.append(time.perf_counter())

    def result(self, warmup: int) -> dict[str, Any]:
        times = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)][max(0, warmup - 1) :]
        return {"times": times, "first_step": self.ends[0] - self.start}


def torch_run(size: dict[str, int], compiled: bool, steps: int, warmup: int, device: Any, precision: str) -> dict:
    """The hand-written loop: the limit that one device sets."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = module_for(size)
    with device:
        model = AutoModelForCausalLM.from_config(module.model_config())
    model.train()
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    hp = module.hparams
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=hp.weight_decay, betas=hp.betas, eps=hp.eps)
    loader = torch.utils.data.DataLoader(random_tokens(size, steps), batch_size=size["batch"])
    low = torch.bfloat16 if precision == "bf16-mixed" else None
    clock = StepClock(device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=low or torch.float32, enabled=low is not None):
            logits = model(x, use_cache=False).logits  # no KV cache in training (par3d turns it off too)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return {**clock.result(warmup), **model_figures(model, size), "loss": float(loss)}


def par3d_run(
    size: dict[str, int], compiled: bool, ac: bool, steps: int, warmup: int, device: Any, precision: str
) -> dict:
    """``Trainer.fit`` of the example's CausalLMModule with par3d at world size 1, as a user runs it."""
    import lightning as L

    from lightning_par3d import Par3DStrategy

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.clock: StepClock | None = None

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.clock = StepClock(trainer.strategy.root_device)

        def on_train_batch_end(self, *args: Any) -> None:
            assert self.clock is not None
            self.clock.tick()

    L.seed_everything(0, verbose=False)
    module = module_for(size)
    timer = Clock()
    strategy = Par3DStrategy(compile=compiled, activation_checkpointing="full" if ac else "none")
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    import torch

    loader = torch.utils.data.DataLoader(random_tokens(size, steps), batch_size=size["batch"])
    trainer.fit(module, loader)
    assert timer.clock is not None
    loss = float(trainer.callback_metrics["train_loss"])
    return {**timer.clock.result(warmup), **model_figures(module.model, size), "loss": loss}


def one_run(name: str, size_name: str, steps: int, warmup: int, out: str) -> None:
    """Inside the child process: one run, its figures written to ``out``."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = "bf16-mixed" if cuda else "32-true"
    size = SIZES[size_name]
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    compiled = "compiled" in name
    started = time.perf_counter()
    if name.startswith("torch"):
        result = torch_run(size, compiled, steps, warmup, device, precision)
    else:
        result = par3d_run(size, compiled, "+AC" in name, steps, warmup, device, precision)
    result["wall"] = time.perf_counter() - started
    result["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    result["device"] = torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)"
    result["precision"] = precision
    Path(out).write_text(json.dumps(result))


def launch(name: str, size_name: str, steps: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        command = [sys.executable, __file__, "--run", name, "--size", size_name, "--steps", str(steps)]
        command += ["--warmup", str(warmup), "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
        if done.returncode != 0:
            print(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}", flush=True)
            return {}
        return dict(json.loads(out.read_text()))


def gpu_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    runs = [r for r in RUNS if args.only is None or any(o in r for o in args.only.split(","))]
    size = SIZES[args.size]
    tokens = size["batch"] * size["seq"]
    rows = []
    for name in runs:
        got = launch(name, args.size, args.steps, args.warmup)
        if not got:
            continue
        median = statistics.median(got["times"])
        row = {"run": name, "median_s": median, "tokens_per_s": tokens / median, **got}
        peak = peak_tflops(got["device"])
        row["mfu"] = got["flops_per_token"] * row["tokens_per_s"] / (peak * 1e12) if peak else None
        rows.append(row)
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        memory = f"{got['peak_bytes'] / 2**30:.1f} GiB" if got["peak_bytes"] else "n/a"
        print(
            f"{name:20s} {median * 1e3:8.1f} ms/step  {row['tokens_per_s']:9.0f} tok/s  MFU {mfu:>6s}  peak {memory}"
            f"  first step {got['first_step']:.1f} s  process {got['wall']:.0f} s  loss {got['loss']:.3f}",
            flush=True,
        )
    base = next((r for r in rows if r["run"] == "torch eager"), None)
    device = rows[0]["device"] if rows else "?"
    params = rows[0]["params"] if rows else 0
    print(
        f"\nOne {device}, torch {torch.__version__}; {args.size} Llama-shaped model ({params / 1e9:.2f} B parameters), "
        f"{size['batch']}×{size['seq']} tokens a step, {rows[0]['precision'] if rows else ''}, "
        f"median of {args.steps - args.warmup} steps after {args.warmup}\n"
    )
    print("| run | ms/step | tokens/s | MFU | peak memory | first step (s) | tokens/s ÷ torch eager | memory ÷ eager |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        memory = f"{r['peak_bytes'] / 2**30:.1f} GiB" if r["peak_bytes"] else "n/a"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "n/a"
        mem_ratio = f"{r['peak_bytes'] / base['peak_bytes']:.3f}" if base and r["peak_bytes"] else "n/a"
        print(
            f"| {r['run']} | {r['median_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {mfu} | {memory} | "
            f"{r['first_step']:.1f} | {speed} | {mem_ratio} |"
        )
    return rows


def threads_part(args: argparse.Namespace) -> dict[str, list[float]]:
    from benchmarks.bench_strategies import launch_once

    layouts = [("par3d dp2×tp2", "ModelParallel dp2×tp2"), ("par3d dp_shard=4", "ModelParallel dp=4")]
    counts = [int(t) for t in args.threads.split(",")]
    runs = [(par3d, t) for par3d, _ in layouts for t in counts] + [(peer, None) for _, peer in layouts]
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for name, threads in order:
            key = f"{name} @{threads}" if threads is not None else f"{name} (as launched)"
            got = launch_once(name, args.sweep_steps, args.sweep_warmup, threads)
            times.setdefault(key, []).extend(got["times"])
            print(
                f"round {r + 1}/{args.rounds}  {key:34s} median {statistics.median(got['times']) * 1e3:7.1f} ms  "
                f"threads by rank {got['threads']}",
                flush=True,
            )
    print(
        f"\nThread sweep: 4 CPU ranks on {os.cpu_count()} cores ({platform.machine()}), "
        f"{args.sweep_steps - args.sweep_warmup} kept steps a run, {args.rounds} rounds\n"
    )
    print("| layout | threads per rank | ms/step | ÷ Lightning as launched |")
    print("|---|---|---:|---:|")
    for par3d, peer in layouts:
        ref = statistics.median(times[f"{peer} (as launched)"])
        for t in counts:
            median = statistics.median(times[f"{par3d} @{t}"])
            print(f"| {par3d.removeprefix('par3d ')} | par3d, {t} | {median * 1e3:.1f} | {median / ref:.3f} |")
        print(f"| {par3d.removeprefix('par3d ')} | {peer}, as launched | {ref * 1e3:.1f} | 1.000 |")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "gpu", "threads"), default="all")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="1b on a GPU, tiny on a CPU by default")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", default=None, help="comma-separated parts of run names (e.g. 'torch,par3d eager')")
    parser.add_argument("--threads", default="1,2,4,8", help="the sweep's threads per par3d rank")
    parser.add_argument("--rounds", type=int, default=1, help="the sweep's interleaved rounds")
    parser.add_argument("--sweep-steps", type=int, default=20)
    parser.add_argument("--sweep-warmup", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one run, in its own process (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size is None:
        import torch

        args.size = "1b" if torch.cuda.is_available() else "tiny"
    if args.run is not None:
        one_run(args.run, args.size, args.steps, args.warmup, args.out)
        return
    figures: dict[str, Any] = {}
    if args.part in ("all", "gpu"):
        figures["gpu"] = gpu_part(args)
    if args.part in ("all", "threads"):
        figures["threads"] = threads_part(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
