"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), laid out as Lightning's own.

A checkpoint is a directory: DCP's shard files plus ``.metadata`` hold ``state_dict`` (the model) and
``optimizer_0``, ``optimizer_1``, … (the optimizers), each rank writing only its shards; ``meta.pt``, written by
rank 0, holds everything else Lightning saves (loops, callbacks, hyper-parameters). It is the layout of
Lightning's ``ModelParallelStrategy``, so Lightning's ``consolidate_checkpoint`` turns it into a single file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.zero import ZeroOptimizer

METADATA_FILENAME = "meta.pt"


def model_state(module: nn.Module) -> dict[str, Any]:
    """The model's state dict with each rank's shards (DTensors): nothing is gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


# Flattened optimizer state: every entry, param_groups settings included, is keyed by parameter name
# ("param_groups.model.h.2.attn.q_proj.weight.lr"), so pipeline ranks, which hold different parameters, never write
# the same key with different contents, and any layout reads back what it owns.
_OPTIM_OPTIONS: dict[str, Any] = {"flatten_optimizer_state_dict": True}


def optimizer_state(module: nn.Module, optimizer: Optimizer, for_loading: bool = False) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, with each rank's shards. A ZeRO-1/2 optimizer gives its
    own rows as DTensors in the same flattened layout; ``for_loading`` makes sure its state exists to load into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.sharded_state_dict(_names(module), for_loading=for_loading)
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(**_OPTIM_OPTIONS))


def load_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Restores the optimizer from a state dict in the :func:`optimizer_state` format."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_sharded_state_dict(state, _names(module))
        return
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(**_OPTIM_OPTIONS))


def _names(module: nn.Module) -> dict[torch.Tensor, str]:
    return {param: name for name, param in module.named_parameters()}


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def save_sharded(path: Path, tensors: dict[str, Any], metadata: dict[str, Any], rank: int) -> None:
    """Writes ``tensors`` with DCP (every rank its own shards) and ``metadata`` with ``torch.save`` (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if path.is_file():
        raise FileExistsError(f"{path} is a file; a par3d checkpoint is a directory. Remove it or choose another path.")
    path.mkdir(parents=True, exist_ok=True)
    # overwrite=True: Lightning re-saves `last.ckpt` at the same path every time.
    dcp.save(tensors, storage_writer=FileSystemWriter(path, overwrite=True))
    if rank == 0:
        torch.save(metadata, path / METADATA_FILENAME)


def load_sharded(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True) -> dict[str, Any]:
    """Loads the model's and optimizers' shards in place (at the layout they were saved with or any other that
    DCP can reshard to) and returns the rest of the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a par3d checkpoint: expected a directory written by torch.distributed.checkpoint "
            "(with a .metadata file). Pass the checkpoint directory that par3d saved."
        )
    state: dict[str, Any] = {"state_dict": model_state(module)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(module, optimizer, for_loading=True)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        load_optimizer_state(module, optimizer, state[f"optimizer_{i}"])
    metadata: dict[str, Any] = torch.load(path / METADATA_FILENAME, weights_only=False)
    return metadata
