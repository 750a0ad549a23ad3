"""``BackgroundSaves``, the bookkeeping of ``async_save`` (its runs are in test_fabric_and_checkpoint, test_pipeline and
test_faults): what waits for what, on a future that the test completes itself."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from lightning_par3d.checkpoint import atomic, dcp


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / dcp.METADATA_FILENAME).write_bytes(b"")
    return path


def test_the_new_checkpoint_takes_its_name_and_older_ones_go_only_once_it_is_written(tmp_path: Path):
    saves = dcp.BackgroundSaves(group=lambda: None)
    older = _checkpoint(tmp_path / "epoch=0.ckpt")
    future: Future = Future()
    staging = _checkpoint(atomic.staging_name(tmp_path / "epoch=1.ckpt"))
    lock = atomic.SaveLock(tmp_path / "epoch=1.ckpt").acquire()  # rank 0 holds it until the save is in place
    saves.start(future, staging, tmp_path / "epoch=1.ckpt", lock)
    saves.after_in_place(lambda: dcp.remove_checkpoint(older))  # ModelCheckpoint's top-k, right after the save
    assert saves.in_flight and older.exists() and not (tmp_path / "epoch=1.ckpt").exists()
    future.set_result(None)  # every rank's shards written
    saves.wait()
    assert (tmp_path / "epoch=1.ckpt").is_dir() and not staging.exists() and not older.exists()
    assert not lock.held and not atomic.lock_name(tmp_path / "epoch=1.ckpt").exists()
    saves.after_in_place(lambda: dcp.remove_checkpoint(tmp_path / "epoch=1.ckpt"))  # nothing in flight: at once
    assert not (tmp_path / "epoch=1.ckpt").exists()


def test_a_failed_save_keeps_the_older_checkpoint_and_raises_at_the_next_wait(tmp_path: Path):
    saves = dcp.BackgroundSaves(group=lambda: None)
    older = _checkpoint(tmp_path / "last.ckpt")
    future: Future = Future()
    lock = atomic.SaveLock(older).acquire()
    saves.start(future, _checkpoint(atomic.staging_name(older)), older, lock)
    saves.after_in_place(lambda: dcp.remove_checkpoint(older))
    future.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        saves.wait()
    assert (older / dcp.METADATA_FILENAME).exists()  # never removed, never replaced
    assert not lock.held  # and the next save may take the path


def test_a_rename_that_fails_on_rank_0_is_raised_not_lost(tmp_path: Path):
    """concurrent.futures drops what a done-callback raises: the rename's error is kept for wait()."""
    saves = dcp.BackgroundSaves(group=lambda: None)
    future: Future = Future()
    lock = atomic.SaveLock(tmp_path / "gone.ckpt").acquire()
    saves.start(future, tmp_path / ".gone.partial-x", tmp_path / "gone.ckpt", lock)  # no staging directory
    future.set_result(None)
    with pytest.raises(FileNotFoundError):
        saves.wait()
    saves.wait()  # raised once
