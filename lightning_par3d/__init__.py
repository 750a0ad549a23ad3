"""lightning_par3d: one LightningModule, any mix of data, tensor and pipeline parallelism.

Importing the package registers the strategy as ``"par3d"`` for both ``lightning.Trainer`` and ``lightning.Fabric``::

    import lightning as L
    import lightning_par3d  # noqa: F401  (registers "par3d")

    L.Trainer(strategy="par3d", devices=4)  # fully sharded data parallel over all ranks
    L.Trainer(devices=4, strategy=lightning_par3d.Par3DStrategy(dp_shard=2, tp=2))

The package does not import Lightning itself: ``Par3DStrategy`` and ``Par3DFabricStrategy`` load on first use, and
the registration happens when Lightning is imported, before or after this package
(:mod:`lightning_par3d.registration`), so ``import lightning_par3d.engine`` in a plain torch or
Accelerate script costs no Lightning import.
"""

import sys
import types
from typing import TYPE_CHECKING, Any

from lightning_par3d.compose import parallelize
from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.config.tp_vocabulary import STYLE_NAMES
from lightning_par3d.distributed.gradients import clip_grad_norm_, total_grad_norm
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.memory.estimate import MemoryEstimate, estimate_memory
from lightning_par3d.memory.meters import SavedTensorMeter, model_state_bytes
from lightning_par3d.planning import calibrate, choose_layout, plan
from lightning_par3d.registration import register_when_lightning_loads
from lightning_par3d.tools import moved_entry_points
from lightning_par3d.tools.dry_run import dry_run
from lightning_par3d.utils.console import quiet_known_upstream_warnings
from lightning_par3d.zero.formula import ModelStateBytes
from lightning_par3d.zero.optimizer import ZeroOptimizer

__all__ = [
    "STYLE_NAMES",
    "Layout",
    "MemoryEstimate",
    "ModelStateBytes",
    "Par3DConfig",
    "Par3DEngine",
    "Par3DFabricStrategy",
    "Par3DMesh",
    "Par3DStrategy",
    "SavedTensorMeter",
    "ZeroOptimizer",
    "calibrate",
    "choose_layout",
    "clip_grad_norm_",
    "dry_run",
    "estimate_memory",
    "model_state_bytes",
    "parallelize",
    "plan",
    "quiet_known_upstream_warnings",
    "resolve_layout",
    "total_grad_norm",
]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lightning_par3d.integrations.fabric import Par3DFabricStrategy
    from lightning_par3d.integrations.trainer import Par3DStrategy


class _AccelerateFrontEnd(types.ModuleType):
    """``lightning_par3d.accelerate`` (``from lightning_par3d.accelerate import Par3DAccelerator``): the Accelerate
    front-end, :mod:`lightning_par3d.integrations.accelerator`, imported (with the ``accelerate`` package) on first
    use. A name only, with no file of its own: a file ``lightning_par3d/accelerate.py`` shadowed the ``accelerate``
    package wherever the ``lightning_par3d/`` folder itself came onto ``sys.path``."""

    def __getattr__(self, name: str) -> Any:
        from lightning_par3d.integrations import accelerator

        if name == "__all__":
            return ["PRECISIONS", "Par3DAccelerator"]
        return getattr(accelerator, name)


sys.modules.setdefault(f"{__name__}.accelerate", _AccelerateFrontEnd(f"{__name__}.accelerate"))
moved_entry_points.install(__name__)  # `python -m lightning_par3d.plan`, `.smoke`, `.transformers` for one release


def __getattr__(name: str) -> Any:
    """The Lightning front-ends, imported (with Lightning) on first use; the Accelerate front-end's module name."""
    if name == "accelerate":
        return sys.modules[f"{__name__}.accelerate"]
    if name == "Par3DStrategy":
        from lightning_par3d.integrations.trainer import Par3DStrategy

        return Par3DStrategy
    if name == "Par3DFabricStrategy":
        from lightning_par3d.integrations.fabric import Par3DFabricStrategy

        return Par3DFabricStrategy
    raise AttributeError(f"module 'lightning_par3d' has no attribute {name!r}")


register_when_lightning_loads()
