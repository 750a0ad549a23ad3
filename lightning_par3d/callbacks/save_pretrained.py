"""``SavePretrained``: the trained Hugging Face transformers model written as a ``save_pretrained`` directory (a
``peft`` model: its adapters, as ``PeftModel.save_pretrained`` writes them).

At the end of ``fit`` (and, with ``every_n_epochs``, after every n-th training epoch, into ``epoch=<n>/``) the
transformers model inside the LightningModule is written by transformers' own ``save_pretrained``: safetensors,
``config.json``, tied weights once. It works from any par3d layout (the weights are gathered on rank 0, which
writes them) and needs no second step: ``AutoModelForCausalLM.from_pretrained(dirpath)`` loads the result. Under
another strategy the LightningModule must hold the whole model on rank 0, which then writes it alone.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par3d.checkpoint import pretrained
from lightning_par3d.checkpoint.peft_files import adapters_of
from lightning_par3d.integrations.trainer import Par3DStrategy


class SavePretrained(Callback):
    """Writes the trained transformers model to ``dirpath`` at the end of ``fit`` (see the module docstring)."""

    def __init__(self, dirpath: str | Path, every_n_epochs: int | None = None) -> None:
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(
                f"every_n_epochs={every_n_epochs!r} must be a positive integer, or None (only at the end)."
            )
        self.dirpath = Path(dirpath)
        self.every_n_epochs = every_n_epochs

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        if self.every_n_epochs and epoch % self.every_n_epochs == 0 and not trainer.sanity_checking:
            self.save(trainer, pl_module, self.dirpath / f"epoch={epoch}")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer, pl_module, self.dirpath)

    @staticmethod
    def save(trainer: L.Trainer, pl_module: L.LightningModule, directory: Path) -> None:
        """Writes ``pl_module``'s transformers model to ``directory``; every rank must call it."""
        if isinstance(trainer.strategy, Par3DStrategy):
            trainer.strategy.save_pretrained(directory)
        elif trainer.is_global_zero:
            pretrained.save_pretrained(pl_module, pl_module.state_dict(), directory)
        trainer.strategy.barrier("SavePretrained")
        if adapters_of(pl_module):
            rank_zero_info(f"par3d: saved the LoRA adapters to {directory} (PeftModel.from_pretrained(base, path))")
        else:
            rank_zero_info(f"par3d: saved the transformers model to {directory} (AutoModelForCausalLM.from_pretrained)")
