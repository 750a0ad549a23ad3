"""Shared fixtures: the process pools (one spawn per world size per session, ``tests/harness.py``), the background
process-tree cases (``tests/background.py``), the ``new_interpreter`` fixture, and the parity assertions.

**Tiers.** Each test's markers come from what it starts, never from a hand-written marker: ``dist`` from the pool it
asks for (``pool2``, ``pool4``, ``pool8``, ``pool``), ``interpreter`` from a background case or the
``new_interpreter`` fixture (a test that starts an interpreter any other way fails: :func:`_declared_starts`), and
``gpu(n)`` is the devices a test needs. ``quick`` (``make test-quick``) is every test with none of them, plus
:data:`QUICK_PARITY`: one parity case per parallelism and front-end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import background
from tests.constants import LOSS_RTOL, ONE_BATCH_EPOCHS, PARAM_RTOL
from tests.harness import DistPool

_POOLS: dict[int, DistPool] = {}


def _pool(world_size: int) -> DistPool:
    """The session's pool of ``world_size`` ranks, started on first use."""
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def pool2() -> Iterator[DistPool]:
    yield _pool(2)


@pytest.fixture(scope="session")
def pool4() -> Iterator[DistPool]:
    yield _pool(4)


@pytest.fixture(scope="session")
def pool8() -> Iterator[DistPool]:
    yield _pool(8)


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> DistPool:
    """The pool of the world size a test's parameter names, for tests parametrized over world sizes:
    ``@pytest.mark.parametrize("pool", [2, 4], indirect=True)``. (Not ``request.getfixturevalue("pool4")``: the
    ordering below could not see which pool such a test uses, and would stop and restart that pool around it.)"""
    return _pool(request.param)


REQUIRE_GPUS = "PAR3D_REQUIRE_GPUS"
"""With ``PAR3D_REQUIRE_GPUS=N``, a session that sees fewer than N CUDA devices fails at its start instead of
skipping every GPU test (a GPU job that can pass without a GPU is no check at all); GPU tests of a higher tier than N
devices still skip."""


def pytest_sessionstart(session: pytest.Session) -> None:
    required = os.environ.get(REQUIRE_GPUS)
    if not required:
        return
    found = torch.cuda.device_count()
    if found < int(required):
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build: no CUDA")
        pytest.exit(
            f"{REQUIRE_GPUS}={required}, but no GPU was found: torch sees {found} CUDA device(s) ({build}). Install "
            "the CUDA build of torch on a machine with the GPUs, or unset it to let the GPU tests skip.",
            returncode=3,
        )


def gpus_needed(item: pytest.Item) -> int | None:
    """The CUDA devices a ``gpu``-marked test needs (``@pytest.mark.gpu(4)``; 2 without a count), else None."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    return int(marker.args[0]) if marker.args else 2


POOL_FIXTURES = {"pool2": 2, "pool4": 4, "pool8": 8}


def pools_of(item: pytest.Item) -> set[int]:
    """The world sizes of the pools a test asks for (``pool2``, ``pool4``, ``pool8``, or ``pool`` with its size as
    the test's parameter)."""
    names = getattr(item, "fixturenames", ())
    sizes = {POOL_FIXTURES[name] for name in names if name in POOL_FIXTURES}
    if "pool" in names:
        sizes.add(item.callspec.params["pool"])  # type: ignore[attr-defined]
    return sizes


QUICK_PARITY = (
    "tests/test_parity.py::test_parity_two_ranks[dp_shard=2]",  # FSDP2 (ZeRO-3), the Trainer
    "tests/test_parity.py::test_parity_two_ranks[tp=2]",  # tensor parallelism
    "tests/test_zero.py::test_parity_each_stage_dp2[0]",  # DDP
    "tests/test_zero.py::test_parity_each_stage_dp2[1]",  # ZeRO-1
    "tests/test_zero.py::test_parity_each_stage_dp2[2]",  # ZeRO-2
    "tests/test_pipeline.py::test_parity_pp2_one_stage_per_rank[1f1b]",  # pipeline parallelism
    "tests/test_accelerate.py::test_accelerate_parity_two_ranks[dp_shard=2]",  # Accelerate
    "tests/test_fabric_and_checkpoint.py::test_fabric_parity_dp2_tp2[plain]",  # Fabric
    "tests/test_parity.py::test_parity_four_ranks[hsdp=2x2]",  # HSDP
    "tests/test_context_parallel.py::test_gpt_parity_four_ranks[cp=2xdp_shard=2]",  # context parallelism
)
"""The parity cases of the quick tier: one per parallelism and front-end (a test of this list that disappears fails
the tier's check, ``tests/test_tiers.py``)."""
INTERPRETER_FIXTURE = "new_interpreter"
STARTS_INTERPRETERS = ("python", "torchrun", "accelerate", "lint-imports", "par3d")
"""Commands (by the start of their executable's name) that start a Python interpreter."""


@pytest.fixture
def new_interpreter() -> Callable[..., subprocess.CompletedProcess]:
    """What a test asks for when it starts a Python interpreter itself (``subprocess``, a console script, or par3d's
    fresh interpreter for a dry run, an estimate or advice): ``run(args, timeout=300, **kwargs)``, a
    ``subprocess.run`` capturing text. Asking for it marks the test ``interpreter`` (outside the quick tier)."""

    def run(args: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)

    return run


def starts_interpreter(item: pytest.Item) -> bool:
    """Whether the test starts interpreters: a background case, or the ``new_interpreter`` fixture."""
    return bool(background.cases_of(item)) or INTERPRETER_FIXTURE in getattr(item, "fixturenames", ())


@pytest.fixture(autouse=True)
def _declared_starts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``interpreter`` that starts an interpreter (or par3d's fresh interpreter) fails, naming the
    fixture to ask for: the marker cannot be wrong, so the quick tier never starts one."""
    if request.node.get_closest_marker("interpreter") or request.node.get_closest_marker("gpu"):
        return
    message = (
        f"{request.node.nodeid} starts a Python interpreter without asking for the `{INTERPRETER_FIXTURE}` fixture, "
        "which marks it `interpreter` (outside the quick tier). Add the fixture to the test's arguments."
    )
    original = subprocess.Popen.__init__

    def guarded(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        first = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        name = Path(str(first)).name
        test_thread = threading.current_thread() is threading.main_thread()  # background cases run on their own
        if test_thread and (str(first) == sys.executable or name.startswith(STARTS_INTERPRETERS)):
            raise AssertionError(message)
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    from lightning_par3d.utils import fresh_interpreter

    call = fresh_interpreter.call

    def refused(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            raise AssertionError(message)
        return call(*args, **kwargs)

    monkeypatch.setattr(fresh_interpreter, "call", refused)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks each test by what it starts (see the module docstring), as it is collected: before ``-m`` selects."""
    if pools_of(item):
        item.add_marker(pytest.mark.dist)
    if starts_interpreter(item):
        item.add_marker(pytest.mark.interpreter)
    started = [m for m in ("dist", "interpreter", "gpu") if item.get_closest_marker(m)]
    if not started or item.nodeid in QUICK_PARITY:
        item.add_marker(pytest.mark.quick)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests run by the pool they use: first those without one, then those of 2 ranks, of 4, of 8, so that each pool
    starts once and no idle pool waits beside a busy one (an idle worker's gloo groups still poll). The tests that
    check background cases run last, when their cases have had the whole session to run. Within each part the
    collection order is kept."""

    def order(item: pytest.Item) -> tuple[bool, int, int]:
        sizes = pools_of(item) or {0}
        return bool(background.cases_of(item)), max(sizes), min(sizes)  # (2, 4) before (4,): pool 2 stops once

    items.sort(key=order)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips a GPU test where fewer devices than its tier are visible (see :data:`REQUIRE_GPUS`). Stops the pools
    this test does not use: with the order above, a pool is done once the next size starts (a stopped pool starts
    again if a later test runs a job on it)."""
    needed = gpus_needed(item)
    if needed is not None and torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA devices; {torch.cuda.device_count()} visible")
    wanted = pools_of(item)
    for size, stopped in _POOLS.items():
        if size not in wanted:
            stopped.close()


@pytest.fixture(scope="session", autouse=True)
def _background_cases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Starts, at the session's first test, the background cases that the selected tests ask for (and no other)."""
    wanted = [case for item in request.session.items for case in background.cases_of(item)]
    for _, name, param in sorted(wanted, key=lambda case: case[0]):  # stable: in the tests' order within an order
        background.start(name, param, tmp_path_factory)
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    background.stop()
    for p in _POOLS.values():
        p.close()


def assert_parity(got: dict, ref: dict) -> None:
    """Per-step losses within rtol 1e-4, and every parameter tensor within rtol 1e-4 of the reference.

    Parameters are compared tensor by tensor, relative to the tensor's scale: elementwise
    ``|got - ref| <= 1e-4 * (|ref| + max|ref|)`` and ``||got - ref|| <= 1e-4 * ||ref||``. A weight that Adam
    has moved through zero has no meaningful elementwise relative error, so the tolerance floor is the tensor's own
    magnitude, never a fixed atol. A wrong shard, a missed reduction or a skipped step moves weights by O(lr) = 3e-3
    against a tolerance of about 1e-5, and fails.
    """
    assert len(got["losses"]) == len(ref["losses"]), (got["losses"], ref["losses"])
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0.0, msg="per-step losses"
    )
    params, ref_params = got["params"], ref["params"]
    assert params is not None and sorted(params) == sorted(ref_params), "parameter names differ"
    for name, expected in ref_params.items():
        actual = params[name].to(expected.dtype)
        scale = expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=PARAM_RTOL, atol=PARAM_RTOL * scale, msg=name)
        rel = ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        assert rel <= PARAM_RTOL, f"{name}: relative error {rel:.2e} > {PARAM_RTOL}"


def assert_resume_continues(pool: DistPool, directory: str, steps: int, **run: object) -> None:
    """Trains ``steps`` steps uninterrupted, and ``steps // 2`` then a resume to ``steps`` from the sharded
    checkpoint in ``directory``, with ``run_par3d(**run)`` on ``pool``: the resumed losses and final parameters equal
    the uninterrupted ones within 1e-6 (one-batch epochs, so the data order does not depend on where Lightning's
    loop restarts)."""
    from tests.gpt_runs import run_par3d

    def train(**more: object) -> dict:
        return pool.run(run_par3d, data=ONE_BATCH_EPOCHS, **run, **more)[0]

    whole = train(max_steps=steps)
    train(max_steps=steps // 2, ckpt_dir=directory)
    resumed = train(max_steps=steps, resume_from=f"{directory}/last.ckpt")
    half = steps - steps // 2
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][-half:]), rtol=0, atol=1e-6
    )
    for name, value in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6, msg=name)
