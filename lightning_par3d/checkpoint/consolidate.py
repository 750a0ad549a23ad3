"""A par3d checkpoint directory (any layout) → one file that ``torch.load`` reads, offline, running nothing in it.

    par3d consolidate outputs/<date>/<time>/checkpoints/last.ckpt

writes ``last.ckpt.consolidated`` beside it: the layout of Lightning's ``consolidate_checkpoint`` (the model under
``state_dict``, each optimizer under its key, ``meta.pt``'s entries at the top), so Lightning's
``trainer.fit(model, ckpt_path=...)`` on one device, or ``torch.load``, reads it. Lightning's own
``python -m lightning.fabric.utilities.consolidate_checkpoint`` reads DCP's ``.metadata`` with plain ``pickle`` (any
code in it runs); this reads it with par3d's reader (:mod:`~lightning_par3d.checkpoint.safe_reading`), and
``meta.pt`` with ``weights_only=True`` unless told otherwise.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_par3d.checkpoint.safe_reading import (
    load_shards,
    read_metadata,
    set_at_path,
)


def read_whole(path: str | Path, weights_only: bool | None = True) -> dict[str, Any]:
    """Every entry of the par3d checkpoint directory ``path``, whole, in this process (no process group): the
    model's and optimizers' tensors at their global shapes, nested as they were saved, and ``meta.pt``'s entries
    (read with ``weights_only``). Raises ``ValueError`` for a checkpoint it refuses or cannot read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_par3d.checkpoint.dcp import check_checkpoint, resolve_checkpoint

    path = resolve_checkpoint(Path(path))
    meta = check_checkpoint(path, {}, strict=False, weights_only=weights_only)
    metadata = read_metadata(path)
    flat: dict[str, Any] = {
        fqn: torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        for fqn, entry in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():  # that it reads in this one process is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_shards(flat, path, no_dist=True)
    nested: dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    for fqn, value in flat.items():
        set_at_path(nested, tuple(mappings.get(fqn, (fqn,))), value)
    nested.update(meta)
    return nested


def consolidate(path: str | Path, out: str | Path | None = None, weights_only: bool | None = True) -> Path:
    """Writes :func:`read_whole` of the checkpoint ``path`` to ``out`` (default: ``<path>.consolidated``) with
    ``torch.save``, completely or not at all; refuses an ``out`` that exists. Returns ``out``."""
    source = Path(path)
    target = Path(out) if out is not None else source.with_name(source.name + ".consolidated")
    if target.exists():
        raise FileExistsError(f"{target} exists: choose another output file, or move it away first.")
    whole = read_whole(source, weights_only)
    partial = target.with_name(f".{target.name}.partial")
    with open(partial, "wb") as f:
        torch.save(whole, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    return target
