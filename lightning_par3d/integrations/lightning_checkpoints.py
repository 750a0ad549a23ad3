"""The Trainer's checkpoint hooks: sharded DCP checkpoints through the engine, loadable at any layout.

Lightning builds a checkpoint dict from the strategy's model and optimizer states and hands it to
``save_checkpoint``; par3d's states are this rank's shards (DTensors, never gathered), and the engine saves them
with ``torch.distributed.checkpoint`` beside Lightning's loop state (``meta.pt``). Loading restores the shards in
place before Lightning would apply the states, so Lightning's own restore steps have nothing left to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.checkpoint import dcp as ckpt
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.integrations.lightning_elastic import ElasticTraining


class ShardedCheckpoints(ElasticTraining):
    """Mixed into :class:`~lightning_par3d.integrations.trainer.Par3DStrategy` (which sets ``engine``); an elastic
    run's state travels in its checkpoints (see :mod:`lightning_par3d.integrations.lightning_elastic`)."""

    engine: Par3DEngine

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the model (DTensors); saved with DCP, never gathered."""
        return self.engine.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.engine.optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` already restored the shards in place."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` already restored the shards in place."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("par3d saves with torch.distributed.checkpoint and takes no `storage_options`.")
        self.add_elastic_state(checkpoint)
        model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        self.engine.save(self.broadcast(str(filepath)), checkpoint, optimizer_states, model_state)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        strict = self.lightning_module.strict_loading
        checkpoint = self.engine.load(path, self.optimizers, strict=strict, weights_only=weights_only)
        self.take_elastic_state(checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(Path(filepath))
