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


LAUNCHING = frozenset({"smoke"})
"""The commands whose process is a rank of a job (process groups, gloo's threads): as a process of its own (the
console script, ``python -m``), it ends without the interpreter's teardown (:func:`_end_without_teardown`)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(HELP)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"par3d: {command!r} is not a command. Commands: {', '.join(COMMANDS)} (par3d --help).", file=sys.stderr)
        return 2
    code = COMMANDS[command](rest)
    if argv is None and command in LAUNCHING:  # this process is the command (not a caller's function call)
        _end_without_teardown(code)
    return code


def _end_without_teardown(code: int) -> None:
    """Ends this process with ``code`` once its exit handlers have run (par3d's, which destroy every process group,
    and Lightning's), skipping the interpreter's teardown.

    A rank whose work is done could still abort in that teardown ("terminate called without an active exception",
    SIGABRT, exit -6, after printing its result): Python 3.11 ends a thread that asks for the interpreter lock after
    finalization began with ``pthread_exit``, whose unwinding through torch's C++ frames calls ``std::terminate`` (the
    likeliest cause: gloo's threads freeing tensors that Python owns). Seen about once per full test suite on a
    2-core machine, in ``par3d smoke``'s rank 0 after its verdict. What a process of this command has to say is said
    by then; the operating system reclaims the rest."""
    import atexit
    import os

    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's: what exit runs first, then the teardown
    if callable(run_handlers):
        run_handlers()
    else:  # another interpreter: at least par3d's own
        from lightning_par3d.distributed.groups import destroy_groups_now

        destroy_groups_now()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
