"""Saving and loading a :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer`'s state: sharded, gathered, or by name.

Each state tensor of the inner optimizer holds this rank's rows of one parameter's state. Seen as a DTensor on the
``(dp_replicate, dp_shard, tp)`` mesh, whose global shape is the parameter's (placements: replicated over
``dp_replicate``, ``Shard(0)`` over ``dp_shard`` (``_StridedShard`` under a tp cut of dim 0, FSDP2's layout), and the
parameter's own tp placement), it is what ``torch.distributed.checkpoint`` saves piece by piece, and what
``full_tensor()`` gathers into the single-process state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_par3d.zero.buckets import ParamShard


class ZeroStateDicts:
    """The state-dict half of :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer` (a mixin: it uses the wrapper's
    ``param_groups``, ``inner`` optimizer, ``_shards`` and ``_state_mesh``)."""

    param_groups: list[dict[str, Any]]
    inner: Optimizer
    _shards: dict[Tensor, ParamShard]
    _state_mesh: Any

    def _as_dtensor(self, shard: ParamShard, value: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        shape = shard.param.shape
        return DTensor.from_local(
            value, self._state_mesh, shard.placements, run_check=False, shape=shape, stride=_contiguous(shape)
        )

    def _is_sharded_state(self, shard: ParamShard, value: Any) -> bool:
        return isinstance(value, Tensor) and value.shape == shard.tensor.shape and value.dim() > 0

    def _ensure_state(self) -> None:
        """Creates the inner optimizer's state (as a step with zero gradients and learning rate 0 would), so that a
        checkpoint can be loaded into it in place before the first real step."""
        if all(self.inner.state.get(s.tensor) for s in self._shards.values()):
            return
        saved_lrs = [group["lr"] for group in self.inner.param_groups]
        for shard in self._shards.values():
            shard.tensor.grad = torch.zeros_like(shard.tensor)
        for group in self.inner.param_groups:
            group["lr"] = 0.0
        self.inner.step()
        for group, lr in zip(self.inner.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        self.inner.zero_grad(set_to_none=True)

    def sharded_state_dict(self, names: dict[Tensor, str], for_loading: bool = False) -> dict[str, Any]:
        """The state keyed by parameter name, DCP's flattened optimizer layout (``state.<name>.exp_avg``,
        ``param_groups.<name>.lr``): each state tensor is a DTensor whose global shape is the parameter's, holding
        only this rank's rows, so ``torch.distributed.checkpoint`` writes every piece once and never gathers.
        ``for_loading`` first creates the state (before the first step there is none) for DCP to load into."""
        if for_loading:
            self._ensure_state()
        out: dict[str, Any] = {}
        for group in self.param_groups:
            for param in group["params"]:
                shard, name = self._shards[param], names[param]
                for key, value in self.inner.state[shard.tensor].items():
                    sharded = self._is_sharded_state(shard, value)
                    out[f"state.{name}.{key}"] = self._as_dtensor(shard, value) if sharded else value
                out.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
        return out

    def load_sharded_state_dict(self, state: dict[str, Any], names: dict[Tensor, str]) -> None:
        """Restores from :meth:`sharded_state_dict`'s layout (tensors DCP loaded in place are kept as they are)."""
        self._ensure_state()
        for group in self.param_groups:
            for param in group["params"]:
                shard, name = self._shards[param], names[param]
                inner_state = self.inner.state[shard.tensor]
                for key in inner_state:
                    value = state[f"state.{name}.{key}"]
                    inner_state[key] = self._local_piece(shard, value, inner_state[key])
                group.update({k: state[f"param_groups.{name}.{k}"] for k in group if k != "params"})

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s layout (``state`` by parameter index, ``param_groups``), each state tensor a DTensor
        holding this rank's rows of the parameter-shaped whole. :meth:`full_state_dict` gathers it."""
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            ids = []
            for param in group["params"]:
                shard = self._shards[param]
                state[index] = {
                    k: self._as_dtensor(shard, v) if self._is_sharded_state(shard, v) else v
                    for k, v in self.inner.state[shard.tensor].items()
                }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def full_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every tensor gathered whole (a collective: call it on every rank). It loads into
        the plain optimizer of a single-process run of the same model."""
        from torch.distributed.tensor import DTensor

        sharded = self.state_dict()
        for entry in sharded["state"].values():
            for key, value in entry.items():
                if isinstance(value, DTensor):
                    entry[key] = value.full_tensor()
        return sharded

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads :meth:`state_dict` or :meth:`full_state_dict` output (or a plain optimizer's state dict of the same
        parameters): whole tensors are cut to this rank's rows (and tensor-parallel piece)."""
        self._ensure_state()
        shards = [self._shards[p] for group in self.param_groups for p in group["params"]]
        for index, shard in enumerate(shards):
            saved = state_dict["state"].get(index, {})
            inner_state = self.inner.state[shard.tensor]
            for key in inner_state:
                inner_state[key] = self._local_piece(shard, saved[key], inner_state[key])
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

    def _local_piece(self, shard: ParamShard, value: Any, current: Any) -> Any:
        """This rank's part of a saved state value, shaped like ``current``."""
        from torch.distributed.tensor import DTensor

        if not isinstance(value, Tensor) or not isinstance(current, Tensor):
            return value
        if isinstance(value, DTensor):
            if tuple(value.placements) != shard.placements:
                value = value.redistribute(self._state_mesh, shard.placements)
            value = value.to_local()
        elif value.shape == shard.param.shape and current.shape != value.shape:
            value = shard.owned_rows(_tp_piece(shard.param, value))
        if value.data_ptr() != current.data_ptr():
            current.copy_(value.view_as(current))
        return current


def _tp_piece(param: Tensor, whole: Tensor) -> Tensor:
    """This rank's tensor-parallel piece of a parameter-shaped ``whole``: cut by the parameter's own placements,
    locally (``src_data_rank=None``: every rank holds ``whole``, nothing is sent)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.detach(), param.device_mesh, param.placements, src_data_rank=None).to_local()


def _contiguous(shape: Iterable[int]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
