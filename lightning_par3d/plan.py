"""``python -m lightning_par3d.plan``: which layout to train with (see :mod:`lightning_par3d.planning.cli`).

    python -m lightning_par3d.plan --module examples.gpt:GPTModule --world-size 8 --devices-per-node 8 \\
        --memory 80GiB --batch 16 --seq 64 --profile h100-sxm-8 [--fixed tp=2] [--plot plan.png]

The module is also callable: ``lightning_par3d.plan(...)`` is :func:`lightning_par3d.planning.plan`. (Importing
this module binds the name ``plan`` in the package to the module, so where the package exports the function as
``plan`` too, the name works either way.)
"""

from __future__ import annotations

import sys
import types
from typing import Any

from lightning_par3d.planning.cli import main
from lightning_par3d.planning.planner import plan as _plan


class _CallablePlanModule(types.ModuleType):
    """This module, callable as :func:`lightning_par3d.planning.plan`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePlanModule

if __name__ == "__main__":
    raise SystemExit(main())
