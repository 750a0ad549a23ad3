"""``par3d plan``: which layout to train with, ranked for a world of devices before anything is launched.

    par3d plan --model-config conf/model/gpt.yaml --world-size 8 --batch 32 --seq 64
    par3d plan --module examples.gpt:GPTModule --model-arg n_layer=8 --world-size 16 --devices-per-node 8 \\
        --memory 80GiB --batch 64 --seq 1024 --profile h100-sxm-8 --fixed tp=2 --plot

It builds the LightningModule from a class (``--module package.module:Class``, from the working directory too, with
``--model-arg key=value`` arguments) or from a Hydra model config (``--model-config conf/model/gpt.yaml``: its
``_target_`` and arguments, as the Hydra app builds it; ``--model-arg`` overrides them), says which model it built
(its class, parameters and blocks), plans, and prints the ranked table: the layouts that fit, fastest first, then
the rejected ones grouped by reason; then the best layout as strategy arguments. ``--plot`` also draws the
predicted steps, into ``outputs/plans/plan-<date>-<time>.png`` (``--plot FILE.png``: there). The machine is a named
profile (``--profile``, default ``h100-sxm-8``) or this machine, measured (``--calibrate``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lightning_par3d.planning.candidates import FIXED_KEYS, SearchSpace
from lightning_par3d.tools.loading import build_model, describe_model, example_of, parse_pairs


def _csv(text: str, cast: Any = str) -> tuple[Any, ...]:
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="par3d plan",
        description="Rank every par3d layout of a model on a world of devices: memory per rank (the estimator's) "
        "and predicted step time (compute, tensor-parallel comm, data-parallel comm, pipeline bubble).",
        epilog=example_of(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--module", help="the LightningModule class, package.module:Class")
    model.add_argument("--model-config", help="a Hydra model config, e.g. conf/model/gpt.yaml (the app's model)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="a constructor argument")
    p.add_argument("--world-size", type=int, required=True, help="ranks in all")
    p.add_argument("--devices-per-node", type=int, default=None, help="ranks per node (default: the profile's)")
    p.add_argument("--memory", default=None, help="memory per device, e.g. 80GiB (default: the profile's)")
    p.add_argument("--batch", type=int, required=True, help="global batch: samples per optimizer step")
    p.add_argument("--seq", type=int, required=True, help="tokens per sample")
    p.add_argument("--precision", default="32-true", help="Lightning's precision flag (default 32-true)")
    p.add_argument("--optimizer", default="adamw", help="the optimizer's state layout: adamw, adam, sgd, sgd_momentum")
    machine = p.add_mutually_exclusive_group()
    machine.add_argument("--profile", default=None, help="a hardware profile (default h100-sxm-8)")
    machine.add_argument("--calibrate", action="store_true", help="measure this machine instead (a few seconds)")
    p.add_argument("--calibrate-processes", type=int, default=None, help="processes that calibrate (default: cores)")
    p.add_argument(
        "--fixed", action="append", default=[], metavar="KEY=VALUE", help=f"pin one of {', '.join(FIXED_KEYS)}"
    )
    p.add_argument("--ac", default=None, help="checkpointing modes to try, e.g. none,full,selective,op")
    p.add_argument("--zero", default=None, help="ZeRO stages to try over dp_shard, e.g. 1,3")
    p.add_argument("--schedules", default=None, help="pipeline schedules to try, e.g. 1f1b,interleaved_1f1b")
    p.add_argument("--microbatch-multiples", default=None, help="microbatches per pipeline stage to try, e.g. 1,2,4")
    p.add_argument("--no-prune", action="store_true", help="also evaluate checkpointing where a layout fits without")
    p.add_argument("--top", type=int, default=25, help="fitting layouts to print (default 25)")
    p.add_argument("--all-rejected", action="store_true", help="one line per rejected layout instead of by reason")
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.png",
        help="draw the predicted steps of the top layouts (default file: outputs/plans/plan-<date>-<time>.png)",
    )
    return p


DEFAULT_PLOT = "outputs/plans/plan-%Y-%m-%d-%H%M%S.png"
"""Where ``--plot`` without a file draws (under ``outputs/``, where the Hydra app writes its runs; git ignores it)."""


def main(argv: list[str] | None = None) -> int:
    from lightning_par3d.planning.calibrate import calibrate
    from lightning_par3d.planning.planner import DEFAULT_MACHINE, plan

    args = parser().parse_args(argv)
    try:
        module = build_model(args.module, args.model_config, parse_pairs(args.model_arg, "--model-arg"))
        fixed = parse_pairs(args.fixed, "--fixed")
    except ValueError as error:
        print(f"par3d plan: bad input: {error}", file=sys.stderr)
        return 2
    print(f"model: {describe_model(module)}", flush=True)
    space: dict[str, Any] = {}
    if args.ac:
        space["activation_checkpointing"] = _csv(args.ac)
    if args.zero:
        space["zero_stages"] = _csv(args.zero, int)
    if args.schedules:
        space["schedules"] = _csv(args.schedules)
    if args.microbatch_multiples:
        space["microbatch_multiples"] = _csv(args.microbatch_multiples, int)
    if args.no_prune:
        space["prune_checkpointing"] = False
    machine: Any = args.profile or DEFAULT_MACHINE
    if args.calibrate:
        started = time.perf_counter()
        machine = calibrate(args.calibrate_processes or min(max(args.world_size, 2), 8))
        print(f"calibrated in {time.perf_counter() - started:.1f} s: {machine.describe()}", flush=True)
    try:
        table = plan(
            module,
            args.world_size,
            args.devices_per_node,
            args.memory,
            global_batch=args.batch,
            seq_len=args.seq,
            precision=args.precision,
            machine=machine,
            fixed=fixed,
            search=SearchSpace(**space),
            optimizer=args.optimizer,
        )
    except ValueError as error:
        print(f"par3d plan: bad input: {error}", file=sys.stderr)
        return 2
    plot_to = args.plot or (time.strftime(DEFAULT_PLOT) if args.plot == "" else None)
    print_plan(table, top=args.top, group_rejected=not args.all_rejected, plot_to=plot_to)
    return 0


def print_plan(table: Any, top: int, group_rejected: bool = True, plot_to: str | None = None) -> None:
    """Prints a plan as ``par3d plan`` does: the ranked table, the best layout as strategy arguments (for Python and
    for the Hydra app), and, with ``plot_to``, where the plot was drawn."""
    from lightning_par3d.planning.plot import plot

    print(table.to_markdown(top=top, group_rejected=group_rejected))
    best = table.best
    arguments = best.strategy_arguments()
    settings = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    print(f"\nbest: Par3DStrategy({settings})  # {best.describe()}")
    print("  as Hydra overrides: " + " ".join(f"strategy.{k}={v}" for k, v in arguments.items()))
    if plot_to:
        print(f"plot: {plot(table, plot_to, top=top)}")
