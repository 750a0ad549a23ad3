"""``par3d``: the command line (installed with the package; also ``python -m lightning_par3d``).

    par3d plan         which layout to train with, ranked for a world of devices (nothing launched)
    par3d dry-run      a training step of chosen ranks of any layout, here, over a fake process group
    par3d smoke        a few steps of your model at a layout against data parallelism, for CI (exit 0/1/2)
    par3d export-hf    a par3d checkpoint of a transformers model → a save_pretrained directory
    par3d consolidate  a par3d checkpoint → one file torch.load reads (nothing in it is run)

``par3d <command> --help`` shows each command's options and an example. Training itself is the Lightning Trainer,
Fabric or Accelerate with the par3d strategy, or the Hydra app (``python examples/train.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _plan(argv: list[str]) -> int:
    from lightning_par3d.tools.plan import main

    return main(argv)


def _dry_run(argv: list[str]) -> int:
    from lightning_par3d.tools.dry_run_command import main

    return main(argv)


def _smoke(argv: list[str]) -> int:
    from lightning_par3d.tools.smoke import main

    return main(argv)


def _export_hf(argv: list[str]) -> int:
    from lightning_par3d.tools.export_hf import main

    return main(argv)


def _consolidate(argv: list[str]) -> int:
    from lightning_par3d.tools.consolidate_command import main

    return main(argv)


HELP = """par3d: the command line of lightning_par3d (also: python -m lightning_par3d)

  par3d plan         which layout to train with, ranked for a world of devices (nothing launched)
  par3d dry-run      a training step of chosen ranks of any layout, here, over a fake process group
  par3d smoke        a few steps of your model at a layout against data parallelism, for CI (exit 0/1/2)
  par3d export-hf    a par3d checkpoint of a transformers model -> a save_pretrained directory
  par3d consolidate  a par3d checkpoint -> one file torch.load reads (nothing in it is run)

par3d <command> --help shows each command's options and an example."""

COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "plan": _plan,
    "dry-run": _dry_run,
    "smoke": _smoke,
    "export-hf": _export_hf,
    "consolidate": _consolidate,
}
"""Each subcommand, imported when it runs (``par3d --help`` imports no torch)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(HELP)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"par3d: {command!r} is not a command. Commands: {', '.join(COMMANDS)} (par3d --help).", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    raise SystemExit(main())
