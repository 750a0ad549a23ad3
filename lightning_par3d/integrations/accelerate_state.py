"""``Par3DAccelerator``'s weights and checkpoints: Accelerate's own state (RNG, schedulers, samplers, registered
objects) as Accelerate saves it, and the model and optimizers as one sharded DCP checkpoint through the engine,
loadable at any layout; the whole model's weights on process 0; a transformers ``save_pretrained`` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from lightning_par3d.checkpoint import atomic
from lightning_par3d.checkpoint.state_folders import (
    PAR3D_FOLDER,
    begin_save,
    check_before_loading,
    folder_to_load,
    remove_beyond_limit,
    state_folder,
)
from lightning_par3d.distributed.agree import on_rank_zero
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.saving import after_saves
from lightning_par3d.integrations.framework_private import without_models
from lightning_par3d.pipeline.trunk import PipelineHost
from lightning_par3d.utils.model_changes import restore_attribute


class Par3DStateCheckpoints(Accelerator):
    """Mixed into :class:`~lightning_par3d.integrations.accelerator.Par3DAccelerator` (which sets ``engine``)."""

    engine: Par3DEngine
    _pending_lock: atomic.SaveLock | None = None
    """Rank 0's lock of the folder a background save still writes (freed once it is in place, or failed)."""

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The model the script built (out of DDP or the pipeline host)."""
        module = self.engine.module
        if isinstance(module, PipelineHost):
            module = module.trunk
        if not keep_fp32_wrapper:  # the class's own forward again, without the autocast wrapper prepare set
            restore_attribute(module, "forward")
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole model's weights, unsharded and under their original names, on process 0 (None elsewhere)."""
        return self.engine.saves.full_state_dict()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the prepared Hugging Face transformers model as a ``save_pretrained`` directory from any layout
        (weights gathered on process 0, which writes them). Use it instead of ``unwrap_model(model).save_pretrained``:
        under pipeline parallelism no process holds the whole model. Every process must call it."""
        return self.engine.save_pretrained(directory)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's state (schedulers, RNG, samplers, registered objects) as Accelerate saves it, and the model
        and optimizers as one sharded DCP checkpoint (``<folder>/par3d``), loadable at any layout; returns the folder.

        The folder appears whole or not at all (:mod:`~lightning_par3d.checkpoint.atomic`): everything is written
        into a staging folder of this save's own and swapped in once (with ``async_save``, once the shards are
        written in the background), so a process killed at any step leaves the previous state whole; a second job
        saving to the same folder fails clearly. With ``automatic_checkpoint_naming`` the folder is Accelerate's
        ``checkpoints/checkpoint_<i>``, and ``total_limit`` removes older folders only once the new one is in
        place. On many nodes, every node must see the folder (checked before the first save)."""
        self._finish_saves()
        naming = self.project_configuration.automatic_checkpoint_naming
        target = state_folder(self.project_dir, self.save_iteration, output_dir, naming)
        self.engine.saves.checkpoint_directories.check(target.parent)
        lock: atomic.SaveLock | None = atomic.SaveLock(target) if self.engine.rank == 0 else None
        staging = Path(on_rank_zero(lambda: begin_save(target, lock), (atomic.CheckpointInUse,)))
        try:
            self._save_state_into(staging, safe_serialization, **kwargs)
            limit = self.project_configuration.total_limit if naming else None

            def finish() -> None:
                atomic.swap_into_place(staging, target)
                remove_beyond_limit(target.parent, limit)

            if self.engine.background is not None:
                if lock is not None:  # rank 0 swaps the folder in once the shards are written (DCP's thread)
                    self._pending_lock, lock = lock, None
                    after_saves(self.engine.background, finish)
            else:
                on_rank_zero(finish)
        finally:
            if lock is not None:
                lock.release()
        return str(target)

    def _save_state_into(self, staging: Path, safe_serialization: bool, **kwargs: Any) -> None:
        """Accelerate's own files (not the model and optimizers: par3d saves those) and par3d's checkpoint, into
        ``staging``."""
        naming = self.project_configuration.automatic_checkpoint_naming
        self.project_configuration.automatic_checkpoint_naming = False  # the staging folder, not Accelerate's name
        try:
            with without_models(self) as (_, optimizers):
                super().save_state(str(staging), safe_serialization, **kwargs)
        finally:
            self.project_configuration.automatic_checkpoint_naming = naming
        states = [self.engine.optimizer_state(optimizer) for optimizer in optimizers]
        # Accelerate saves and restores each process's random generators itself
        self.engine.save(staging / PAR3D_FOLDER, {"step": self.step}, states, streams=False)

    def _finish_saves(self) -> None:
        """Waits for a save in flight (raising its error) and frees the folder's lock it held."""
        try:
            self.engine.wait_for_saves()
        finally:
            lock, self._pending_lock = self._pending_lock, None
            if lock is not None:
                lock.release()

    def end_training(self) -> None:
        """Waits for a save still written in the background, then Accelerate's end (which may destroy the process
        group the save uses)."""
        self._finish_saves()
        super().end_training()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """The counterpart of :meth:`save_state`; the checkpoint may come from another layout. With
        ``automatic_checkpoint_naming`` and no ``input_dir``, the newest complete folder. Every file is checked
        before any is read: a folder without a complete ``par3d`` checkpoint, a ``.metadata`` naming anything but
        DCP's classes, or a registered object's file naming globals ``weights_only=True`` refuses (which Accelerate
        would load with ``weights_only=False``) raises ``ValueError`` on every rank, and nothing of it is run."""
        self._finish_saves()
        naming = self.project_configuration.automatic_checkpoint_naming
        folder = folder_to_load(self.project_dir, input_dir, naming)
        check_before_loading(folder)
        with without_models(self) as (_, optimizers):
            super().load_state(str(folder), load_kwargs, **kwargs)
        metadata = self.engine.load(folder / PAR3D_FOLDER, optimizers, streams=False)
        self.step = int(metadata.get("step", self.step))  # type: ignore[arg-type, has-type]
