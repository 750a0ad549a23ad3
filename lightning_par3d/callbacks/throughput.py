"""``ThroughputMonitor``: Lightning's, counting each sample once under tensor and pipeline parallelism.

Lightning's ``ThroughputMonitor`` multiplies one rank's samples/s by the world size. Under par3d the ranks of a
tensor-parallel or pipeline group read the same batch, so that counts every sample tp × pp times. This subclass
multiplies by the data-parallel size instead:

* ``samples_per_sec``, ``batches_per_sec``, ``items_per_sec``: one rank's rate × dp (every sample once);
  ``device/...``: that total divided over all ranks;
* ``flops_per_sec``: ``flops_per_batch`` is the FLOPs of the **whole model** on one rank's batch (what
  ``lightning.fabric.utilities.measure_flops`` gives for the unparallelized model); each rank does
  ``1 / (tp × pp)`` of them, so the total is ``dp × flops_per_batch`` per step and ``device/mfu`` is each rank's
  share over its peak;
* ``peak_flops_per_device`` gives the peak where Lightning knows none (CPUs, unknown accelerators), so MFU is
  reported there too.

Under another strategy it behaves as Lightning's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from typing_extensions import override

from lightning_par3d.callbacks.run_context import par3d_engine


class _DataParallelThroughput(Throughput):
    """Lightning's ``Throughput`` with sample rates scaled by ``dp`` and FLOPs shared over ``model_parallel`` ranks."""

    def __init__(self, dp: int, model_parallel: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dp = dp
        self.model_parallel = model_parallel

    @override
    def update(self, *, flops: float | None = None, **kwargs: Any) -> None:
        super().update(flops=None if flops is None else int(flops / self.model_parallel), **kwargs)

    @override
    def compute(self) -> dict[str, int | float]:
        metrics = super().compute()
        sep = self.separator
        for rate in ("batches_per_sec", "samples_per_sec", "items_per_sec"):
            one_rank = metrics.get(f"device{sep}{rate}")
            if one_rank is None:
                continue
            metrics[rate] = one_rank * self.dp
            metrics[f"device{sep}{rate}"] = one_rank * self.dp / self.world_size
        return metrics


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` (same arguments, same logged names), right under par3d layouts; see the
    module docstring.

    Args:
        batch_size_fn: samples in a batch (one rank's batch).
        length_fn: items (tokens) in a batch, for ``items_per_sec``.
        peak_flops_per_device: the peak FLOP/s of one device, where Lightning's table has none (a CPU).
        **kwargs: passed to Lightning's ``Throughput`` (``window_size``, ``separator``).
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int] | None = None,
        peak_flops_per_device: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size_fn, length_fn, **kwargs)
        self.peak_flops_per_device = peak_flops_per_device

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops_per_device is not None:
            self.available_flops = int(self.peak_flops_per_device)
        engine = par3d_engine(trainer)
        dp = engine.dp_size if engine is not None else trainer.world_size
        model_parallel = engine.layout.tp * engine.layout.pp if engine is not None else 1
        for key in list(self._throughputs):
            self._throughputs[key] = _DataParallelThroughput(
                dp,
                model_parallel,
                available_flops=self.available_flops,
                world_size=trainer.world_size,
                **self.kwargs,
            )
