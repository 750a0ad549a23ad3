"""The package's layers: every module imports, no import cycle, lower layers never import higher ones, and the core
imports no front-end framework. Imports are read from the source (module level and inside functions alike)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import lightning_par3d

ROOT = Path(lightning_par3d.__file__).parent
PACKAGE = "lightning_par3d"

LAYERS: list[tuple[str, ...]] = [
    # 0: vocabularies and name patterns, and the private torch APIs par3d uses, importing nothing of par3d
    (
        "patterns",
        "torch_private",
        "fresh_interpreter",
        "console",
        "parallel.styles",
        "parallel.local_styles",
        "pipeline.schedules",
        "parallel",
        "pipeline",
        "zero",
        "memory",
        "checkpoint",
    ),
    # 1: the configuration
    ("config",),
    # 2: one concern each: the mesh, each parallelism, the pipeline pieces, ZeRO
    ("parallel.*", "pipeline.*", "zero.*"),
    # 3: what composes them, and what reads their results
    ("parallel.parallelize", "checkpoint.*", "memory.meters"),
    # 4: the engine, and the estimator (which simulates what the engine builds; in a fresh interpreter for a rank)
    ("engine", "elastic", "memory.estimate", "memory.estimate_process", "planning", "planning.*", "plan"),
    # 5: front-ends and observers
    ("integrations", "integrations.*", "callbacks", "callbacks.*", "accelerate", "transformers", "smoke"),
    # 6: the public package
    ("",),
]
FRONT_END_FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "hydra", "omegaconf")
CORE_LAYERS = 4  # layers 0..4 may not import a front-end framework


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(name: str) -> int:
    """The layer of a module name relative to the package (the most specific pattern wins)."""
    best: tuple[int, int] | None = None
    for number, patterns in enumerate(LAYERS):
        for pattern in patterns:
            if pattern == name:
                return number
            if pattern.endswith(".*") and name.startswith(pattern[:-1]):
                specificity = len(pattern)
                if best is None or specificity > best[1]:
                    best = (number, specificity)
    assert best is not None, f"{name!r} has no layer in tests/test_layers.py; give it one"
    return best[0]


def _modules() -> dict[str, Path]:
    return {_name(path): path for path in ROOT.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> tuple[set[str], set[str]]:
    """(par3d modules, other top-level packages) that the file imports anywhere."""
    tree = ast.parse(path.read_text())
    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    inside: set[str] = set()
    outside: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([PACKAGE, *package_parts[: len(package_parts) - node.level + 1]])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                relative = target[len(PACKAGE) + 1 :]
                while relative and relative not in known:
                    relative = relative.rpartition(".")[0]
                if relative != name:
                    inside.add(relative)
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    inside, outside = {}, {}
    for name, path in modules.items():
        inside[name], outside[name] = _imports(path, name, known)
    return inside, outside


def test_every_module_imports():
    for info in pkgutil.walk_packages(lightning_par3d.__path__, PACKAGE + "."):
        importlib.import_module(info.name)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_graph()[0])
    assert not cycles, f"import cycles: {cycles}"


def test_lower_layers_never_import_higher_ones():
    graph, _ = _graph()
    wrong = [
        f"{name or PACKAGE} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_no_front_end_framework():
    _, outside = _graph()
    wrong = [
        f"{name} imports {package}"
        for name, packages in outside.items()
        if _layer(name) <= CORE_LAYERS
        for package in packages & set(FRONT_END_FRAMEWORKS)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_a_cycle_and_a_layer_violation(monkeypatch):
    """The checks above can fail: a module importing upwards, in a cycle, is reported by both."""
    graph, _ = _graph()
    graph["config"].add("engine")  # config → engine → … → config
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: (graph, {"config": {"lightning"}}))
    with pytest.raises(AssertionError, match=r"import cycles: .*'config'.*'engine'"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match=r"config \(layer 1\) imports engine \(layer 4\)"):
        test_lower_layers_never_import_higher_ones()
    with pytest.raises(AssertionError, match="config imports lightning"):
        test_the_core_imports_no_front_end_framework()


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


def test_the_engine_imports_without_lightning_and_the_package_registers_par3d_when_lightning_comes():
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
def test_importing_the_package_registers_par3d_whatever_the_import_order(order):
    got = _fresh(f"import warnings; warnings.simplefilter('error', UserWarning)\n{IMPORT_ORDERS[order]}\n" + REGISTERED)
    assert got == "Par3DStrategy Par3DFabricStrategy"


FRONT_ENDS = {
    "integrations/trainer.py": "Par3DStrategy",
    "integrations/fabric.py": "Par3DFabricStrategy",
    "integrations/accelerate.py": "Par3DAccelerator",
}
FRONT_END_LINES = 200


@pytest.mark.parametrize("path, name", list(FRONT_ENDS.items()))
def test_front_ends_stay_thin_and_use_only_the_engines_public_api(path, name):
    """A front-end translates its framework's hooks into engine calls: its class body stays under 200 lines, and no
    front-end module (its mixins included) or callback reads a private name of the engine (``engine._x``)."""
    tree = ast.parse((ROOT / path).read_text())
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 < FRONT_END_LINES, f"{name} has {cls.end_lineno - cls.lineno + 1} lines"
    for module in sorted([*(ROOT / "integrations").glob("*.py"), *(ROOT / "callbacks").glob("*.py")]):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                inner = node.value
                owner = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
                assert owner != "engine", f"{module.name}:{node.lineno} reads engine.{node.attr}"
