"""Faults, each in its own process tree (``tests/fault_script.py``, Lightning's subprocess launcher, timeout_s=20):
a rank killed, stalled or raising ends the whole job within timeout_s + 30 s, non-zero, with no process left, and
the output names the rank; a save killed part-way leaves the previous checkpoint, which resumes on the
single-process trajectory.

The trees run a few at a time (:func:`_run_waves`), so that their waiting overlaps, and in the background of the
session (``tests/background.py``): they start at a lower CPU priority, and each is put ahead of the pooled jobs the
moment its fault happens, so that how long the job then takes to end is measured as on a machine that is not running
a test suite beside it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests import background, preloaded
from tests.gpt_runs import run_par3d, run_reference

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).with_name("fault_script.py")
TIMEOUT_S = 20
FAULT_STEP = 3
TREE_LIMIT_S = 600  # a tree still running after this has hung: killed, and its case fails
PAST_DUE_S = 30  # a tree still running this long after it should have ended is killed (its case fails)
ONE_BATCH = dict(max_bytes=257, val_fraction=0.0)  # the fault script's data: 8 windows, one global batch per epoch


@dataclass(frozen=True)
class Case:
    name: str
    layout: dict
    devices: int
    fault: str
    rank: int
    kill_save: str = ""


@dataclass
class Outcome:
    returncode: int
    output: str
    ended_after_fault_s: float
    left_behind: list[int]
    marks: dict[str, float]
    """When each rank's ``fit`` raised (``raised<rank>``) and its interpreter began to exit (``atexit<rank>``), in
    seconds after the fault: where a slow end spent its time."""

    def timing(self) -> str:
        marks = ", ".join(f"{name} +{s:.1f}" for name, s in sorted(self.marks.items(), key=lambda item: item[1]))
        return f"ended at +{self.ended_after_fault_s:.1f} s after the fault" + (f" ({marks})" if marks else "")


FAULTS = [
    Case("kill rank 0, dp", dict(dp_shard=2), 2, "kill", 0),
    Case("kill rank 1, dp", dict(dp_shard=2), 2, "kill", 1),
    Case("kill rank 0, DDP", dict(dp_replicate=2), 2, "kill", 0),
    Case("kill rank 1, DDP", dict(dp_replicate=2), 2, "kill", 1),
    Case("kill rank 0, pp", dict(pp=2), 2, "kill", 0),
    Case("kill rank 1, pp", dict(pp=2), 2, "kill", 1),
    Case("stall rank 0, dp", dict(dp_shard=2), 2, "stall", 0),
    Case("stall rank 1, dp", dict(dp_shard=2), 2, "stall", 1),
    Case("stall rank 0, pp", dict(pp=2), 2, "stall", 0),
    Case("stall rank 1, pp", dict(pp=2), 2, "stall", 1),
    Case("stall rank 0, dp x tp", dict(dp_shard=2, tp=2), 4, "stall", 0),
    Case("stall rank 3, dp x tp", dict(dp_shard=2, tp=2), 4, "stall", 3),
    Case("raise on rank 1 in one step", dict(dp_shard=2), 2, "raise", 1),
]
KILLED_SAVES = [
    Case(f"kill rank {r} {point}", dict(dp_shard=2), 2, "none", 0, kill_save=f"{r}:{point}")
    for r, point in [(0, "writing"), (1, "writing"), (0, "before_meta"), (0, "between_renames")]
]


def _launch(case: Case, out: Path) -> tuple[preloaded.Process, Path]:
    """Starts the case's launcher (rank 0) as a fork of the preloaded server; Lightning's subprocess launcher then
    starts the other ranks as ``[sys.executable, script, *args]``, which the server's stand-in ``python`` makes forks
    of the server too (``tests/preloaded.py``)."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if case.kill_save:
        env["KILL_SAVE"] = case.kill_save
    args = [str(out), json.dumps(case.layout), str(case.devices), case.fault, str(case.rank), str(FAULT_STEP)]
    if case.kill_save:
        args.append("checkpoints")
    log = out / "output.txt"
    return background.start_script([str(SCRIPT), *args], out, log, log, env), log


@dataclass
class Tree:
    """A running case: its launcher process (rank 0), output folder and log, and when it started."""

    case: Case
    proc: preloaded.Process
    out: Path
    log: Path
    started: float
    deadline: float | None = None
    """Set when the launcher has ended: by then every other process of the job must have ended too."""
    priority_raised: bool = False


def _fault_at(out: Path) -> float | None:
    return float((out / "fault_at").read_text()) if (out / "fault_at").exists() else None


def _pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("pid*")]


def _ended(tree: Tree) -> bool:
    """Whether the job is over: its launcher and every rank have ended, or the launcher has and the others are
    past their deadline (the fault plus timeout_s + 30 s, or 10 s at least), or the tree is past its limit. The
    launcher (rank 0) may be the rank killed; the others must then end on their own. The tree is put ahead of the
    pooled jobs (``background.raise_priority``) once its fault has happened or its launcher has ended."""
    fault_at = _fault_at(tree.out)
    if not tree.priority_raised and (fault_at is not None or tree.proc.poll() is not None):
        for group in {tree.proc.pid, *_pids(tree.out)}:  # the other ranks are forks in sessions of their own
            background.raise_priority(group)
        tree.priority_raised = True
    if time.monotonic() - tree.started > TREE_LIMIT_S:
        return True
    if fault_at is not None and time.time() > fault_at + TIMEOUT_S + 30 + PAST_DUE_S:
        return True
    if tree.proc.poll() is None:
        return False
    if tree.deadline is None:
        tree.deadline = max(time.time() + 10, (fault_at or time.time()) + TIMEOUT_S + 30)
    return time.time() > tree.deadline or not any(_alive(p) for p in _pids(tree.out))


def _collect(tree: Tree) -> Outcome:
    """The job's outcome; any of its processes still alive is killed (and reported as left behind)."""
    try:
        returncode = tree.proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        background.kill_group(tree.proc.pid)
        returncode = tree.proc.wait()
    background.forget(tree.proc)
    noticed = time.time()
    left = [p for p in _pids(tree.out) if _alive(p)]
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, 9)
    # The job ended when its last process did: the server that forked them reaped each and noted when. (The loop
    # above notices later, by up to a few seconds on a busy machine.)
    ends = [preloaded.ended_at(pid) for pid in {tree.proc.pid, *_pids(tree.out)}]
    ended = max(e for e in ends if e is not None) if not left and all(e is not None for e in ends) else noticed
    fault_at = _fault_at(tree.out) or ended
    stamps = [*tree.out.glob("raised[0-9]"), *tree.out.glob("atexit[0-9]")]
    marks = {p.name: float(p.read_text()) - fault_at for p in stamps}
    marks["noticed"] = noticed - fault_at
    return Outcome(returncode, tree.log.read_text(errors="replace"), ended - fault_at, left, marks)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # a zombie has ended


def _waiting(tree: Tree) -> bool:
    """A stall whose fault has happened: its ranks only wait for the timeout, using no CPU."""
    return tree.case.fault == "stall" and (tree.out / "fault_at").exists()


def _run_waves(cases: list[Case], root: Path, at_once: int = 3) -> dict[str, Outcome]:
    """Runs the cases' process trees, ``at_once`` busy ones at a time, starting the next as soon as one ends or
    stalls; the stalls first, so that their waiting for the timeout overlaps the other trees' work."""
    order = sorted(enumerate(cases), key=lambda item: item[1].fault != "stall")
    outcomes: dict[str, Outcome] = {}
    running: list[Tree] = []
    while order or running:
        while order and sum(not _waiting(tree) for tree in running) < at_once:
            index, case = order.pop(0)
            proc, log = _launch(case, root / f"case{index}")
            running.append(Tree(case, proc, log.parent, log, time.monotonic()))
        done = next((tree for tree in running if _ended(tree)), None)
        if done is None:
            time.sleep(0.2)
            continue
        running.remove(done)
        outcomes[done.case.name] = _collect(done)
    return outcomes


def _all_trees(root: Path) -> tuple[dict[str, Outcome], Path]:
    outcomes = _run_waves(FAULTS + KILLED_SAVES, root)
    ends = {name: outcome.timing() for name, outcome in outcomes.items()}
    (root / "ended_after_fault_s.json").write_text(json.dumps(ends, indent=1))  # the margins, for a person to read
    return outcomes, root


trees = background.fixture("trees", _all_trees, order=0)
"""Every process tree of this module (the faults and the killed saves), run together in the background."""


@pytest.fixture(scope="module")
def fault_outcomes(trees) -> dict[str, Outcome]:
    return trees[0]


def _names_the_rank(case: Case, output: str) -> bool:
    return any(
        sign in output
        for sign in (
            f"Behind: rank(s) [{case.rank}]",
            f"par3d: rank {case.rank} failed",
            f"rank {case.rank} failed first",
            "rank 0 has probably died" if case.rank == 0 else "\0",
            # Lightning's launcher (rank 0) polls its children and, seeing one end, names it and ends the job
            # itself; it can get there before the collectives on rank 0 notice the missing peer.
            f"[rank: {case.rank}] Child process with PID" if case.rank != 0 else "\0",
        )
    )


@pytest.mark.parametrize("case", FAULTS, ids=[c.name for c in FAULTS])
def test_a_failing_rank_ends_the_job(fault_outcomes, case):
    outcome = fault_outcomes[case.name]
    tail = outcome.output[-4000:]
    assert outcome.returncode != 0, tail
    assert outcome.ended_after_fault_s <= TIMEOUT_S + 30, (outcome.timing(), tail)
    assert outcome.left_behind == [], tail
    assert _names_the_rank(case, outcome.output), tail


def test_the_failure_message_carries_the_whole_error():
    """Lightning's launcher may SIGKILL rank 0 before its traceback is printed (it polls the ranks it launched, and
    rank 0 has just ended them): the message printed first must carry every line of the error, not just the first."""
    from lightning_par3d.parallel.faults import describe_failure

    error = ValueError("Tensor parallelism cannot split this model:\n  - tp=2 does not divide a.n_head=3\n  - b")
    message = describe_failure(0, 2, error, timeout_s=20)
    assert message.splitlines()[:3] == [
        "par3d: rank 0 failed: ValueError: Tensor parallelism cannot split this model:",
        "      - tp=2 does not divide a.n_head=3",
        "      - b",
    ]
    many = describe_failure(0, 2, RuntimeError("first\n" + "\n".join(f"line {i}" for i in range(100))), 20)
    assert "    line 39" in many and "line 40" not in many and "(60 more lines)" in many


def test_a_failed_rank_skips_the_shutdown_collection_but_not_the_exit_handlers():
    """The interpreter's shutdown garbage collection took seconds of a failed rank's exit on a busy node: after a
    failure the heap is frozen at exit, and the exit handlers registered before the failure still run."""
    script = (
        "import atexit, gc\n"
        "from lightning_par3d.integrations.lightning_shared import end_job\n"
        "atexit.register(lambda: print('handler ran, frozen objects:', gc.get_freeze_count() > 0))\n"
        "end_job(None, 'par3d: rank 0 failed')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "par3d: rank 0 failed" in done.stderr
    assert done.stdout.strip() == "handler ran, frozen objects: True"


@pytest.fixture(scope="module")
def killed_saves(trees) -> dict[str, tuple[Outcome, Path]]:
    outcomes, root = trees
    first = len(FAULTS)
    return {case.name: (outcomes[case.name], root / f"case{first + i}") for i, case in enumerate(KILLED_SAVES)}


@functools.cache
def one_batch_reference() -> dict:
    return run_reference(max_steps=6, data=ONE_BATCH)


@pytest.mark.parametrize("case", KILLED_SAVES, ids=[c.name for c in KILLED_SAVES])
def test_a_save_killed_part_way_leaves_the_previous_checkpoint(pool2, killed_saves, case):
    outcome, out = killed_saves[case.name]
    assert outcome.returncode != 0, outcome.output[-3000:]
    assert outcome.ended_after_fault_s <= TIMEOUT_S + 30, (outcome.timing(), outcome.output[-3000:])
    assert outcome.left_behind == []
    last = out / "ckpt" / "last.ckpt"
    resumed = pool2.run(run_par3d, strategy=case.layout, devices=2, data=ONE_BATCH, resume_from=str(last))[0]
    whole = one_batch_reference()
    done = len(resumed["losses"])
    assert 0 < done < 6
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][-done:]), rtol=1e-4, atol=0
    )
    for name, value in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-4, atol=1e-4 * value.abs().max().item())
