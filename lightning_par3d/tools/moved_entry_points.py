"""The module entry points of 0.1's first builds, kept working for one release: ``python -m lightning_par3d.plan``,
``python -m lightning_par3d.smoke`` and ``python -m lightning_par3d.transformers`` (also under ``torchrun -m``).

They became subcommands of ``par3d`` (``par3d plan``, ``par3d smoke``, ``par3d export-hf``) when the package was laid
out by job; a user's CI that called the old names broke without a word. Each old name now runs its new command with
the same arguments, after one line on stderr that names the command to call instead.

No file carries the old names: ``lightning_par3d/plan.py`` would bind the submodule over the package's ``plan``
function on import, ``transformers.py`` would shadow the ``transformers`` package wherever the package's own folder
comes onto ``sys.path`` (as ``accelerate.py`` did), and two files of one name break the rule that a file name says
what it holds. Instead a finder on ``sys.meta_path`` (installed by the package's ``__init__``) answers the three
names: ``python -m`` (runpy) asks its loader for the code to run as ``__main__``. Imported as modules rather than run,
``lightning_par3d.smoke`` and ``lightning_par3d.transformers`` give the new modules' names with a ``FutureWarning``;
``import lightning_par3d.plan`` is refused, since it would replace the package's ``plan`` function.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

REMOVED_IN = "0.3.0"
"""The release that drops the old names (0.2.0 keeps them, printing the new command)."""


@dataclass(frozen=True)
class MovedEntryPoint:
    old: str  # the module name users ran, under the package
    new_module: str  # where its ``main`` lives now
    command: str  # what to type instead

    def notice(self, package: str) -> str:
        return (
            f"`python -m {package}.{self.old}` is now `{self.command}` (or `python -m {package} "
            f"{self.command.split(maxsplit=1)[1]}`), with the same arguments; the old name works until "
            f"lightning-par3d {REMOVED_IN}."
        )


MOVED: dict[str, MovedEntryPoint] = {
    entry.old: entry
    for entry in (
        MovedEntryPoint("plan", "lightning_par3d.tools.plan", "par3d plan"),
        MovedEntryPoint("smoke", "lightning_par3d.tools.smoke", "par3d smoke"),
        MovedEntryPoint("transformers", "lightning_par3d.tools.export_hf", "par3d export-hf"),
    )
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, package: str, entry: MovedEntryPoint) -> None:
        self.package = package
        self.entry = entry

    def get_code(self, fullname: str) -> types.CodeType:
        """What ``python -m`` runs as ``__main__``: the notice, then the new command's ``main``."""
        source = (
            "import sys\n"
            f"print({self.entry.notice(self.package)!r}, file=sys.stderr, flush=True)\n"
            f"from {self.entry.new_module} import main\n"
            "raise SystemExit(main())\n"
        )
        return compile(source, f"<{fullname}: moved to {self.entry.new_module}>", "exec")

    def get_source(self, fullname: str) -> None:
        return None

    def is_package(self, fullname: str) -> bool:
        return False

    def exec_module(self, module: types.ModuleType) -> None:
        """An import (not a run) of the old name: the new module's names, with a FutureWarning."""
        if self.entry.old == "plan":
            raise ImportError(
                f"{self.package}.plan is the planning function (`from {self.package} import plan`); the command's "
                f"module is {self.entry.new_module} (`{self.entry.command}`).",
                name=module.__name__,
            )
        warnings.warn(
            f"{module.__name__} moved to {self.entry.new_module} (the command: `{self.entry.command}`); the old "
            f"name goes in lightning-par3d {REMOVED_IN}.",
            FutureWarning,
            stacklevel=2,
        )
        new = importlib.import_module(self.entry.new_module)
        module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})


class MovedEntryPointFinder(importlib.abc.MetaPathFinder):
    """Finds ``<package>.plan``, ``.smoke`` and ``.transformers`` (and nothing else) for :data:`MOVED`."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != self.package or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(self.package, MOVED[name]))


def install(package: str) -> None:
    """Put the finder on ``sys.meta_path`` once (after the path finders: a real module of the name would win)."""
    if not any(isinstance(f, MovedEntryPointFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(MovedEntryPointFinder(package))
