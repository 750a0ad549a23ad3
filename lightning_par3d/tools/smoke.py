"""``par3d smoke``: a few training steps of your own model at a par3d layout, checked against pure data parallelism
over the same ranks, for CI.

    par3d smoke --module examples.gpt:GPTModule --data examples.data:ShakespeareDataModule \\
        --layout dp_shard=2,tp=2 --devices 4 --accelerator cpu --steps 5 --out smoke
    torchrun --nproc-per-node 8 -m lightning_par3d smoke --module ... --layout ...   # one rank per GPU

It trains the LightningModule (``--module``, built with ``--module-arg key=value``) on the LightningDataModule
(``--data``, built with ``--data-arg key=value`` and ``batch_size`` = the global batch over the data-parallel
ranks) twice, in the same processes, with the same seed and the same global batch (``--global-batch``):

1. at the layout (``--layout``: ``Par3DConfig`` fields, ``key=value`` separated by commas);
2. at pure data parallelism (``dp_replicate`` = every rank: DDP semantics), the reference.

Under torchrun (or SLURM, or any launcher that sets ``WORLD_SIZE``) every rank runs it; otherwise Lightning's
launcher starts ``--devices`` local processes (CPU processes over gloo with ``--accelerator cpu``, the default where
no GPU is). Then, on every rank alike, the checks:

* ``finite``: every step's loss is finite, in both runs;
* ``agree``: the ranks that must hold the same loss (the tensor-parallel and pipeline peers of a data-parallel rank)
  hold the same value, bit for bit;
* ``match``: each step's loss at the layout equals the data-parallel run's within ``--rtol`` (1e-4 in fp32, 2e-2
  under a 16-bit precision: a layout reorders its sums, and half precision keeps 8 to 11 bits).

Rank 0 writes ``OUT/result.json`` (the layout, both runs' losses, the step times, each rank's memory, every check's
outcome) and prints one line per check. The exit status is 0 when every check passed, 1 when one failed (its line
says which and by how much), 2 for bad input (named before any process is started).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_par3d.tools.loading import example_of, load_object, parse_pairs

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
RTOL = {"32-true": 1e-4, "bf16-mixed": 2e-2, "16-mixed": 2e-2, "bf16-true": 5e-2}
"""The default ``--rtol`` by precision."""


# ---------------------------------------------------------------- input


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="par3d smoke",
        description=__doc__.split("\n\n")[0],
        epilog=example_of(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--module", required=True, help="the LightningModule, package.module:Class")
    p.add_argument("--module-arg", action="append", default=[], help="key=value for the module (repeat)")
    p.add_argument("--data", required=True, help="the LightningDataModule, package.module:Class (takes batch_size)")
    p.add_argument("--data-arg", action="append", default=[], help="key=value for the data module (repeat)")
    p.add_argument("--layout", required=True, help="Par3DConfig fields, e.g. pp=2,dp_shard=2,tp=2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (default: 2 per rank)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--rtol", type=float, default=None, help="loss tolerance against data parallelism")
    p.add_argument("--devices", type=int, default=None, help="processes to launch (not under torchrun)")
    p.add_argument("--accelerator", default=None, help="cpu or gpu (default: gpu where one is)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600.0, help="par3d's collective timeout")
    p.add_argument("--out", default="smoke", help="the folder for result.json")
    return p


def plan_of(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the runs need, checked before any process is started: raises ``ValueError`` naming the bad input
    and the fix."""
    import torch

    from lightning_par3d.config import Par3DConfig, resolve_layout

    accelerator = args.accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    launched = "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else (args.devices or _local_devices(accelerator))
    settings = parse_pairs(args.layout, "--layout")
    layout = resolve_layout(Par3DConfig(**settings), world)  # the config's own messages
    assert layout is not None
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give 1 or more.")
    batch = args.global_batch or 2 * world
    for name, dp in (("the layout", layout.dp), ("data parallelism", world)):
        if batch % dp:
            raise ValueError(
                f"--global-batch {batch} does not split over the {dp} data-parallel ranks of {name}. Give a "
                f"multiple of {math.lcm(layout.dp, world)}."
            )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world
    return dict(
        module=load_object(args.module, "--module"), module_args=parse_pairs(args.module_arg, "--module-arg"),
        data=load_object(args.data, "--data"), data_args=parse_pairs(args.data_arg, "--data-arg"),
        settings=settings, layout=layout, world=world, batch=batch, accelerator=accelerator, devices=local,
        nodes=world // local, rtol=args.rtol or RTOL.get(args.precision, 2e-2),
    )  # fmt: skip


def _local_devices(accelerator: str) -> int:
    import torch

    return max(torch.cuda.device_count(), 1) if accelerator == "gpu" else 2


# ---------------------------------------------------------------- the runs


def run(plan: dict[str, Any], settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One training run at ``settings``: per step, the loss averaged over the data-parallel ranks and this rank's
    own; the step times; this rank's memory and place in the mesh."""
    import lightning as L
    import torch

    from lightning_par3d.integrations.trainer import Par3DStrategy
    from lightning_par3d.memory.meters import model_state_bytes

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.local: list[float] = []
            self.times: list[float] = []
            self.state: Any = None
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.state = model_state_bytes(module, trainer.optimizers)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            loss = outputs["loss"].detach() if isinstance(outputs, dict) else outputs.detach()
            self.local.append(float(loss))
            self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
            self.times.append(time.perf_counter() - self._start)

    L.seed_everything(args.seed, verbose=False)
    strategy = Par3DStrategy(timeout_s=args.timeout_s, **settings)
    watch = Watch()
    trainer = L.Trainer(
        accelerator=plan["accelerator"], devices=plan["devices"], num_nodes=plan["nodes"], strategy=strategy,
        precision=args.precision, max_steps=args.steps, callbacks=[watch], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # parity: no rank may round its matmuls differently
        torch.backends.cudnn.allow_tf32 = False
    module = plan["module"](**plan["module_args"])
    data = plan["data"](batch_size=plan["batch"] // strategy.layout.dp, **plan["data_args"])
    trainer.fit(module, data)
    engine = strategy.engine
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "layout": str(strategy.layout),
        "losses": watch.losses,
        "local": watch.local,
        "dp_rank": engine.dp_rank,
        "step_s": statistics.median(watch.times[1:] or watch.times),
        "memory": {**(vars(watch.state) if watch.state is not None else {}), "cuda_peak": cuda},
    }


def _every_rank(mine: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


# ---------------------------------------------------------------- the checks


def checks(layout_run: list[dict[str, Any]], reference: list[dict[str, Any]], rtol: float) -> list[dict[str, Any]]:
    """The outcome of every check (see the module docstring), from every rank's results of both runs."""
    out = []
    bad = [(name, step, loss) for name, runs in (("layout", layout_run), ("data parallel", reference))
           for r in runs for step, loss in enumerate(r["losses"]) if not math.isfinite(loss)]  # fmt: skip
    out.append(dict(name="finite", ok=not bad, detail=f"non-finite losses (run, step, loss): {bad[:5]}" if bad else
                    f"{sum(len(r['losses']) for r in layout_run + reference)} losses, all finite"))  # fmt: skip
    groups: dict[int, list[tuple[int, list[float]]]] = {}
    for rank, r in enumerate(layout_run):
        groups.setdefault(r["dp_rank"], []).append((rank, r["local"]))
    split = [(dp, [rank for rank, _ in members]) for dp, members in groups.items()
             if any(local != members[0][1] for _, local in members)]  # fmt: skip
    out.append(dict(name="agree", ok=not split, detail=(
        f"ranks of one data-parallel rank hold different losses: dp rank {split[0][0]}, ranks {split[0][1]}: "
        f"{[r['local'] for r in layout_run if r['dp_rank'] == split[0][0]]}" if split else
        f"the peers of each of {len(groups)} data-parallel ranks hold the same losses")))  # fmt: skip
    got, want = layout_run[0]["losses"], reference[0]["losses"]
    worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want, strict=False)), default=math.inf)
    ok = len(got) == len(want) and worst <= rtol
    out.append(dict(name="match", ok=ok, detail=(
        f"each step's loss within rtol {rtol:g} of data parallelism (worst {worst:.2e})" if ok else
        f"the layout's losses {got} against data parallelism's {want}: relative difference {worst:.2e} > rtol "
        f"{rtol:g}")))  # fmt: skip
    return out


def smoke(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """Both runs and the checks; (exit status, result)."""
    plan = plan_of(args)
    world = plan["world"]
    at_layout = _every_rank(run(plan, plan["settings"], args))
    reference = _every_rank(run(plan, {"dp_replicate": world, "dp_shard": 1}, args))
    outcome = checks(at_layout, reference, plan["rtol"])
    result = {
        "layout": at_layout[0]["layout"],
        "world_size": world,
        "precision": args.precision,
        "global_batch": plan["batch"],
        "steps": args.steps,
        "losses": {"layout": at_layout[0]["losses"], "data_parallel": reference[0]["losses"]},
        "step_s": {"layout": [r["step_s"] for r in at_layout], "data_parallel": [r["step_s"] for r in reference]},
        "memory_per_rank": [r["memory"] for r in at_layout],
        "checks": outcome,
        "passed": all(c["ok"] for c in outcome),
    }
    return (0 if result["passed"] else EXIT_FAILED), result


def main(argv: list[str] | None = None) -> int:
    from lightning_par3d.utils.console import quiet_known_upstream_warnings

    args = parser().parse_args(argv)
    quiet_known_upstream_warnings()
    try:
        status, result = smoke(args)
    except ValueError as error:
        print(f"par3d smoke: bad input: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"par3d smoke: {result['layout']} on {result['world_size']} ranks, {args.precision}, "
              f"{args.steps} steps, global batch {result['global_batch']}")  # fmt: skip
        for check in result["checks"]:
            print(f"  [{'pass' if check['ok'] else 'FAIL'}] {check['name']}: {check['detail']}")
        print(f"  result: {out / 'result.json'}")
    if dist.is_initialized():
        # Both runs are over on every rank (their results were gathered). Ending the process with the groups alive
        # left their teardown to the interpreter's exit, where gloo's threads were once destroyed still joinable
        # (a loaded machine: "terminate called without an active exception", exit status -6 instead of 0 or 1).
        sys.stdout.flush()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
