"""Registering ``"par3d"`` with Lightning's Trainer and Fabric, without importing Lightning before its user does.

This module sits above the front-ends (it imports them once Lightning is there); the front-ends register themselves
through :mod:`lightning_par3d.integrations.registry`, which imports neither, so no import goes round in a circle.

``import lightning_par3d`` must make ``Trainer(strategy="par3d")`` and ``Fabric(strategy="par3d")`` work, and
``import lightning_par3d.engine`` (a plain torch loop, Accelerate) must not import Lightning at all: importing it
takes seconds. Lightning has no entry point for strategies, so :func:`register_when_lightning_loads` registers at
once when ``lightning`` is already imported (the usual ``import lightning as L`` first), and otherwise adds a finder
to ``sys.meta_path`` that registers right after the ``lightning`` package has finished importing (its ``__init__``
imports both the Trainer's and Fabric's strategy registries), then removes itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any


def register() -> None:
    """Imports the Trainer and Fabric strategies (and with them Lightning); each registers itself at the end of its
    module (:mod:`lightning_par3d.integrations.registry`). A module that is importing right now (it imported
    Lightning, which brought us here) registers when it finishes."""
    import lightning_par3d.integrations.fabric
    import lightning_par3d.integrations.trainer  # noqa: F401


def register_when_lightning_loads() -> None:
    """:func:`register` now if Lightning is imported, else right after it is (see the module docstring); nothing if
    Lightning is not installed."""
    if "lightning" in sys.modules and "lightning.pytorch.strategies" in sys.modules:
        register()
    elif importlib.util.find_spec("lightning") is not None and not any(
        isinstance(finder, _AfterLightning) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterLightning())


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` as the other finders do, and has its loader call :func:`register` once the package has
    executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)  # once: the real finders find it, and a nested import never comes back here
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            register()
        except Exception as error:  # never break the user's `import lightning`
            warnings.warn(f"par3d could not register its strategies with Lightning: {error!r}", stacklevel=2)
