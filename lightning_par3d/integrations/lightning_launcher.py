"""The Trainer's launcher: Lightning's subprocess launcher, which first puts back the checkpoints a killed save left
aside, so that ``trainer.fit(ckpt_path="last")`` finds them.

A par3d save renames the checkpoint it replaces to ``.<name>.old`` before renaming the new one into place
(:mod:`lightning_par3d.checkpoint.dcp`). A job killed between the two renames leaves no ``last.ckpt``, and Lightning
resolves ``ckpt_path="last"`` by listing its ``ModelCheckpoint`` directories before any strategy hook runs, so it
would start from scratch. The launcher runs first on every process: it renames each such ``.<name>.old`` back in
the ``ModelCheckpoint`` directories (on every rank at once safely: one rename wins) and says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par3d.checkpoint.dcp import restore_previous_checkpoints
from lightning_par3d.integrations.framework_private import TrainerScriptLauncher


class Par3DLauncher(TrainerScriptLauncher):
    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            for directory in checkpoint_directories(trainer):
                for restored in restore_previous_checkpoints(directory):
                    rank_zero_info(
                        f"par3d: {restored} was put back from .{restored.name}.old, where a save killed part way "
                        "left it."
                    )
        return super().launch(function, *args, trainer=trainer, **kwargs)


def checkpoint_directories(trainer: Any) -> list[Path]:
    """The directories of the trainer's ``ModelCheckpoint`` callbacks, resolved as Lightning resolves them for
    ``ckpt_path="last"`` (the logger's directory where ``dirpath`` is not set)."""
    directories = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # Lightning's own resolution
        directory = callback.dirpath or (resolve(trainer) if callable(resolve) else None)
        if directory is not None:
            directories.append(Path(directory))
    return directories
