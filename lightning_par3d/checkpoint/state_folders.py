"""The folders of ``Par3DAccelerator.save_state``: Accelerate's own files beside par3d's checkpoint (``par3d/``),
named as Accelerate names them, written whole (:mod:`~lightning_par3d.checkpoint.atomic`), and checked before
anything in them is read.

Accelerate writes its files (schedulers, RNG states, samplers, registered objects) in place, one after another; a
process killed between them (or while par3d's shards are written in the background) would leave a folder of new
scheduler and RNG state beside old shards, which ``load_state`` would take without a word. Here the whole folder is
staged and swapped in once, and a load finds either the previous folder whole, or a clear refusal.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from lightning_par3d.checkpoint import atomic
from lightning_par3d.checkpoint.dcp import is_sharded_checkpoint, resolve_checkpoint
from lightning_par3d.checkpoint.safe_reading import UnsafeCheckpointError, read_metadata, refuse_unsafe_pickles

PAR3D_FOLDER = "par3d"
"""par3d's checkpoint of the model and optimizers inside a ``save_state`` folder."""
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
"""Accelerate's ``automatic_checkpoint_naming`` folders."""
_REGISTERED_OBJECTS = re.compile(r"^custom_checkpoint_\d+\.pkl$")
"""The files of ``accelerator.register_for_checkpointing`` objects, which Accelerate loads with
``weights_only=False``."""


def state_folder(project_dir: str | None, iteration: int, output_dir: str | None, automatic: bool) -> Path:
    """Where a ``save_state`` writes: ``output_dir``, or with Accelerate's ``automatic_checkpoint_naming``
    ``<project_dir>/checkpoints/checkpoint_<iteration>`` (refused where it exists, as Accelerate refuses it)."""
    if automatic:
        target = Path(project_dir or ".") / "checkpoints" / f"checkpoint_{iteration}"
        if target.exists():
            raise ValueError(
                f"Checkpoint directory {target} ({iteration}) already exists. Please manually override "
                "`accelerator.project_configuration.iteration` with what iteration to start with."
            )
        return target
    if output_dir is None:
        raise ValueError("save_state needs an output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
    return Path(output_dir).expanduser()


def begin_save(target: Path, lock: atomic.SaveLock | None) -> str:
    """Rank 0's start of a save of the folder ``target``: its lock, what killed saves of it left removed, a previous
    folder an interrupted swap left aside put back, a staging folder made. Returns the staging folder."""
    assert lock is not None
    lock.acquire()
    for leftover in atomic.leftovers(target):
        shutil.rmtree(leftover, ignore_errors=True)
    atomic.restore_previous(target, is_state_folder)
    staging = atomic.staging_name(target)
    staging.mkdir(parents=True)
    return str(staging)


def is_state_folder(folder: Path) -> bool:
    """Whether ``folder`` is a complete ``save_state`` folder (its par3d checkpoint complete; Accelerate's files are
    written before it, and the folder takes its name only after both)."""
    return folder.is_dir() and is_sharded_checkpoint(folder / PAR3D_FOLDER)


def complete_folders(parent: Path) -> list[Path]:
    """The complete ``save_state`` folders in ``parent`` (not the hidden ones of saves in progress), the
    ``checkpoint_<i>`` ones by number, then the others by name."""
    if not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if not p.name.startswith(".") and is_state_folder(p)]
    return sorted(found, key=lambda p: (0, int(m.group(1)), "") if (m := _NUMBERED.match(p.name)) else (1, 0, p.name))


def remove_beyond_limit(parent: Path, limit: int | None) -> None:
    """Accelerate's ``total_limit``: the oldest ``checkpoint_<i>`` folders removed until ``limit`` are left (called
    once a new one is in place, so that a failed save never leaves fewer)."""
    if limit is None:
        return
    numbered = [p for p in complete_folders(parent) if _NUMBERED.match(p.name)]
    for folder in numbered[: max(len(numbered) - limit, 0)]:
        shutil.rmtree(folder, ignore_errors=True)


def folder_to_load(project_dir: str | None, input_dir: str | None, automatic: bool) -> Path:
    """The folder a ``load_state`` reads: ``input_dir`` (or the previous folder an interrupted swap left aside),
    else with ``automatic_checkpoint_naming`` the newest complete ``checkpoint_<i>``. Raises ``ValueError`` for a
    folder that is not a complete ``save_state`` folder, naming the newest complete one beside it."""
    if input_dir is None:
        if not automatic:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        parent = Path(project_dir or ".") / "checkpoints"
        numbered = [p for p in complete_folders(parent) if _NUMBERED.match(p.name)]
        if not numbered:
            raise ValueError(f"There is no complete checkpoint_<i> folder in {parent} to load.")
        return numbered[-1]
    folder = atomic.resolve(Path(input_dir).expanduser(), is_state_folder)
    if is_state_folder(folder):
        return folder
    what = "does not exist" if not folder.exists() else f"holds no complete par3d checkpoint ({PAR3D_FOLDER}/)"
    interrupted = " (a save of it was interrupted)" if atomic.leftovers(folder) else ""
    others = complete_folders(folder.parent)
    newest = f" The newest complete one beside it: {others[-1]}." if others else ""
    raise ValueError(
        f"{folder} {what}{interrupted}: it is not a complete Par3DAccelerator.save_state folder, and loading it "
        f"would mix states.{newest}"
    )


def check_before_loading(folder: Path) -> None:
    """Raises ``ValueError`` where loading ``folder`` would run something: par3d's ``.metadata`` naming a global
    beyond DCP's classes (read by :func:`~lightning_par3d.checkpoint.safe_reading.read_metadata`), or a registered
    object's file naming globals ``weights_only=True`` refuses. Nothing is run either way."""
    try:
        read_metadata(resolve_checkpoint(folder / PAR3D_FOLDER))
    except UnsafeCheckpointError as error:
        where = folder / PAR3D_FOLDER / ".metadata"
        raise UnsafeCheckpointError(f"Cannot load {folder}: {where} was refused: {error}") from None
    except (OSError, EOFError, ValueError):
        pass  # damaged: the checkpoint's own check says how, on every rank, when it is loaded
    refuse_unsafe_pickles(sorted(p for p in folder.iterdir() if _REGISTERED_OBJECTS.match(p.name)))
