"""Lightning Trainer precision plugins for par3d: Lightning's own autocast and scaling, with gradient clipping by
the global norm over every tp, dp and pp shard (:meth:`~lightning_par3d.engine.Par3DEngine.clip_grad_norm_`).

The precision modes themselves are described in :mod:`lightning_par3d.parallel.precision`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.parallel.precision import PRECISIONS, GlobalGradScaler, check_precision, precision_name

if TYPE_CHECKING:
    from lightning_par3d.engine import Par3DEngine


class _GlobalNormClipping:
    """Clips by the norm over every shard (tp, dp, and every pipeline stage), as a single process would."""

    engine: Par3DEngine | None = None
    """Set by the strategy when it connects the plugin."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:
            raise RuntimeError("par3d's precision plugin clips gradients only once the strategy has connected it.")
        self.engine.clip_grad_norm_(optimizer, float(clip_val))


class Par3DPrecision(_GlobalNormClipping, Precision):
    """``precision="32-true"``."""


class Par3DMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"`` (or ``"16-mixed"`` on CUDA): Lightning's autocast, global-norm clipping."""

    def __init__(self, precision: str, device: str, scaler: Any = None) -> None:
        if precision == "16-mixed" and scaler is None:
            scaler = GlobalGradScaler(device)
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]


class Par3DHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"``: the model built and trained in bf16."""


def as_par3d_precision(plugin: Precision) -> Precision:
    """par3d's counterpart of a Lightning Trainer precision plugin (which clips by the global norm)."""
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    name = precision_name(plugin)
    check_precision(name, zero_stage=0)
    if type(plugin) is Precision:
        return Par3DPrecision()
    if isinstance(plugin, MixedPrecision):
        return Par3DMixedPrecision(name, plugin.device)
    if isinstance(plugin, HalfPrecision) and name == "bf16-true":
        return Par3DHalfPrecision("bf16-true")
    raise ValueError(
        f"par3d does not support the {type(plugin).__name__} plugin (precision={name!r}). Use "
        f"precision= one of {', '.join(map(repr, PRECISIONS))}."
    )


class UsesPar3DPrecision(ParallelStrategy):
    """The Trainer strategy's precision plugin: Lightning's ``precision=`` as par3d's plugin
    (:func:`as_par3d_precision`), connected to the engine, whose ``precision`` (the name, ``"bf16-mixed"`` say) the
    rest of par3d reads."""

    engine: Par3DEngine

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self.precision_plugin = Par3DPrecision()
        assert self._precision_plugin is not None
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        """Lightning's ``precision=`` plugin, as par3d's (global-norm clipping); an unsupported one raises here."""
        plugin = as_par3d_precision(precision_plugin) if precision_plugin is not None else None
        if plugin is not None:
            plugin.engine = self.engine  # type: ignore[attr-defined]
            self.engine.precision = precision_name(plugin)
        self._precision_plugin = plugin

    @property
    def precision(self) -> str:
        """Lightning's ``precision=`` value in use (``"32-true"``, ``"bf16-mixed"``, …)."""
        return self.engine.precision
