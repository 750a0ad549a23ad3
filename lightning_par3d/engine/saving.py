"""The engine's checkpoints: each rank's shards of the model and its optimizers, saved and loaded through
``torch.distributed.checkpoint`` (:mod:`lightning_par3d.checkpoint.dcp`: atomic, loadable at any layout), and the
whole model gathered for a Hugging Face ``save_pretrained`` directory (:mod:`lightning_par3d.checkpoint.pretrained`).

Names are the model's own at every layout: the module saved is the model itself, never the ``DistributedDataParallel``
around it or the pipeline host around a plain model (:func:`saved_module`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.checkpoint import dcp, pretrained, rng
from lightning_par3d.distributed import groups
from lightning_par3d.distributed.agree import check_directory_is_shared
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.pipeline.trunk import PipelineHost

MODEL_KEY = "state_dict"
"""The model's entry in a par3d checkpoint (Lightning's name for it)."""


def optimizer_key(index: int) -> str:
    """The ``index``-th optimizer's entry in a par3d checkpoint."""
    return f"optimizer_{index}"


def saved_module(module: nn.Module, forward_module: nn.Module) -> nn.Module:
    """The module whose names a checkpoint uses: the model itself (inside DDP, inside a pipeline host)."""
    return module.trunk if isinstance(module, PipelineHost) else forward_module


def full_state_dict(saved: nn.Module, mesh: Par3DMesh, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole model's state, unsharded, under its original names, on rank 0 (None elsewhere); a collective."""
    coords = mesh.coords(rank)
    first_copy = coords.dp_replicate == 0 and coords.dp_shard == 0 and coords.tp == 0
    return dcp.full_state_dict(saved, holds_copy=first_copy)


def save_pretrained(saved: nn.Module, state: dict[str, torch.Tensor] | None, directory: str | Path, rank: int) -> Path:
    """Rank 0 writes the transformers model ``saved`` with ``state`` (its gathered weights) as a ``save_pretrained``
    directory; every rank raises the same error if the writing fails, and returns the directory once it is
    complete. Every rank must call it."""
    outcome: list[Any] = [None]
    if rank == 0:
        assert state is not None
        try:
            pretrained.save_pretrained(saved, state, directory)
        except Exception as error:  # every rank must learn of it, or the others would wait for ever
            outcome[0] = f"{type(error).__name__}: {error}"
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"save_pretrained to {directory} failed on rank 0: {outcome[0]}")
    return Path(directory)


def save(
    path: str | Path,
    tensors: dict[str, Any],
    metadata: dict[str, Any],
    rank: int,
    streams: tuple[str, torch.device] | None = None,
    background: dcp.BackgroundSaves | None = None,
) -> None:
    """Saves ``tensors`` (this rank's shards: the model under its key, the optimizers under theirs) with DCP and
    ``metadata`` (rank 0's) as ``meta.pt``, atomically. ``streams``: where (the layout, :func:`rng.saved_at`) and on
    which device this rank's random generators run, to save them (:mod:`lightning_par3d.checkpoint.rng`).
    ``background``: written by a thread (``async_save``). Every rank must call it."""
    per_rank = None
    if streams is not None:
        metadata = {**metadata, rng.SAVED_AT: streams[0]}

        def per_rank(directory: Path) -> None:
            rng.write(directory, rank, streams[1])

    dcp.save_sharded(Path(path), tensors, metadata, rank, per_rank, background)


def background_saves(async_save: bool, timeout_s: float) -> dcp.BackgroundSaves | None:
    """The engine's saves in the background, with ``async_save`` (their collectives on a group of their own)."""
    return dcp.BackgroundSaves(lambda: groups.checkpoint_group(timeout_s)) if async_save else None


def load(
    path: str | Path,
    saved: nn.Module,
    optimizers: Sequence[Any] | Mapping[str, Any],
    model_key: str,
    strict: bool,
    weights_only: bool | None,
    streams: tuple[str, torch.device, int] | None = None,
) -> dict[str, Any]:
    """Restores the model's and ``optimizers``' shards in place from the checkpoint at ``path`` (saved at any layout)
    and returns its ``meta.pt`` contents. ``streams`` (this run's layout, device and rank): then this rank's random
    generators too, where the checkpoint was saved at that layout (:func:`rng.load`). A damaged or foreign checkpoint
    raises the same ``ValueError`` on every rank."""
    inner = {key: unwrapped(optimizer) for key, optimizer in by_key(optimizers).items()}
    metadata = dcp.load_sharded(Path(path), saved, inner, model_key, strict, weights_only)
    saved_at = metadata.pop(rng.SAVED_AT, None)
    if streams is not None:
        rng.load(dcp.resolve_checkpoint(Path(path)), streams[2], saved_at, streams[0], streams[1])
    return metadata


def by_key(items: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """Optimizers (or their states) by their checkpoint keys: a mapping's own, or ``optimizer_<i>`` for a list."""
    if isinstance(items, Mapping):
        return dict(items)
    return {optimizer_key(i): item for i, item in enumerate(items)}


def unwrapped(optimizer: Any) -> Any:
    """The torch (or ZeRO) optimizer inside Lightning's, Fabric's or Accelerate's optimizer wrapper."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, Optimizer):  # a ZeroOptimizer is one too, and is kept (its `wrapped` is not unwrapped)
            return unwrapped(inner)
    return optimizer


def after_saves(background: dcp.BackgroundSaves | None, then: Callable[[], None]) -> None:
    """``then`` once ``background``'s save in flight has its name (:meth:`dcp.BackgroundSaves.after_in_place`); at
    once without saves in the background."""
    if background is None:
        then()
    else:
        background.after_in_place(then)


def saved_at(layout: Any) -> str:
    """What a checkpoint records of the layout its random streams were saved at (:func:`rng.saved_at`)."""
    return rng.saved_at(str(layout), layout.world_size)


class SharedDirectories:
    """The checkpoint directories checked to be one directory on every node, on many nodes (a probe file rank 0
    writes: :func:`~lightning_par3d.distributed.agree.check_directory_is_shared`). ``devices_per_node()``: the
    launcher's, once the processes are set up."""

    def __init__(self, devices_per_node: Callable[[], int]) -> None:
        self.devices_per_node = devices_per_node
        self.checked: set[Path] = set()

    def check(self, directory: str | Path) -> None:
        """Checks ``directory`` unless it, or a directory holding it, was checked before; raises ``ValueError`` on
        every rank naming the nodes that do not see it. Every rank must call it, before the first save into it."""
        resolved = Path(directory).absolute()
        if not ({resolved, *resolved.parents} & self.checked):
            check_directory_is_shared(resolved, self.devices_per_node())
            self.checked.add(resolved)


class ModelSaves:
    """One engine's checkpoints (a part of :class:`~lightning_par3d.engine.Par3DEngine`, whose ``save``, ``load``,
    ``model_state``, … these are): this rank's shards of the model and optimizers with DCP, atomically, with each
    rank's random generators; the whole model gathered for ``save_pretrained``; the saves in the background
    (``async_save``) and the directories checked to be shared by every node. ``placement``: where this rank is
    (:class:`~lightning_par3d.engine.placement.Placement`); ``model()``: the module whose names a checkpoint uses
    (:func:`saved_module`)."""

    def __init__(self, placement: Any, model: Callable[[], nn.Module]) -> None:
        self.placement, self._model = placement, model
        self.checkpoint_directories = SharedDirectories(lambda: placement.devices_per_node)
        self.background = background_saves(placement.config.async_save, placement.config.timeout_s)
        """With ``async_save``: the saves written in the background (``checkpoint.dcp.BackgroundSaves``)."""

    def model_state(self) -> dict[str, Any]:
        """This rank's shards of the model's state (DTensors, nothing gathered), keyed by original names."""
        return dcp.model_state(self._model())

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's shards of ``optimizer``'s state (wrapped by a framework or not), keyed by parameter name."""
        return dcp.optimizer_state(self._model(), unwrapped(optimizer))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state, unsharded, under its original names, on rank 0 (None elsewhere); a collective."""
        return full_state_dict(self._model(), self.placement.mesh, self.placement.rank)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the transformers model inside the trained module as a ``save_pretrained`` directory, from any
        layout (gathered on rank 0, which writes it). Every rank must call it."""
        return save_pretrained(self._model(), self.full_state_dict(), directory, self.placement.rank)

    def save(
        self,
        path: str | Path,
        metadata: dict[str, Any],
        optimizer_states: Sequence[dict[str, Any]] | Mapping[str, dict[str, Any]] = (),
        model_state: dict[str, Any] | None = None,
        model_key: str = MODEL_KEY,
        streams: bool = True,
    ) -> None:
        """Saves this rank's shards of the model (``model_state``, by default :meth:`model_state`) and optimizers
        (their :meth:`optimizer_state`, by name, or ``optimizer_0``, … for a list) with DCP, ``metadata`` (rank 0's),
        and (``streams``) each rank's random generators, atomically. Every rank must call it."""
        place = self.placement
        self.checkpoint_directories.check(Path(path).parent)
        tensors = {model_key: self.model_state() if model_state is None else model_state}
        tensors.update(by_key(optimizer_states))
        where = (saved_at(place.layout), place.device) if streams else None
        save(path, tensors, metadata, place.rank, where, self.background)

    def load(
        self,
        path: str | Path,
        optimizers: Sequence[Any] | Mapping[str, Any] = (),
        model_key: str = MODEL_KEY,
        strict: bool = True,
        weights_only: bool | None = None,
        streams: bool = True,
    ) -> dict[str, Any]:
        """Restores the model's and ``optimizers``' shards in place from the checkpoint at ``path`` (saved at this
        layout or any other) and returns its metadata; with ``streams``, each rank's random generators where the
        checkpoint was saved at this layout (at another, rank 0 says why they start afresh)."""
        place = self.placement
        where = (saved_at(place.layout), place.device, place.rank) if streams else None
        self.wait_for_saves()
        return load(path, self._model(), optimizers, model_key, strict, weights_only, where)

    def wait_for_saves(self) -> None:
        """With ``async_save``: waits for the save in flight on every rank (then a barrier); raises its error."""
        if self.background is not None:
            self.background.wait()
            self.placement.barrier()
