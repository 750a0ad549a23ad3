"""``par3d dry-run``: a whole training step of chosen ranks of a layout of any size, each in a process of its own
here, over torch's fake process group (:func:`lightning_par3d.tools.dry_run.dry_run`), before a real job is launched.

    par3d dry-run --model-config conf/model/gpt.yaml --data examples.data:ShakespeareDataModule \\
        --layout pp=2,dp_shard=8,tp=4 --world-size 64 --batch-size 16 --ranks 0,32

The model comes from ``--module package.module:Class`` or ``--model-config FILE.yaml`` (the Hydra app's), the batch
from the first training batch of ``--data`` (a LightningDataModule built with ``batch_size`` = ``--batch-size``,
one data-parallel rank's batch). It prints each chosen rank's memory and checkpoint share, and exits 0; 1 when a
rank's step failed (its error, with the rank named); 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys

from lightning_par3d.tools.loading import build_model, describe_model, example_of, load_object, parse_pairs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="par3d dry-run",
        description=__doc__.split("\n\n")[0],
        epilog=example_of(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--module", help="the LightningModule class, package.module:Class")
    model.add_argument("--model-config", help="a Hydra model config, e.g. conf/model/gpt.yaml (the app's model)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="a constructor argument")
    p.add_argument("--data", required=True, help="the LightningDataModule, package.module:Class (takes batch_size)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE", help="a data module argument")
    p.add_argument("--batch-size", type=int, required=True, help="samples per data-parallel rank")
    p.add_argument("--layout", required=True, help="Par3DConfig fields, e.g. pp=2,dp_shard=8,tp=4")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the layout")
    p.add_argument("--ranks", default=None, help="ranks to run, e.g. 0,32 (default: the first of every stage)")
    p.add_argument("--steps", type=int, default=1, help="training steps of each rank (default 1)")
    p.add_argument("--precision", default="32-true", help="Lightning's precision flag (default 32-true)")
    return p


def main(argv: list[str] | None = None) -> int:
    from lightning_par3d.config import Par3DConfig
    from lightning_par3d.tools.dry_run import dry_run

    args = parser().parse_args(argv)
    try:
        module = build_model(args.module, args.model_config, parse_pairs(args.model_arg, "--model-arg"))
        data = load_object(args.data, "--data")(batch_size=args.batch_size, **parse_pairs(args.data_arg, "--data-arg"))
        config = Par3DConfig(**parse_pairs(args.layout, "--layout"))
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    except (ValueError, TypeError) as error:
        print(f"par3d dry-run: bad input: {error}", file=sys.stderr)
        return 2
    print(f"model: {describe_model(module)}", flush=True)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        result = dry_run(
            module, config, args.world_size, batch, ranks=ranks, precision=args.precision, steps=args.steps
        )
    except ValueError as error:  # the configuration's own checks, before any rank runs
        print(f"par3d dry-run: bad input: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        print(f"par3d dry-run: a rank's step failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(result)
    return 0
