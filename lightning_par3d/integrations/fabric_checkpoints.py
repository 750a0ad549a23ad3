"""Fabric's checkpoint calls: ``fabric.save`` and ``fabric.load`` as sharded DCP directories through the engine,
loadable at any layout (the same files as the Trainer's)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.engine import Par3DEngine


class FabricCheckpoints(ParallelStrategy):
    """Mixed into :class:`~lightning_par3d.integrations.fabric.Par3DFabricStrategy` (which sets ``engine``)."""

    engine: Par3DEngine

    @override
    def save_checkpoint(
        self,
        path: _PATH,
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
        path: _PATH,
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
