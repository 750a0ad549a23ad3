"""The package's layers, which import-linter checks (``make lint``: the contracts in ``pyproject.toml``, top to
bottom, and the core free of front-end frameworks), shown to fail on an upward import; every module imports; no
module imports par3d's own code by name at run time, where the linter cannot see it; Lightning's registration; and
the front-ends and the engine stay small."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_par3d

ROOT = Path(lightning_par3d.__file__).parent
REPO = ROOT.parent
PACKAGE = "lightning_par3d"
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def test_every_module_imports():
    for info in pkgutil.walk_packages(lightning_par3d.__path__, PACKAGE + "."):
        importlib.import_module(info.name)


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with this repository's contracts, on the package found first in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [LINT_IMPORTS, "--config", str(REPO / "pyproject.toml"), "--no-cache"]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_contract_holds_and_fails_on_an_upward_import(new_interpreter, tmp_path):
    """The tree as it is keeps both contracts; a copy in which the configuration imports the engine breaks the
    layers one, naming the import."""
    done = _lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout
    shutil.copytree(ROOT, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / PACKAGE / "config" / "upward.py").write_text("from lightning_par3d.engine import Par3DEngine\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout[-3000:]
    assert "par3d's layers BROKEN" in broken.stdout
    assert "lightning_par3d.config.upward -> lightning_par3d.engine" in broken.stdout


def _dynamic_imports_of_par3d(tree: ast.AST) -> list[int]:
    """Lines that import a module of par3d by a name given as a string (``importlib.import_module``,
    ``__import__``), which no import linter sees."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        first = node.args[0]
        literal = first.value if isinstance(first, ast.Constant) else None
        if name in ("import_module", "__import__") and isinstance(literal, str) and literal.startswith(PACKAGE):
            lines.append(node.lineno)
    return lines


def test_no_module_imports_par3d_by_a_string():
    """Every import of par3d's own code is an import statement the linter reads; ``import_module`` loads a user's
    module named on a command line, nothing of ours."""
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(ROOT.rglob("*.py"))
        if (lines := _dynamic_imports_of_par3d(ast.parse(path.read_text())))
    }
    assert not found, found
    assert _dynamic_imports_of_par3d(ast.parse("importlib.import_module('lightning_par3d.engine')")) == [1]


def _fresh(code: str) -> str:
    """``code`` run by a fresh interpreter (nothing imported yet); its stdout."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


REGISTERED = (
    "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
    "from lightning.pytorch.strategies import StrategyRegistry\n"
    "print(StrategyRegistry['par3d']['strategy'].__name__, STRATEGY_REGISTRY['par3d']['strategy'].__name__)"
)


def test_the_engine_imports_without_lightning_and_the_package_registers_par3d_when_lightning_comes(new_interpreter):
    """A plain torch loop or an Accelerate script that imports the engine pays no Lightning import; importing
    Lightning afterwards still registers "par3d" with the Trainer and Fabric."""
    got = _fresh(
        "import sys, warnings; warnings.simplefilter('error', UserWarning)\n"
        "import lightning_par3d.engine\n"
        "print('lightning' in sys.modules)\n"
        "import lightning\n" + REGISTERED
    )
    assert got.splitlines() == ["False", "Par3DStrategy Par3DFabricStrategy"]


IMPORT_ORDERS = {
    "lightning first": "import lightning, lightning_par3d",
    "strategy class first": "from lightning_par3d import Par3DStrategy; import lightning",
}


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_importing_the_package_registers_par3d_whatever_the_import_order(new_interpreter, order):
    got = _fresh(f"import warnings; warnings.simplefilter('error', UserWarning)\n{IMPORT_ORDERS[order]}\n" + REGISTERED)
    assert got == "Par3DStrategy Par3DFabricStrategy"


FRONT_ENDS = ("integrations", "callbacks", "tools")
CLASS_LINES = 300
FRONT_END_CLASS_LINES = 200
ENGINE_FILE_LINES = 400


def test_no_class_is_a_god_class_and_the_engine_is_split_by_job():
    """No class of the package spans more than 300 lines, no front-end class (``integrations/``: glue that
    translates a framework's hooks to the engine) more than 200, and no module of the engine more than 400."""
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        limit = FRONT_END_CLASS_LINES if path.parent.name == "integrations" else CLASS_LINES
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {node.end_lineno - node.lineno + 1}")
        if path.parent.name == "engine" and len(source.splitlines()) > ENGINE_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
    assert not too_long, too_long


def test_front_ends_use_only_the_engines_public_api():
    """No front-end, callback or tool reads a private name of the engine (``engine._x``)."""
    for folder in FRONT_ENDS:
        for module in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(module.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    inner = node.value
                    owner = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
                    assert owner != "engine", f"{module.name}:{node.lineno} reads engine.{node.attr}"


def test_no_two_modules_of_the_package_share_a_file_name():
    """A module's file name says what it holds, once: ``hf.py``, ``styles.py`` or ``adapters.py`` in two packages
    meant two different things under one name (``__init__.py`` and ``__main__.py`` aside)."""
    seen: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_no_module_of_the_package_is_named_like_a_package_users_import():
    """With ``lightning_par3d/`` itself on ``sys.path`` (a script run from inside it, a fresh interpreter), a module
    named ``accelerate.py`` shadowed the ``accelerate`` package; ``lightning_par3d.accelerate`` is a name the
    package gives its Accelerate front-end, without a file."""
    import importlib.util

    names = {path.stem for path in ROOT.rglob("*.py")} - {"__init__", "__main__"}
    shadowing = names & {"accelerate", "lightning", "torch", "transformers", "peft", "hydra"}
    assert shadowing == set()
    assert importlib.util.find_spec("accelerate") is not None
    from lightning_par3d.accelerate import Par3DAccelerator  # the alias users import keeps working

    assert Par3DAccelerator.__module__ == "lightning_par3d.integrations.accelerator"


@pytest.mark.parametrize(
    "old, command", [("plan", "par3d plan"), ("smoke", "par3d smoke"), ("transformers", "par3d export-hf")]
)
def test_the_old_module_entry_points_run_the_new_command_and_name_it(old, command, capsys, monkeypatch):
    """``python -m lightning_par3d.<old>`` (what runpy does for ``-m``) runs the new command with the same arguments,
    after a line naming it; the package's ``plan`` function stays the function."""
    import runpy

    monkeypatch.setattr(sys, "argv", [old, "--help"])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module(f"lightning_par3d.{old}", run_name="__main__")
    assert ended.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: {command} ")
    assert f"`python -m lightning_par3d.{old}` is now `{command}`" in err
    assert lightning_par3d.plan.__module__ == "lightning_par3d.planning.planner"
    with pytest.raises(ImportError, match="is the planning function"):
        importlib.import_module("lightning_par3d.plan")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_par3d.no_such_command")


def test_an_old_entry_point_runs_from_the_real_interpreter(new_interpreter, tmp_path):
    """A user's CI line, unchanged: ``python -m lightning_par3d.transformers CKPT OUT --config DIR`` reaches
    ``par3d export-hf``, which refuses a config directory without a ``config.json`` by name (exit 2)."""
    done = new_interpreter(
        [
            sys.executable,
            "-m",
            "lightning_par3d.transformers",
            str(tmp_path / "missing"),
            str(tmp_path / "out"),
            "--config",
            str(tmp_path),
        ],
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "is now `par3d export-hf`" in done.stderr
    assert f"{tmp_path}. Should have a `model_type` key in its config.json" in done.stderr


def test_the_private_framework_apis_par3d_uses_are_where_they_were_read():
    """Every private Lightning name of ``integrations/framework_private.py`` resolves, and Accelerate's ``Accelerator``
    still has the private attributes and methods par3d uses: an upgrade that moves one fails here, by name."""
    import inspect

    from accelerate import Accelerator

    from lightning_par3d.integrations import framework_private

    for name, (module, private) in framework_private._LIGHTNING.items():
        assert getattr(framework_private, name) is getattr(importlib.import_module(module), private), name
    init = inspect.getsource(Accelerator.__init__)
    for attribute in framework_private.ACCELERATOR_ATTRIBUTES:
        assert f"self.{attribute} = " in init, f"Accelerator no longer sets {attribute} in __init__"
    for method in framework_private.ACCELERATOR_METHODS:
        assert callable(getattr(Accelerator, method, None)), f"Accelerator has no {method} to override"


def test_no_other_module_imports_a_private_name_of_lightning_or_accelerate():
    """Private Lightning and Accelerate names come through ``integrations/framework_private.py`` only."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "framework_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "accelerate"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [node.module] if any(part.startswith("_") for part in (node.module or "").split(".")) else []
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in private]
    assert found == []


def test_every_name_the_engine_reads_from_a_part_is_that_parts():
    """The engine's facade names that are its parts' (``engine.layout`` is ``engine.placement.layout``,
    ``engine.save`` is ``engine.saves.save``) exist on those parts, and read through to them."""
    from lightning_par3d.config import Par3DConfig
    from lightning_par3d.engine import Par3DEngine
    from lightning_par3d.utils.parts import parts_of

    engine = Par3DEngine(Par3DConfig(dp_shard=2, tp=2))
    forwarded = parts_of(Par3DEngine)
    assert {"layout", "mesh", "resolve", "setup", "reduce", "save", "load"} <= set(forwarded)
    missing = [f"{part}.{name}" for name, part in forwarded.items() if name not in dir(getattr(engine, part))]
    assert missing == []
    assert engine.config is engine.placement.config and engine.background is engine.saves.background
    engine.precision = "bf16-mixed"  # written through, where a front-end sets it
    assert engine.placement.precision == "bf16-mixed"
    assert engine.resolve(4).tp == 2 and engine.layout is engine.placement.layout
