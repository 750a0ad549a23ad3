"""Memory, measured: the bytes a rank really holds, counted from its tensors.

Every count is of storages, each counted once: a view, an FSDP2 shard (a view into its padded buffer) or the rows a
ZeRO optimizer steps (a view into the parameter) adds nothing of its own, and padding is included because the
storage includes it. :func:`model_state_bytes` splits a rank's model state into parameters, gradients and optimizer
state; :class:`SavedTensorMeter` measures activations as the bytes autograd keeps saved for backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par3d.parallel.activation_checkpoint import CACHE_OBSERVERS
from lightning_par3d.parallel.tensor_parallel import local_tensor
from lightning_par3d.utils.torch_private import view_base
from lightning_par3d.zero.formula import ModelStateBytes
from lightning_par3d.zero.optimizer import zero_optimizers


def storage_key(t: Tensor) -> int:
    """Identifies the storage behind ``t`` (its local tensor for a DTensor): equal for views of one storage."""
    return int(local_tensor(t).untyped_storage()._cdata)


def storage_bytes(t: Tensor) -> int:
    """The bytes of the whole storage behind ``t`` (padding and the rest of a view's base included)."""
    return int(local_tensor(t).untyped_storage().nbytes())


def unique_storage_bytes(tensors: Iterable[Tensor | None], seen: set[int] | None = None) -> int:
    """The bytes of the storages behind ``tensors``, each counted once (and not if already in ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += storage_bytes(t)
    return total


def optimizer_state_tensors(optimizer: Any) -> list[Tensor]:
    """Every tensor of an optimizer's state; a ZeRO wrapper's are its inner optimizer's (this rank's rows)."""
    zero = zero_optimizers([optimizer])
    inner = zero[0].inner if zero else getattr(optimizer, "_optimizer", optimizer)
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, Tensor)]


def model_state_bytes(module: nn.Module, optimizers: Iterable[Any]) -> ModelStateBytes:
    """Parameters, gradients and optimizer state this rank holds now, counted from its tensors.

    Parameters first, so that a gradient or a state tensor sharing a parameter's storage is not counted twice.
    Gradients include a ZeRO-2 optimizer's gradient rows. Call it between backward and the optimizer step to see
    gradients, and after a first step to see optimizer state.
    """
    optimizers = list(optimizers)
    seen: set[int] = set()
    params = list(module.parameters())
    param_bytes = unique_storage_bytes(params, seen)
    grads: list[Tensor | None] = [p.grad for p in params]
    for zero in zero_optimizers(optimizers):
        grads += [t.grad for group in zero.inner.param_groups for t in group["params"]]
    grad_bytes = unique_storage_bytes(grads, seen)
    state_bytes = sum(unique_storage_bytes(optimizer_state_tensors(opt), seen) for opt in optimizers)
    return ModelStateBytes(param_bytes, grad_bytes, state_bytes)


class SavedTensorMeter:
    """Measures activation memory: the storages autograd keeps saved for backward, from the moment a tensor is
    saved until its storage is freed, with the peak of their live total.

    Use it as a context manager around forward and backward (``torch.autograd.graph.saved_tensors_hooks``).
    Parameters (and views of them) are not activations and are not counted, nor are meta tensors; a storage saved
    several times counts once, and stops counting when torch frees it (a finalizer on the storage object, which
    torch keeps unique per storage). Tensors that selective activation checkpointing (``op`` mode) caches for
    backward are reported to it through ``activation_checkpoint.CACHE_OBSERVERS``. Tensors that full checkpointing
    recomputes during backward are not seen (they are saved under checkpointing's own hooks), so under
    checkpointing this is the memory held between forward and backward.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._counted: set[int] = set()
        self._hooks: Any = None

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        CACHE_OBSERVERS.append(self.count_all)
        return self

    def __exit__(self, *exc: object) -> None:
        CACHE_OBSERVERS.remove(self.count_all)
        self._hooks.__exit__(*exc)

    def _pack(self, t: Tensor) -> Tensor:
        self.count(t)
        return t

    def count(self, t: Tensor) -> None:
        """Counts ``t``'s storage from now until torch frees it (unless it is a parameter's, or meta)."""
        if _is_parameter(t) or local_tensor(t).is_meta:  # meta: torch's pipeline shape inference holds no memory
            return
        storage = local_tensor(t).untyped_storage()
        key = storage_key(t)
        if key in self._counted:
            return
        nbytes = int(storage.nbytes())
        self._counted.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def count_all(self, tensors: Iterable[Any]) -> None:
        """Counts every tensor among ``tensors`` (selective checkpointing's cached outputs)."""
        for t in tensors:
            if isinstance(t, Tensor):
                self.count(t)

    def _release(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def _is_parameter(t: Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` that a linear layer saves)."""
    base = view_base(t)
    base = t if base is None else base
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _unpack(packed: Tensor) -> Tensor:
    return packed
