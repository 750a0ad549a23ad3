"""What the callbacks need from the run: par3d's engine, where to write, and the LightningModule as it was before
configure_model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L

from lightning_par3d.engine import Par3DEngine


def output_directory(trainer: L.Trainer, dirpath: Path | None) -> Path:
    """``dirpath``, else the logger's directory, else ``trainer.default_root_dir``: rank 0's choice on every rank
    (a collective: every rank calls it)."""
    if dirpath is not None:
        directory = dirpath
    elif trainer.logger is not None and trainer.logger.log_dir is not None:
        directory = Path(trainer.logger.log_dir)
    else:
        directory = Path(trainer.default_root_dir)
    directory = Path(trainer.strategy.broadcast(str(directory)))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def unconfigured_copy(pl_module: L.LightningModule) -> Any:
    """A copy of the LightningModule before ``configure_model`` has run (call it from a callback's ``setup``), to
    build again elsewhere: on meta for ``measure_flops``, on fake tensors for the estimator. The live device mesh
    stays out of it (it belongs to this process's process group). Raises whatever copying the module raises."""
    mesh, pl_module._device_mesh = getattr(pl_module, "_device_mesh", None), None
    try:
        return copy.deepcopy(pl_module)
    finally:
        pl_module._device_mesh = mesh


def par3d_engine(trainer: L.Trainer) -> Par3DEngine | None:
    """The run's :class:`~lightning_par3d.engine.Par3DEngine` (None under another strategy)."""
    engine = getattr(trainer.strategy, "engine", None)
    return engine if isinstance(engine, Par3DEngine) else None


def pp_rank(trainer: L.Trainer) -> int:
    """This rank's pipeline position (0 without pipelining, or under another strategy)."""
    engine = par3d_engine(trainer)
    return engine.placement.pp_rank if engine is not None and engine.placement.is_set_up else 0
