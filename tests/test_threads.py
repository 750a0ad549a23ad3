"""Every rank gets par3d's CPU threads, as a user launches the job.

Each launch runs ``tests/threads_script.py`` with the real interpreter, and Lightning's subprocess launcher starts
its 2 ranks, as ``python train.py`` with ``devices=2`` does. par3d's Trainer and Fabric strategies must give every
rank the threads of par3d's rule (:func:`lightning_par3d.distributed.threads.threads_per_rank`: half of each rank's
share of the cores, at least 1) and that number in ``OMP_NUM_THREADS``; where the user set ``OMP_NUM_THREADS``, the
user's value, on every rank alike. Before the first fix the ranks Lightning's launcher started kept torch's default
(every core each), and pure data parallelism ran 5× slower than DDP on 4 CPU ranks; on 16 cores the fair share
(Lightning's rule) ran 3× slower than half of it (see the rule's module). The launches are background cases
(``tests/background.py``): they start with the session and are checked at its end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests import background
from tests.constants import THREADS_RANKS as RANKS
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
USER_THREADS = {"none": None, "user": "3"}
"""Without OMP_NUM_THREADS, and with a user's OMP_NUM_THREADS=3."""


def launch(folder: Path, front: str, strategy: str, user_threads: str | None) -> dict[int, dict[str, Any]]:
    """``python tests/threads_script.py`` with its ranks; each rank's threads and ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if user_threads is not None:
        env["OMP_NUM_THREADS"] = user_threads
    command = [sys.executable, "tests/threads_script.py", str(folder), front, strategy]
    done = background.run(command, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {rank: json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(RANKS)}


def _case(front: str, strategy: str, user: str) -> Any:
    name = f"threads_{front}_{strategy}_{user}"
    return name, background.fixture(name, lambda folder: launch(folder, front, strategy, USER_THREADS[user]))


LAUNCHES = [("trainer", "none"), ("trainer", "user"), ("fabric", "none")]
"""The user's ``OMP_NUM_THREADS`` is launched through the Trainer only: Fabric's launcher keeps it with the same
Lightning function (``_set_num_threads_if_needed``) that the Trainer's does."""
CASES = dict(_case(front, "par3d", user) for front, user in LAUNCHES)
globals().update(CASES)  # each launch is a fixture of this module, named as in CASES


def _check(par3d: dict, user: str) -> None:
    from lightning_par3d.distributed.threads import threads_per_rank

    assert sorted(par3d) == list(range(RANKS)), par3d
    omp = USER_THREADS[user] or str(threads_per_rank(RANKS))
    assert all(rank["omp"] == omp for rank in par3d.values()), (user, par3d)
    threads = {rank["threads"] for rank in par3d.values()}
    assert len(threads) == 1, (user, par3d)  # rank 0 (the launcher) and the ranks it started alike
    if USER_THREADS[user] is None:  # with the user's value, torch decides (it may cap it at the cores)
        assert threads == {int(omp)}, (user, par3d)


def test_trainer_ranks_get_par3ds_threads(threads_trainer_par3d_none, threads_trainer_par3d_user):
    _check(threads_trainer_par3d_none, "none")
    _check(threads_trainer_par3d_user, "user")


def test_fabric_ranks_get_par3ds_threads(threads_fabric_par3d_none):
    _check(threads_fabric_par3d_none, "none")


def test_accelerate_ranks_get_the_rule_from_the_launchers_environment(monkeypatch):
    """``Par3DAccelerator`` applies the same rule (:mod:`lightning_par3d.distributed.threads`) with the local process
    count torchrun, ``accelerate launch`` or SLURM give; a user's ``OMP_NUM_THREADS`` wins; a rank alone on its node
    gets every core."""
    import torch

    from lightning_par3d.distributed.threads import (
        cpus_available,
        local_processes_from_env,
        set_threads_per_rank,
        threads_per_rank,
    )

    before = torch.get_num_threads()
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert local_processes_from_env() == 1
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert local_processes_from_env() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_processes_from_env() == 2
    try:
        assert threads_per_rank(1) == cpus_available()
        assert set_threads_per_rank(2) == max(1, cpus_available() // 4)
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, cpus_available() // 4))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)
        assert set_threads_per_rank(8) == 2, "a user's OMP_NUM_THREADS is left as it is"
    finally:
        torch.set_num_threads(before)
