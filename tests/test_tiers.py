"""The test tiers and the harness: the quick tier holds what it promises (``tests/conftest.py``), a pool's workers end
with the test process that started them, even one that is killed, and a job that hangs is reported with its stack."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import QUICK_PARITY
from tests.harness import DistPool

ROOT = Path(__file__).resolve().parents[1]


def _suite_markers(request, new_interpreter) -> list[list[str]]:
    """Every test of the suite, each as [node id, its markers...]: this session's own items where it collected the
    whole suite (``make test``), else one collection of it in a new interpreter (this test run alone)."""
    items, option = request.session.items, request.config.option
    every = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    unfiltered = not option.keyword and not option.markexpr
    if unfiltered and every <= {Path(str(item.fspath)).name for item in items}:
        return [[item.nodeid, *sorted({m.name for m in item.iter_markers()})] for item in items]
    collect = (
        "import sys, pytest\n"
        "class Markers:\n"
        "    def pytest_collection_finish(self, session):\n"
        "        for item in session.items:\n"
        "            print('TIER', item.nodeid, *sorted({m.name for m in item.iter_markers()}), sep='\\t')\n"
        "sys.exit(pytest.main(['--collect-only', '-q'], plugins=[Markers()]))\n"
    )
    done = new_interpreter([sys.executable, "-c", collect], cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line.split("\t")[1:] for line in done.stdout.splitlines() if line.startswith("TIER\t")]


def test_the_quick_tier_holds_its_parity_cases_and_nothing_that_starts_an_interpreter(request, new_interpreter):
    marked = _suite_markers(request, new_interpreter)
    quick = {nodeid for nodeid, *markers in marked if "quick" in markers}
    missing = [nodeid for nodeid in QUICK_PARITY if nodeid not in quick]
    assert not missing, f"parity cases of the quick tier that no longer exist: {missing}"
    started = {nodeid for nodeid, *markers in marked if "interpreter" in markers}
    assert started and not started & quick
    assert "tests/test_tiers.py::test_the_quick_tier_holds_its_parity_cases_and_nothing_that_starts_an_interpreter" in (
        started
    )


KILLED_HOLDER = """
import os, sys
sys.path.insert(0, {root!r})
from tests.harness import DistPool

if __name__ == "__main__":
    pool = DistPool(2)
    print(" ".join(str(p) for p in pool.run(os.getpid, timeout=240)), flush=True)
    os.kill(os.getpid(), 9)  # as a crashed pytest: no clean-up of any kind
"""


def test_pool_workers_end_with_a_test_process_that_is_killed(new_interpreter, tmp_path):
    """A pytest that dies (SIGKILL, nothing cleaned up) leaves no worker behind: they end within seconds."""
    script = tmp_path / "holder.py"
    script.write_text(KILLED_HOLDER.format(root=str(ROOT)))
    done = new_interpreter([sys.executable, str(script)], timeout=300, cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    workers = [int(pid) for pid in done.stdout.split()]
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers), f"workers {workers} outlived their test process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text().lower())


def _rank_one_hangs() -> int:
    if int(os.environ["RANK"]) == 1:
        time.sleep(120)
    return 0


def test_a_job_that_hangs_reports_where_the_missing_rank_waits():
    """A rank that misses the deadline is reported with the stack it hangs in (its ``faulthandler``), so that a hang
    seen once in CI can be read from CI's output."""
    pool = DistPool(2)
    try:
        pool.run(os.getpid, timeout=240)  # started: the deadline below is the job's alone
        with pytest.raises(TimeoutError) as hung:
            pool.run(_rank_one_hangs, timeout=3)
        assert "ranks [1] did not finish _rank_one_hangs" in str(hung.value)
        assert "in _rank_one_hangs" in str(hung.value), str(hung.value)[-3000:]
    finally:
        pool.close()
