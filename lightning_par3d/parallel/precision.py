"""Precision under par3d: the ``precision=`` names (Lightning's), mapped onto FSDP2 and autocast.

===============  ==========================================================================================
``32-true``      fp32 everywhere.
``bf16-mixed``   fp32 master weights, gradients and optimizer state; the forward and backward run in bf16 under
                 ``torch.autocast``. FSDP2 units (zero_stage 3, and replication with tp) also gather their
                 parameters in bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): half the
                 all-gather bytes, gradients reduced in fp32.
``bf16-true``    the model is built and kept in bf16: weights, gradients and optimizer state, no fp32 master copy.
``16-mixed``     as ``bf16-mixed`` with fp16, on CUDA, with a gradient scaler whose overflow check is combined
                 over every rank (each holds different shards); not with zero_stage 1 or 2. Lightning itself turns
                 ``16-mixed`` on CPU into ``bf16-mixed``.
===============  ==========================================================================================

Gradient clipping clips by the norm over every tp, dp and pp shard in every mode. The Lightning precision plugins
that carry these modes into the Trainer live in :mod:`lightning_par3d.integrations.lightning_precision`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
"""The ``precision=`` values par3d accepts."""


@dataclass(frozen=True)
class ElementBytes:
    """Bytes of one element of each kind of tensor under a precision."""

    compute: int
    """An activation, and a matmul's operands (what autocast computes in)."""
    param: int
    grad: int
    state: int
    """An element of the optimizer's state (Adam's moments)."""


ELEMENT_BYTES = {
    "32-true": ElementBytes(compute=4, param=4, grad=4, state=4),
    "bf16-mixed": ElementBytes(compute=2, param=4, grad=4, state=4),
    "16-mixed": ElementBytes(compute=2, param=4, grad=4, state=4),
    "bf16-true": ElementBytes(compute=2, param=2, grad=2, state=2),
}
"""Each precision's element sizes: the one table the planner's time and memory models read."""


def element_bytes(precision: str) -> ElementBytes:
    """:data:`ELEMENT_BYTES` of ``precision`` (fp32's for one par3d does not name)."""
    return ELEMENT_BYTES.get(precision, ELEMENT_BYTES["32-true"])


def precision_name(plugin: Any) -> str:
    """The ``precision=`` string of a Lightning (Trainer or Fabric) precision plugin."""
    return str(getattr(plugin, "precision", "32-true"))


def check_precision(precision: str, zero_stage: int) -> None:
    """Raises ``ValueError`` for a precision par3d does not serve (at this ZeRO stage)."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"par3d does not support precision={precision!r}. Choose among {', '.join(map(repr, PRECISIONS))}."
        )
    if precision == "16-mixed" and zero_stage in (1, 2):
        raise ValueError(
            f"precision='16-mixed' scales the loss and unscales gradients before the step, but zero_stage="
            f"{zero_stage} keeps the gradients in its own shards. Use precision='bf16-mixed' (no scaling needed), "
            "or zero_stage 0 or 3."
        )


@contextmanager
def built_in(precision: str) -> Iterator[None]:
    """Inside, new floating-point tensors default to the dtype of a ``*-true`` precision (bf16 for ``bf16-true``,
    fp16 for ``16-true``), as Lightning's precision plugin builds the model under those; else nothing changes."""
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def autocast(precision: str, device_type: str = "cpu") -> Any:
    """The ``torch.autocast`` a ``-mixed`` precision's forward runs under (as Lightning's precision plugin wraps
    the step), else a context that does nothing."""
    from contextlib import nullcontext

    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    return torch.autocast(device_type, dtype=low) if low is not None else nullcontext()


def fsdp_mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``precision``: low-precision gathered parameters and fp32 gradient reduction for the
    ``-mixed`` modes; None (FSDP2's default: the parameters' own dtype) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if low is None:
        return None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


class GlobalGradScaler(torch.amp.GradScaler):
    """fp16 loss scaling for sharded models: the overflow check looks at each rank's own shard of every gradient
    (DTensors included) and is combined over all ranks, so every rank skips or takes the step together."""

    @override
    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        from lightning_par3d.parallel.tensor_parallel import local_tensor
        from lightning_par3d.utils.torch_private import unscale_and_check_finite

        grads = [local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            unscale_and_check_finite(grads, found_inf, inv_scale)
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}
