"""The command line: ``python -m lightning_par3d.plan --module examples.gpt:GPTModule --world-size 8 ...``.

It builds the LightningModule from a class (``--module package.module:Class``, from the working directory too, with
``--model-arg key=value`` arguments) or from a Hydra model config (``--model-config conf/model/gpt.yaml``: its
``_target_`` and arguments, as the Hydra app builds it; ``--model-arg`` overrides them), says which model it built
(its class, parameters and blocks), plans, and prints the ranked table: the layouts that fit, fastest first, then
the rejected ones grouped by reason; then the best layout as strategy arguments. ``--plot`` also draws the
predicted steps. The machine is a named profile (``--profile``, default ``h100-sxm-8``) or this machine, measured
(``--calibrate``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import time
from typing import Any

from lightning_par3d.planning.candidates import FIXED_KEYS, SearchSpace


def _pairs(values: list[str], what: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} {item!r}: write key=value (e.g. tp=2).")
        try:
            result[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            result[key.strip()] = raw.strip()
    return result


def _csv(text: str, cast: Any = str) -> tuple[Any, ...]:
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def load_module(spec: str, arguments: dict[str, Any]) -> Any:
    """``package.module:Class`` imported (the working directory first on the path) and built with ``arguments``."""
    path, sep, name = spec.partition(":")
    if not sep or not path or not name:
        raise SystemExit(f"--module {spec!r}: write package.module:Class, e.g. examples.gpt:GPTModule.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        owner = importlib.import_module(path)
    except ImportError as error:
        raise SystemExit(
            f"--module {spec!r}: cannot import {path!r} ({error}). Run from the project's directory."
        ) from None
    built = getattr(owner, name, None)
    if built is None:
        raise SystemExit(f"--module {spec!r}: {path} has no {name!r}.")
    return built(**arguments)


def load_model_config(path: str, arguments: dict[str, Any]) -> Any:
    """The model a Hydra model config (``_target_`` and arguments, e.g. ``conf/model/gpt.yaml``) describes, with
    ``arguments`` overriding its values, built as the Hydra app builds it."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if not os.path.isfile(path):
        raise SystemExit(f"--model-config {path!r}: no such file (a Hydra model config, e.g. conf/model/gpt.yaml).")
    config = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(arguments))
    if "_target_" not in config:
        raise SystemExit(f"--model-config {path!r} has no _target_: it must name the model class, as Hydra's do.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return instantiate(config)


def describe_model(module: Any) -> str:
    """``examples.gpt.GPTModule: 0.85 M parameters, 4 blocks (transformer.h: Block)``: the model as built (on the
    meta device, no memory), for a person to check that the planner plans the model they mean."""
    from lightning_par3d.patterns import repeated_members
    from lightning_par3d.planning.probe import build_meta

    built = build_meta(module)
    params = sum(p.numel() for p in built.parameters())
    containers = [(name, members) for name, sub in built.named_modules() if (members := repeated_members(sub))]
    blocks = ", ".join(f"{name}: {len(members)} × {type(members[0]).__name__}" for name, members in containers)
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}: {params / 1e6:,.2f} M parameters; blocks: {blocks or 'none found'}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_par3d.plan",
        description="Rank every par3d layout of a model on a world of devices: memory per rank (the estimator's) "
        "and predicted step time (compute, tensor-parallel comm, data-parallel comm, pipeline bubble).",
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
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the predicted steps of the top layouts")
    return p


def main(argv: list[str] | None = None) -> int:
    from lightning_par3d.planning.calibrate import calibrate
    from lightning_par3d.planning.planner import DEFAULT_MACHINE, plan
    from lightning_par3d.planning.plot import plot

    args = parser().parse_args(argv)
    arguments = _pairs(args.model_arg, "--model-arg")
    if args.model_config:
        module = load_model_config(args.model_config, arguments)
    else:
        module = load_module(args.module, arguments)
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
            fixed=_pairs(args.fixed, "--fixed"),
            search=SearchSpace(**space),
            optimizer=args.optimizer,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table.to_markdown(top=args.top, group_rejected=not args.all_rejected))
    best = table.best
    settings = ", ".join(f"{k}={v!r}" for k, v in best.strategy_arguments().items())
    print(f"\nbest: Par3DStrategy({settings})  # {best.describe()}")
    if args.plot:
        print(f"plot: {plot(table, args.plot, top=args.top)}")
    return 0
