"""The front-ends' checkpoint hooks, translated to the engine's sharded saves (:meth:`Par3DEngine.save
<lightning_par3d.engine.Par3DEngine.save>`, :meth:`~lightning_par3d.engine.Par3DEngine.load`): each rank's shards
with ``torch.distributed.checkpoint``, the rest of the state in ``meta.pt``, loadable at any layout. The Trainer's
hooks are :class:`TrainerCheckpointHooks`, ``fabric.save``/``fabric.load`` are :class:`FabricCheckpointHooks`;
Accelerate's ``save_state``/``load_state`` are in :mod:`~lightning_par3d.integrations.accelerate_state`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.checkpoint.dcp import remove_checkpoint
from lightning_par3d.engine.saving import after_saves
from lightning_par3d.integrations.framework_private import PATH

if TYPE_CHECKING:
    from lightning_par3d.engine import Par3DEngine
    from lightning_par3d.integrations.lightning_elastic import ElasticRun


class TrainerCheckpointHooks(ParallelStrategy):
    """The Trainer strategy's checkpoint hooks: Lightning's checkpoint dict saved by shard, never gathered; a load
    restores the shards in place (the model's and the optimizers', saved at any layout) after setup, so Lightning's
    own restoring of the model and optimizer states does nothing."""

    engine: Par3DEngine
    _elastic: ElasticRun

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
        """Nothing to do: :meth:`load_checkpoint` restored the shards in place."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` restored the shards in place."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None) -> None:
        """Saves Lightning's checkpoint dict: the shards with DCP, the rest (loops, callbacks) as ``meta.pt``."""
        if storage_options is not None:
            raise TypeError("par3d saves with torch.distributed.checkpoint and takes no `storage_options`.")
        self._elastic.add_state(checkpoint, self.lightning_module.trainer if self.lightning_module else None)
        model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        self.engine.save(self.broadcast(str(filepath)), checkpoint, optimizer_states, model_state)

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restores the shards in place (saved at any layout) and returns the rest of the checkpoint."""
        assert self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        strict = self.lightning_module.strict_loading
        checkpoint = self.engine.load(path, self.optimizers, strict=strict, weights_only=weights_only)
        self._elastic.take_state(checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        """Removes an older checkpoint (rank 0), once a save still written in the background has its name."""
        if self.is_global_zero:
            after_saves(self.engine.background, lambda: remove_checkpoint(Path(filepath)))


class FabricCheckpointHooks(FabricParallelStrategy):
    """``fabric.save(path, state)`` and ``fabric.load(path, state)``: the one model and the optimizers of ``state`` by
    shard, everything else in ``meta.pt``; a load restores them in place and gives back the other entries."""

    engine: Par3DEngine

    @override
    def save_checkpoint(
        self,
        path: PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Saves ``state`` as a sharded DCP directory: the model and optimizers by shard, the rest in ``meta.pt``."""
        if storage_options is not None or filter is not None:
            raise TypeError("par3d saves with torch.distributed.checkpoint and takes no `storage_options`/`filter`.")
        key = _model_key(state)
        optimizers = {name: self.engine.optimizer_state(o) for name, o in state.items() if isinstance(o, Optimizer)}
        metadata = {name: obj for name, obj in state.items() if name != key and name not in optimizers}
        self.engine.save(self.broadcast(str(path)), metadata, optimizers, model_key=key)

    @override
    def load_checkpoint(
        self,
        path: PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores the model and optimizers in ``state`` in place; returns the remaining saved entries."""
        if not isinstance(state, dict):
            raise TypeError("par3d loads into a dict of objects, e.g. state={'model': model, 'optimizer': optimizer}.")
        optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
        path = self.broadcast(str(path))
        key = _model_key(state)
        metadata = self.engine.load(path, optimizers, model_key=key, strict=strict, weights_only=weights_only)
        for name in list(metadata):
            if name in state and not isinstance(state[name], (Module, Optimizer)):
                state[name] = metadata.pop(name)
        return metadata


def _model_key(state: dict[str, Any]) -> str:
    keys = [name for name, obj in state.items() if isinstance(obj, Module)]
    if len(keys) != 1:
        raise ValueError(
            f"par3d checkpoints hold exactly one model; the state has {len(keys)}. Save each model separately."
        )
    return keys[0]
