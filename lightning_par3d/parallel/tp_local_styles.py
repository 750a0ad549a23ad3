"""Tensor-parallel styles that compute on local tensors, with the collectives stated explicitly (Megatron's way).

torch's ``ColwiseParallel`` and ``RowwiseParallel`` cover the plain cases. A few transformers styles have no torch
counterpart, and run the module on each rank's local shards instead:

* :class:`PackedLinear` (``packed_colwise``, ``packed_rowwise``): a fused projection whose output (or input) is
  ``pack`` components side by side. Each component is split over the ranks and each rank keeps its part of every
  component, ``[gate_r; up_r]`` (``_StridedShard`` with ``split_factor=pack``), so that the model's own
  ``chunk(pack)`` of the output pairs matching parts.
* :class:`GradAllReduce` (``replicated_with_grad_allreduce``): whole parameters used on each rank's own part of the
  activations; their gradients are summed over the tensor-parallel ranks.
* :class:`OutputAllReduce` (``all_reduce``): the output is each rank's partial sum: all-reduced.
* :class:`LocalParams` (``local_params``): the module runs on its parameters' local shards.
* :class:`MoeExperts` (``moe_tp_experts``): a mixture-of-experts block's experts, every expert split over the ranks
  along its hidden size (Megatron's expert tensor parallelism): each rank runs every routed token through its part
  of each expert; the partial outputs are summed.

Parameters stay ``nn.Parameter`` objects under their own names (DTensors where they are split), so state dicts,
optimizers, FSDP2 and checkpoints treat them as any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_par3d.utils.torch_private import strided_shard


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the input fed every rank's partial result)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """Forward sums the partial results over the group; backward is the identity (every rank holds the sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _replace_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Sets ``module.forward`` (an instance attribute, so hooks and ``__call__`` still apply) to ``make(original)``."""
    module.forward = make(module.forward)


@contextmanager
def _parameters_as(module: nn.Module, convert: Callable[[nn.Parameter], torch.Tensor]) -> Iterator[None]:
    """Inside, the module's own parameters read as ``convert(parameter)`` (differentiable), as transformers' local
    parameter context does; the parameters themselves are untouched."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if param is not None:
                module._parameters[name] = convert(param)  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


class PackedLinear(ParallelStyle):
    """``nn.Linear`` whose output (``dim=0``, packed colwise) or input (``dim=1``, packed rowwise) dimension holds
    ``pack`` equal components; each rank keeps its part of every component."""

    def __init__(self, dim: int, pack: int) -> None:
        super().__init__()
        self.dim, self.pack = dim, pack

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, distribute_tensor

        if not isinstance(module, nn.Linear):
            raise ValueError(f"packed styles apply to nn.Linear; got {type(module).__name__}.")
        group = device_mesh.get_group()
        for name, param in list(module.named_parameters(recurse=False)):
            split = self.dim == 0 or param.dim() > 1  # a rowwise bias is added whole, after the sum
            placement = (
                strided_shard()(self.dim if param.dim() > 1 else 0, split_factor=self.pack) if split else Replicate()
            )
            shard = distribute_tensor(param, device_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))

        def colwise(_: Callable[..., Any]) -> Callable[..., Any]:
            def forward(x: torch.Tensor) -> torch.Tensor:
                return F.linear(_CopyToRanks.apply(x, group), _local(module.weight), _local(module.bias))

            return forward

        def rowwise(_: Callable[..., Any]) -> Callable[..., Any]:
            def forward(x: torch.Tensor) -> torch.Tensor:
                out = _SumOverRanks.apply(F.linear(x, _local(module.weight)), group)
                return out if module.bias is None else out + _local(module.bias)

            return forward

        _replace_forward(module, colwise if self.dim == 0 else rowwise)
        return module


class GradAllReduce(ParallelStyle):
    """Whole parameters on every rank, each rank using them on its own activations (its heads): gradients summed
    over the tensor-parallel ranks during backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                with _parameters_as(module, lambda p: _CopyToRanks.apply(p, group) if p.requires_grad else p):
                    return original(*args, **kwargs)

            return forward

        _replace_forward(module, make)
        return module


class OutputAllReduce(ParallelStyle):
    """The module's output is each rank's partial sum: all-reduced (backward: the identity)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_hook(lambda _m, _i, out: _SumOverRanks.apply(out, group))
        return module


def _split_parameters(module: nn.Module, params: dict[str, str], device_mesh: DeviceMesh) -> None:
    """Each of ``module``'s parameters named in ``params`` (name → style) as a DTensor split as its style says
    (:data:`~lightning_par3d.config.tp_vocabulary.PARAMETER_STYLES`: a packed one in interleaved pieces)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_par3d.config.tp_vocabulary import PACK, PARAMETER_STYLES

    for name, style in params.items():
        param = module.get_parameter(name)
        dim = param.dim() + PARAMETER_STYLES[style]
        placement = strided_shard()(dim, split_factor=PACK) if style.startswith("packed") else Shard(dim)
        shard = distribute_tensor(param, device_mesh, [placement], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


class LocalParams(ParallelStyle):
    """The module computes with its parameters' local shards (``params``: the plan's entries that split them)."""

    def __init__(self, params: dict[str, str]) -> None:
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _split_parameters(module, self.params, device_mesh)

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                with _parameters_as(module, _local):
                    return original(*args, **kwargs)

            return forward

        _replace_forward(module, make)
        return module


class MoeExperts(ParallelStyle):
    """A mixture-of-experts block's experts (transformers' ``*Experts``: ``forward(hidden_states, top_k_index,
    top_k_weights)`` over 3-D weights, one slice per expert), each expert split over the ranks along its hidden
    size (``params``: the plan's entries for its weights, ``gate_up_proj`` packed column-wise, ``down_proj``
    row-wise).

    Every rank holds the whole routed batch (the tokens and the router's choices are replicated over tp) and runs
    each token through its part of its experts: the outputs are partial sums, all-reduced in forward. The tokens and
    the routing weights fed every rank's partial result, so their gradients are summed over the ranks in backward;
    the router itself stays replicated, and each rank computes its gradient whole."""

    def __init__(self, params: dict[str, str]) -> None:
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _split_parameters(module, self.params, device_mesh)
        group = device_mesh.get_group()

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
                hidden_states = _CopyToRanks.apply(_local(hidden_states), group)
                top_k_weights = _CopyToRanks.apply(_local(top_k_weights), group)
                with _parameters_as(module, _local):
                    out = original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
                return _SumOverRanks.apply(out, group)

            return forward

        _replace_forward(module, make)
        return module
