"""The two tensor-parallel styles at the edges of a sequence-parallel region that torch has no single style for.

Megatron's sequence parallelism keeps the residual stream of a transformer split along the sequence over the
tensor-parallel ranks: norms, dropouts and residual additions run on ``T / tp`` tokens, and the regions that split
the weights (attention, MLP) gather the sequence on entry and reduce-scatter it on exit (``rowwise_seq``). torch's
``PrepareModuleInput`` does the gathering, but only for an argument named in advance, positionally or by keyword,
and a transformers attention module takes ``hidden_states=`` by keyword where the example GPT's takes it
positionally. These styles act on the module's first tensor argument, or ``hidden_states=``:

* :class:`SequenceShard` (``sequence_shard``): the input is whole on every rank; the module gets this rank's
  sequence shard (no communication; backward all-gathers the gradient). On the first block of the model.
* :class:`GatherSequence` (``gather_sequence``): the input is this rank's sequence shard (a local tensor, or a
  ``Shard(1)`` DTensor from a ``sequence_parallel`` norm); the module gets the whole sequence as a local tensor
  (one all-gather; backward reduce-scatters). On the parent of column-wise projections (attention, MLP), so that
  ``q``, ``k`` and ``v`` share one gather.
* :class:`WholeSequence` (``whole_sequence``): gathers as ``gather_sequence`` does, and cuts the module's output
  (whole and the same on every rank, as a plain tensor-parallel plan leaves it) back to this rank's sequence shard
  (no communication; backward all-gathers the gradient). On a mixture-of-experts block: its router and experts see
  every token, as without sequence parallelism, so the tp ranks route the same tokens to the same experts.

All three redistribute through DTensor (torch's collectives). None touches the module's parameters: the module's own
plan entries (and FSDP2) keep theirs. The sequence length must divide by tp: a shard of uneven length would need
each rank to know the others' lengths, and the error says so at the first step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

SEQUENCE_DIM = 1
"""Activations are (batch, sequence, hidden): the sequence is dim 1 (torch's ``SequenceParallel`` default)."""


def _input_slot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """Where the residual stream enters: the first positional tensor, else ``hidden_states=``."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return f"arg{i}", arg
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    return None


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], slot: str, value: torch.Tensor) -> Any:
    if slot == "hidden_states":
        return args, {**kwargs, "hidden_states": value}
    i = int(slot[3:])
    return (*args[:i], value, *args[i + 1 :]), kwargs


def _check_divisible(module: nn.Module, length: int, mesh: DeviceMesh, style: str) -> None:
    if length % mesh.size() != 0:
        raise ValueError(
            f"sequence parallelism splits the sequence over tp={mesh.size()} ranks, but {type(module).__name__} "
            f"({style}) got a sequence of {length} tokens, which does not divide. Pad or crop the sequences to a "
            f"multiple of {mesh.size()}, or set sequence_parallel=False."
        )


def _shard_of(module: nn.Module, x: torch.Tensor, mesh: DeviceMesh, style: str) -> torch.Tensor:
    """This rank's sequence shard of ``x``, whole and the same on every rank (a local tensor, or a DTensor); no
    communication, and backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()
    _check_divisible(module, x.shape[SEQUENCE_DIM], mesh, style)
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()


class _SequenceEdge(ParallelStyle):
    """A forward pre-hook that moves the module's residual-stream input between whole and sequence-sharded."""

    name = ""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            slot = _input_slot(args, kwargs)
            if slot is None:
                raise TypeError(
                    f"{type(mod).__name__} ({self.name}) got no tensor input to split or gather: it takes the "
                    "residual stream as its first tensor argument or as hidden_states=."
                )
            return _replace(args, kwargs, slot[0], self.convert(mod, slot[1], device_mesh))

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def convert(self, module: nn.Module, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        raise NotImplementedError


class SequenceShard(_SequenceEdge):
    """Whole input → this rank's sequence shard (see the module docstring)."""

    name = "sequence_shard"

    def convert(self, module: nn.Module, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return _shard_of(module, x, mesh, self.name)


class GatherSequence(_SequenceEdge):
    """This rank's sequence shard → the whole sequence, local (see the module docstring)."""

    name = "gather_sequence"

    def convert(self, module: nn.Module, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        return shard.redistribute(mesh, [Replicate()]).to_local()


class WholeSequence(GatherSequence):
    """This rank's sequence shard → the whole sequence on entry; the whole output → this rank's shard on exit (see
    the module docstring). The output is a tensor, or a tuple or list whose first item is the hidden states (the rest,
    a router's logits, say, stays as the module returns it)."""

    name = "whole_sequence"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def cut(mod: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, torch.Tensor):
                return _shard_of(mod, output, device_mesh, self.name)
            if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
                return type(output)([_shard_of(mod, output[0], device_mesh, self.name), *output[1:]])
            raise TypeError(
                f"{type(mod).__name__} ({self.name}) returned {type(output).__name__}: it must return the hidden "
                "states, alone or first in a tuple, to cut back to this rank's sequence shard."
            )

        module.register_forward_hook(cut)
        return module
