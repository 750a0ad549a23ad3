"""Gathering a batch's values over the data-parallel ranks, from the ranks that hold them.

Only the data-parallel ranks read different samples: tensor-parallel peers hold the same values, and under
pipelining only the last stage's ranks hold the model's outputs. A value gathered over the whole world would count
each sample tp × pp times. :func:`gather_tensors` and :func:`gather_objects` gather over one data-parallel group;
the engine then hands the last stage's result to every pipeline rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``data`` with ``fn`` applied to every tensor in it (nested lists, tuples and dicts; other values kept)."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_tensors(fn, v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        mapped = [map_tensors(fn, v) for v in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    return data


def only_tensors(data: Any) -> bool:
    """Whether every leaf of ``data`` (nested lists, tuples and dicts) is a tensor."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(only_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(only_tensors(v) for v in data)
    return False


def gather_tensors(data: Any, group: Any, size: int) -> Any:
    """Every tensor of ``data`` from the ``size`` ranks of ``group``, concatenated on the first dimension (a scalar
    counts as one row), on every rank of the group."""

    def gathered(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(1) if t.dim() == 0 else t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    return map_tensors(gathered, data)


def gather_objects(items: list[Any], group: Any, size: int) -> list[Any]:
    """The lists ``items`` of the ``size`` ranks of ``group``, concatenated in rank order (pickled)."""
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, items, group=group)
    return [item for part in parts for item in part]
