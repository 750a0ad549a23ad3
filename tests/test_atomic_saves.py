"""Saved state appears whole or not at all, and one job at a time writes a path.

* Accelerate's ``save_state`` as a whole: a process killed (SIGKILL) at each step of a second save (Accelerate's own
  files written, par3d's shards being written, between the folder's two renames; synchronous and ``async_save``)
  leaves the first save whole: ``load_state`` restores its step, scheduler and parameters, never a mix.
* A folder that is no complete save is refused, naming the newest complete one beside it.
* A second job saving to a path another job is saving to fails clearly, on every rank; the staging directory of a
  save is its own, and what killed saves left is removed by the next save that holds the path.
* The multi-node check of the checkpoint directory is in ``tests/test_multinode.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_par3d.checkpoint import atomic
from lightning_par3d.checkpoint.state_folders import folder_to_load, remove_beyond_limit
from tests import background
from tests.launch import ROOT, clean_env
from tests.ports import free_port

SCRIPT = ROOT / "tests" / "accelerate_save_script.py"
KILL_POINTS = [
    ("accelerate_files", False),
    ("shards", False),
    ("renames", False),
    ("shards", True),
    ("renames", True),
]


def killed_save(out: Path, point: tuple[str, bool]) -> tuple[Path, Any]:
    """The script killed at ``point``, as ``torchrun --nproc-per-node 1`` starts it."""
    name, asynchronous = point
    env = clean_env(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
    )  # fmt: skip
    args = [sys.executable, str(SCRIPT), str(out), name, *(["async"] if asynchronous else [])]
    return out, background.run(args, timeout=300, cwd=ROOT, env=env)


accelerate_kill = background.fixture(
    "accelerate_kill", killed_save, params=KILL_POINTS, ids=lambda p: f"{p[0]}{', async_save' if p[1] else ''}"
)


def loaded_state(folder: str) -> dict[str, Any]:
    """``load_state(folder)`` at dp_shard=2 into the script's model, optimizer and scheduler: what it restored."""
    from examples.gpt import GPT, GPTConfig
    from tests.accelerate_runs import GPT_MODEL, _accelerator, _data, _optimizer
    from tests.gpt_runs import full_state

    accelerator = _accelerator(dict(dp_shard=2))
    torch.manual_seed(1)  # other weights than the saved ones: the load must replace them all
    model = GPT(GPTConfig(**GPT_MODEL))
    optimizer = _optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler, _ = accelerator.prepare(model, optimizer, scheduler, _data(4))
    accelerator.load_state(folder)
    return {"step": accelerator.step, "last_epoch": scheduler.scheduler.last_epoch, "params": full_state(model)}


def test_a_save_state_killed_at_any_step_leaves_the_previous_state_whole(pool2, accelerate_kill):
    out, done = accelerate_kill
    assert done.returncode == -9 and (out / "killed_at").exists(), done.stdout[-2000:] + done.stderr[-3000:]
    first = torch.load(out / "first.pt", weights_only=True)
    loaded = pool2.run(loaded_state, folder=str(out / "state"))[0]
    assert (loaded["step"], loaded["last_epoch"]) == (first["step"], first["last_epoch"]) == (first["step"], 1)
    assert loaded["params"].keys() == first["params"].keys()
    assert all(torch.equal(loaded["params"][k], v) for k, v in first["params"].items())


def _folder(path: Path) -> Path:
    (path / "par3d").mkdir(parents=True)
    for name in (".metadata", "meta.pt"):
        (path / "par3d" / name).write_bytes(b"")
    return path


def test_a_folder_that_is_no_complete_save_is_refused_naming_the_newest_complete_one(tmp_path):
    _folder(tmp_path / "checkpoint_0")
    _folder(tmp_path / "checkpoint_2")
    (tmp_path / "checkpoint_3").mkdir()  # Accelerate's files, no par3d checkpoint: an older, killed save
    (tmp_path / ".checkpoint_4.partial-abc").mkdir()  # a save killed before it took its name
    with pytest.raises(ValueError, match=r"checkpoint_3 holds no complete par3d checkpoint .* would mix states\. The "
                       r"newest complete one beside it: .*checkpoint_2\."):  # fmt: skip
        folder_to_load(None, str(tmp_path / "checkpoint_3"), automatic=False)
    with pytest.raises(ValueError, match=r"checkpoint_4 does not exist \(a save of it was interrupted\)"):
        folder_to_load(None, str(tmp_path / "checkpoint_4"), automatic=False)
    project = tmp_path.parent / f"{tmp_path.name}-project"
    (project / "checkpoints").mkdir(parents=True)
    _folder(project / "checkpoints" / "checkpoint_9")
    _folder(project / "checkpoints" / "checkpoint_10")
    (project / "checkpoints" / "checkpoint_11").mkdir()
    assert folder_to_load(str(project), None, automatic=True).name == "checkpoint_10"  # 10 after 9, not as text
    remove_beyond_limit(project / "checkpoints", limit=1)
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == ["checkpoint_10", "checkpoint_11"]


def fabric_saves(path: str) -> list[str]:
    """Two ``fabric.save`` calls to ``path``: what each raised (or ``"saved"``)."""
    import lightning as L

    from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
    from lightning_par3d import Par3DFabricStrategy
    from tests.fabric_runs import FABRIC_MODEL

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=Par3DFabricStrategy(dp_shard=2, tp_plan=GPT_TP_PLAN))
    fabric.launch()
    with fabric.init_module():
        model = fabric.setup_module(GPT(GPTConfig(**FABRIC_MODEL)))
    said = []
    for _ in range(2):
        try:
            fabric.save(path, {"model": model, "step": 1})
            said.append("saved")
        except Exception as error:
            said.append(f"{type(error).__name__}: {error}")
    return said


def test_a_second_job_saving_to_the_same_path_fails_clearly_and_leftovers_go(pool2, tmp_path):
    """This process holds the path's save lock as another job's rank 0 would while it saves: the pool's job fails
    on both ranks, naming the holder; once it is free, the next save succeeds and removes the staging directory
    another job's killed save left."""
    path = tmp_path / "shared.ckpt"
    other = atomic.SaveLock(path).acquire()
    try:
        refused = pool2.run(fabric_saves, path=str(path))
    finally:
        other.release()
    for said in refused:
        assert said[0].startswith("CheckpointInUse: Another job is saving to"), said
        assert f"held by process {os.getpid()} on " in said[0] and "Give each job its own directory" in said[0]
    assert not path.exists()
    leftover = atomic.staging_name(path, "killedjob")
    leftover.mkdir()
    assert pool2.run(fabric_saves, path=str(path))[0] == ["saved", "saved"]
    assert path.is_dir() and not leftover.exists() and not atomic.lock_name(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.ckpt"]


def test_every_save_stages_under_a_name_of_its_own(tmp_path):
    path = tmp_path / "last.ckpt"
    assert atomic.staging_name(path) != atomic.staging_name(path)
    assert atomic.staging_name(path).name.startswith(".last.ckpt.partial-")
    lock = atomic.SaveLock(path).acquire()
    with pytest.raises(atomic.CheckpointInUse, match=r"held by process \d+ on .* since"):
        atomic.SaveLock(path).acquire()  # another open of the lock file: as a second job's
    lock.release()
    atomic.SaveLock(path).acquire().release()
