"""The ZeRO formulas: the model-state bytes one rank holds at each stage, padding included.

With ``Ψ`` parameter elements on a rank (after tensor and pipeline parallelism), ``N = dp_shard`` and ``K`` bytes
of optimizer state per element (Adam in fp32: 8), the ZeRO paper gives, per rank:

=====  ============  ============  ============
stage  parameters    gradients     optimizer
=====  ============  ============  ============
0      Ψ             Ψ             K·Ψ
1      Ψ             Ψ             K·Ψ / N
2      Ψ             Ψ / N         K·Ψ / N
3      Ψ / N         Ψ / N         K·Ψ / N
=====  ============  ============  ============

(parameters and gradients times their element size). Here each tensor is cut along dim 0 into ``N`` chunks of
``ceil(rows / N)`` rows, as par3d (FSDP2 and :mod:`lightning_par3d.zero`) cuts it, so ``Ψ / N`` means "this rank's
chunk" and the padding of the last chunk counts where a storage holds it: a whole parameter under stage 1 or 2 is
stored padded to ``N · ceil(rows / N)`` rows, a stage-2 or FSDP2 gradient shard and an FSDP2 parameter shard have
``ceil(rows / N)`` rows on every rank, and optimizer state has exactly the rank's own rows. 0-d tensors are not cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    """A rank's model state in bytes."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class OptimizerStateLayout:
    """How much state an optimizer keeps per parameter tensor."""

    per_element: int
    """State tensors shaped like the parameter (Adam: ``exp_avg`` and ``exp_avg_sq``, so 2), in its dtype."""
    scalar_bytes: int = 0
    """Bytes of scalar state per parameter tensor (Adam's ``step``, a float32: 4)."""


OPTIMIZER_STATE_LAYOUTS = {
    "adam": OptimizerStateLayout(2, 4),
    "adamw": OptimizerStateLayout(2, 4),
    "sgd": OptimizerStateLayout(0),
    "sgd_momentum": OptimizerStateLayout(1),
}
"""Known optimizers, by the names :func:`lightning_par3d.estimate_memory` accepts."""


def _rows_and_rest(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(shape[1:])


def tensor_state_elements(shape: Sequence[int], stage: int, n: int, index: int = 0) -> tuple[int, int, int]:
    """``(parameter, gradient, optimizer-state)`` elements one tensor of ``shape`` takes on dp_shard rank
    ``index`` of ``n`` at ZeRO ``stage`` (optimizer state per state tensor)."""
    rows, rest = _rows_and_rest(shape)
    whole = rows * rest
    if n == 1 or len(shape) == 0 or stage == 0:
        return whole, whole, whole
    chunk = math.ceil(rows / n)
    own = min(max(rows - index * chunk, 0), chunk) * rest
    padded_whole, padded_chunk = n * chunk * rest, chunk * rest
    if stage == 1:
        return padded_whole, whole, own
    if stage == 2:
        return padded_whole, padded_chunk, own
    return padded_chunk, padded_chunk, own


def model_state_formula(
    shapes: Sequence[Sequence[int]],
    stage: int,
    n: int,
    index: int = 0,
    param_bytes: int = 4,
    grad_bytes: int | None = None,
    optimizer: OptimizerStateLayout = OPTIMIZER_STATE_LAYOUTS["adamw"],
    state_bytes: int | None = None,
    frozen: Sequence[bool] = (),
) -> ModelStateBytes:
    """The bytes of parameters, gradients and optimizer state that dp_shard rank ``index`` of ``n`` holds at ZeRO
    ``stage`` for parameters of ``shapes`` (their local shapes on this rank). ``frozen``: per shape, whether the
    parameter is frozen (``requires_grad=False``, a fine-tune's base): it holds its parameter bytes only, with no
    gradient and no optimizer state (an optimizer keeps none for a parameter that never has a gradient)."""
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    state_bytes = param_bytes if state_bytes is None else state_bytes
    params = grads = states = scalars = 0
    flags = list(frozen) or [False] * len(shapes)
    for shape, is_frozen in zip(shapes, flags, strict=True):
        p, g, s = tensor_state_elements(shape, stage, n, index)
        params += p
        if is_frozen:
            continue
        grads += g
        states += s
        scalars += optimizer.scalar_bytes
    return ModelStateBytes(
        params=params * param_bytes,
        grads=grads * grad_bytes,
        optimizer=states * optimizer.per_element * state_bytes + scalars,
    )
