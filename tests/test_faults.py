"""Faults in a real job: ``python tests/fault_script.py`` on the real interpreter, whose Lightning launcher starts the
other ranks as a user's job does. A rank killed, stalled or raising ends the whole job within ``timeout_s`` + 30 s
of the fault, non-zero, with no process left, and the output names the rank; a save killed part-way leaves the
previous checkpoint, which resumes on the single-process trajectory.

Each case is one process tree, run in the background of the session (``tests/background.py``): selecting one test
runs only its tree. From its fault to its end a tree runs ahead of the pooled jobs (niceness −10, where allowed), so
the time it takes to end is the code's own, not a share of a machine that runs a test suite beside it; that time is
when the last of its processes ended (each is watched through a pidfd), and it goes to ``timing.txt`` in the case's
folder, with when each rank's ``fit`` raised and its interpreter began to exit.

The matrix: each fault on rank 0 (the launcher, whose death the other ranks must notice in their collectives) and on
another rank (whose death the launcher notices), at FSDP2 (``dp_shard``), DDP (``dp_replicate``), the pipeline
(``pp``) and ``dp_shard`` × ``tp``. Every real interpreter costs about 8 s of CPU on a small machine, so cases that
only repeat another case's code path are not run:

* kill rank 1 under DDP and under pp: as under FSDP2 ("kill rank 1, dp"), Lightning's launcher on rank 0 polls the
  ranks it started and ends the job, whatever the layout. (A kill of rank 0 takes each layout's own path, and runs at
  all three.)
* stall rank 0 at dp and at dp_shard × tp: a stalled launcher is "stall rank 0, pp" (its peers wait in the pipeline's
  send/recv, and in the collectives of the step's end); stall rank 1 at pp: a stalled non-launcher is "stall rank 1,
  dp" (collectives time out at ``timeout_s``) and "stall rank 3, dp x tp" (the sub-meshes' own collectives).
* a save killed while rank 0 writes its shard: as while rank 1 writes its own ("kill rank 1 writing"); the launcher's
  death itself is the kill cases above.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests import background
from tests.constants import FAULT_DATA, FAULT_STEP, FAULT_TIMEOUT_S
from tests.gpt_runs import run_par3d, run_reference

SCRIPT = Path(__file__).with_name("fault_script.py")
ENDS_WITHIN_S = FAULT_TIMEOUT_S + 30
"""A job must end within this of its fault."""
PAST_DUE_S = 30
"""A tree still running this long after it should have ended is killed (its case fails)."""
TREE_LIMIT_S = 600
"""A tree still running after this has hung: killed, and its case fails."""
PYTHON = os.path.realpath(sys.executable)
"""The interpreter binary every rank must be (``/proc/<pid>/exe``)."""


@dataclass(frozen=True)
class Case:
    name: str
    layout: dict
    devices: int
    fault: str
    rank: int
    kill_save: str = ""


AUTO_MEASURING = dict(layout="auto", measure=2, plan_machine="h100-sxm-8")
FAULTS = [  # each stall beside a tree that works: a stall's wait for the timeout leaves the CPU to the other case
    Case("stall rank 1, dp", dict(dp_shard=2), 2, "stall", 1),
    Case("kill rank 0, dp", dict(dp_shard=2), 2, "kill", 0),
    Case("stall rank 0, pp", dict(pp=2), 2, "stall", 0),
    Case("kill rank 1, dp", dict(dp_shard=2), 2, "kill", 1),
    Case("stall rank 3, dp x tp", dict(dp_shard=2, tp=2), 4, "stall", 3),
    Case("kill rank 0, DDP", dict(dp_replicate=2), 2, "kill", 0),
    Case("kill rank 0, pp", dict(pp=2), 2, "kill", 0),
    Case("raise on rank 1 in one step", dict(dp_shard=2), 2, "raise", 1),
    # Its peer waits in the second candidate's collectives: the job must end, not fall back (a profile: no calibration).
    Case("raise on rank 1 while layout='auto' measures", AUTO_MEASURING, 2, "raise_measuring", 1),
]
KILLED_SAVES = [
    Case(f"kill rank {r} {point}", dict(dp_shard=2), 2, "none", 0, kill_save=f"{r}:{point}")
    for r, point in [(1, "writing"), (0, "before_meta"), (0, "between_renames")]
] + [  # async_save: the shards written, and the checkpoint put in place, on DCP's thread while training goes on
    Case(
        f"kill rank {r} {point}, async_save", dict(dp_shard=2, async_save=True), 2, "none", 0, kill_save=f"{r}:{point}"
    )
    for r, point in [(1, "writing"), (0, "between_renames")]
]


@dataclass
class Rank:
    pid: int
    exe: str
    """``/proc/<pid>/exe``, read while the rank ran."""
    argv: list[str]
    parent: int


@dataclass
class Outcome:
    case: Case
    out: Path
    returncode: int
    output: str
    launcher: int
    """The PID of the process the test started (rank 0, whose Lightning launcher starts the others)."""
    ranks: dict[int, Rank]
    fault_at: float | None
    ended_at: float
    """When the last of the job's processes ended (or was found running past its deadline)."""
    left_behind: list[int]
    marks: dict[str, float] = field(default_factory=dict)
    """When each rank's ``fit`` raised (``raised<rank>``) and its interpreter began to exit (``atexit<rank>``), in
    seconds after the fault: where a slow end spent its time."""

    @property
    def ended_after_fault_s(self) -> float:
        return self.ended_at - (self.fault_at or self.ended_at)

    def timing(self) -> str:
        marks = ", ".join(f"{name} +{s:.1f}" for name, s in sorted(self.marks.items(), key=lambda item: item[1]))
        return f"ended at +{self.ended_after_fault_s:.1f} s after the fault" + (f" ({marks})" if marks else "")


class _Tree:
    """A running job: its launcher, the ranks as they write ``OUT/pid<rank>``, and when each process ended."""

    def __init__(self, case: Case, out: Path) -> None:
        self.out = out
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "KILL_SAVE")}
        env["PYTHONUNBUFFERED"] = "1"
        args = [str(out), json.dumps(case.layout), str(case.devices), case.fault, str(case.rank), str(FAULT_STEP)]
        if case.kill_save:
            env["KILL_SAVE"] = case.kill_save
            args.append("checkpoints")
        with open(out / "output.txt", "wb") as log:
            self.launcher = background.popen(
                [sys.executable, str(SCRIPT), *args], cwd=out, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.started = time.monotonic()
        self.ranks: dict[int, Rank] = {}
        self.watched: dict[int, int] = {}  # pidfd: pid
        self.ended: dict[int, float] = {}  # pid: when it ended
        self.deadline: float | None = None
        self._watch(self.launcher.pid)

    def run(self) -> None:
        """Watches the job until it is over (see :meth:`_over`), putting it ahead of the pooled jobs at its fault."""
        urgent = False
        while not self._over():
            self._find_ranks()
            if not urgent and (self.fault_at() is not None or self.launcher.pid in self.ended):
                background.set_priority(self.launcher.pid, background.URGENT_NICE)  # the ranks are in its group
                urgent = True
            ready, _, _ = select.select(list(self.watched), [], [], 0.2)
            now = time.time()
            for fd in ready:
                self.ended[self.watched.pop(fd)] = now
                os.close(fd)

    def _over(self) -> bool:
        """The launcher and every rank have ended; or the launcher has and the others are past their deadline (the
        fault plus :data:`ENDS_WITHIN_S`, or 10 s at least); or the tree is past its limit. The launcher (rank 0)
        may be the rank killed: the others must then end on their own."""
        now, fault_at = time.time(), self.fault_at()
        if time.monotonic() - self.started > TREE_LIMIT_S:
            return True
        if fault_at is not None and now > fault_at + ENDS_WITHIN_S + PAST_DUE_S:
            return True
        if self.launcher.pid not in self.ended:
            return False
        if self.deadline is None:
            self.deadline = max(now + 10, (fault_at or now) + ENDS_WITHIN_S)
        self._find_ranks()
        return now > self.deadline or all(rank.pid in self.ended for rank in self.ranks.values())

    def _watch(self, pid: int) -> None:
        try:
            self.watched[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            self.ended[pid] = time.time()

    def _find_ranks(self) -> None:
        for path in self.out.iterdir():
            found = re.fullmatch(r"pid(\d+)", path.name)
            if found is None or int(found[1]) in self.ranks:
                continue
            pid = int(path.read_text())
            with contextlib.suppress(OSError):  # read while it runs: a process that has ended has neither
                exe = os.readlink(f"/proc/{pid}/exe")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                self.ranks[int(found[1])] = Rank(pid, exe, argv, parent)
            if pid != self.launcher.pid:
                self._watch(pid)

    def fault_at(self) -> float | None:
        return float((self.out / "fault_at").read_text()) if (self.out / "fault_at").exists() else None

    def outcome(self, case: Case) -> Outcome:
        """The job's outcome; any of its processes still running is killed (and reported as left behind)."""
        noticed = time.time()
        left = background.group_members(self.launcher.pid)
        left += [r.pid for r in self.ranks.values() if r.pid not in self.ended and r.pid not in left]
        background.kill_group(self.launcher.pid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        returncode = self.launcher.wait()
        background.forget(self.launcher.pid)
        for fd in self.watched:
            os.close(fd)
        fault_at = self.fault_at()
        ends = [self.ended.get(pid) for pid in {self.launcher.pid, *(r.pid for r in self.ranks.values())}]
        ended = noticed if left or None in ends else max(e for e in ends if e is not None)
        stamps = [*self.out.glob("raised[0-9]"), *self.out.glob("atexit[0-9]")]
        marks = {p.name: float(p.read_text()) - (fault_at or ended) for p in stamps}
        output = (self.out / "output.txt").read_text(errors="replace")
        return Outcome(case, self.out, returncode, output, self.launcher.pid, self.ranks, fault_at, ended, left, marks)


def run_tree(out: Path, case: Case) -> Outcome:
    """Runs the case's job to its end; its outcome."""
    tree = _Tree(case, out)
    try:
        tree.run()
    finally:
        outcome = tree.outcome(case)
    (out / "timing.txt").write_text(outcome.timing() + "\n")
    return outcome


fault_tree = background.fixture("fault_tree", run_tree, order=0, params=FAULTS, ids=lambda case: case.name)
killed_save = background.fixture("killed_save", run_tree, order=0, params=KILLED_SAVES, ids=lambda case: case.name)


def assert_the_job_ended(outcome: Outcome) -> None:
    """Non-zero, within :data:`ENDS_WITHIN_S` of the fault, nothing left; every rank a real interpreter running the
    script, rank 0 the process the test started and the others started by its Lightning launcher."""
    tail, case = outcome.output[-4000:], outcome.case
    assert outcome.fault_at is not None, f"the fault never happened\n{tail}"
    assert outcome.returncode != 0, tail
    assert outcome.ended_after_fault_s <= ENDS_WITHIN_S, (outcome.timing(), tail)
    assert outcome.left_behind == [], tail
    assert sorted(outcome.ranks) == list(range(case.devices)), (outcome.ranks, tail)
    for rank, seen in outcome.ranks.items():
        assert seen.exe == PYTHON, f"rank {rank} ran {seen.exe}, not {PYTHON}"
        assert seen.argv[1:2] == [str(SCRIPT)], f"rank {rank} ran {seen.argv}"
        if rank == 0:
            assert seen.pid == outcome.launcher, "rank 0 is not the process the test started"
        else:
            assert seen.parent == outcome.launcher, f"rank {rank} was not started by rank 0's launcher"


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


def test_a_failing_rank_ends_the_job(fault_tree: Outcome) -> None:
    assert_the_job_ended(fault_tree)
    assert _names_the_rank(fault_tree.case, fault_tree.output), fault_tree.output[-4000:]


@functools.cache
def one_batch_reference() -> dict:
    return run_reference(max_steps=6, data=FAULT_DATA)


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(pool2, killed_save: Outcome) -> None:
    assert_the_job_ended(killed_save)
    # ckpt_path="last", as a restarted job passes it: Lightning lists the ModelCheckpoint directory before any strategy
    # hook, so a save killed between its two renames (no last.ckpt) must be put back first
    ckpt = str(killed_save.out / "ckpt")
    run = dict(strategy=killed_save.case.layout, devices=2, data=FAULT_DATA, ckpt_dir=ckpt, resume_from="last")
    resumed = pool2.run(run_par3d, **run)[0]
    whole = one_batch_reference()
    done = len(resumed["losses"])
    assert 0 < done < 6
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][-done:]), rtol=1e-4, atol=0
    )
    for name, value in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-4, atol=1e-4 * value.abs().max().item())


def test_the_failure_message_carries_the_whole_error() -> None:
    """Lightning's launcher may SIGKILL rank 0 before its traceback is printed (it polls the ranks it launched, and
    rank 0 has just ended them): the message printed first must carry every line of the error, not just the first."""
    from lightning_par3d.distributed.faults import describe_failure

    error = ValueError("Tensor parallelism cannot split this model:\n  - tp=2 does not divide a.n_head=3\n  - b")
    message = describe_failure(0, 2, error, timeout_s=20)
    assert message.splitlines()[:3] == [
        "par3d: rank 0 failed: ValueError: Tensor parallelism cannot split this model:",
        "      - tp=2 does not divide a.n_head=3",
        "      - b",
    ]
    many = describe_failure(0, 2, RuntimeError("first\n" + "\n".join(f"line {i}" for i in range(100))), 20)
    assert "    line 39" in many and "line 40" not in many and "(60 more lines)" in many
    try:  # a pipeline stage's error, as torch wraps it: the report names the cause
        try:
            raise RuntimeError("cp > 1: the model's blocks ran without calling torch's sdpa")
        except RuntimeError as inner:
            raise RuntimeError("[Stage 1] failed to run forward:\n    args: ...") from inner
    except RuntimeError as wrapped:
        staged = describe_failure(0, 2, wrapped, 20)
    assert "  caused by RuntimeError: cp > 1: the model's blocks ran without calling torch's sdpa" in staged


def test_a_failed_rank_skips_the_shutdown_collection_but_not_the_exit_handlers(new_interpreter) -> None:
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


def _two_runs_that_fail() -> tuple[list[tuple[str, bool]], bool]:
    """Two runs in the same process group, each failing on both ranks: rank 0 first in the first, rank 1 first in
    the second. Returns this rank's (message, failed first) for each run, and whether the store's timeout is what
    it was before (the failure path waits 5 s at most, and gives the store its own timeout back)."""
    import torch.distributed as dist

    from lightning_par3d.distributed import faults, groups
    from lightning_par3d.utils.torch_private import default_store

    groups.init_default_group(torch.device("cpu"), 30.0, None)
    rank, seen, timeout = dist.get_rank(), [], default_store().timeout
    for first in (0, 1):
        faults.new_run()
        order = [first, 1 - first]
        for turn in order:  # one rank records its failure, then the other
            if rank == turn:
                message = faults.describe_failure(rank, 2, RuntimeError(f"run {first}: rank {rank}"), 30)
                seen.append((message, faults.failed_first(rank)))
            dist.barrier()
    return seen, default_store().timeout == timeout


def test_a_failure_of_an_earlier_run_in_the_process_is_not_this_runs(pool2) -> None:
    """A notebook, a Hydra multirun or a fit after a fit keeps the process group and its store: the second run's
    failure names the second run's first failing rank, and that rank is the one that prints."""
    (seen_0, kept_0), (seen_1, kept_1) = pool2.run(_two_runs_that_fail)
    (first_run_0, first_0), (second_run_0, second_0) = seen_0
    (first_run_1, first_1), (second_run_1, second_1) = seen_1
    assert kept_0 and kept_1, "the failure path left the store with its own short timeout"
    assert (first_0, first_1) == (True, False)
    assert "rank 0 failed first: RuntimeError: run 0: rank 0" in first_run_1
    assert "failed first" not in first_run_0
    assert (second_0, second_1) == (False, True)
    assert "rank 1 failed first: RuntimeError: run 1: rank 1" in second_run_0
    assert "failed first" not in second_run_1
