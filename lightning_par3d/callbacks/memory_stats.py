"""``MemoryStats``: every rank's memory at every training step, split into parameters, gradients, optimizer state
and activations.

::

    trainer = L.Trainer(strategy="par3d", callbacks=[MemoryStats()])

Each step, on every rank:

* parameters, gradients and optimizer state are counted from the tensors the rank holds
  (:func:`~lightning_par3d.memory.meters.model_state_bytes`: storages, each once, padding included) just before the
  optimizer step, when all three are held (and again at the end of a step that created the optimizer state or took
  no optimizer step);
* activations are the bytes autograd keeps saved for backward, measured by hooks
  (:class:`~lightning_par3d.memory.meters.SavedTensorMeter`): their peak in the step, and what is still held at its end;
* on CUDA, the allocator's own figures too (``torch.cuda.memory_allocated`` and ``max_memory_allocated``).

Every ``log_every_n_steps`` steps (the Trainer's by default) all ranks' figures go to Lightning's loggers, in MiB,
under ``memory/rank{r}/{kind}_mib`` (at the end of the step) and ``memory/rank{r}/{kind}_peak_mib`` (peak in the
step), with ``kind`` one of ``params``, ``grads``, ``optimizer``, ``activations``; then
``memory/rank{r}/total_peak_mib`` (the sum of the peaks) and, on CUDA, ``memory/rank{r}/cuda_allocated_mib`` and
``memory/rank{r}/cuda_peak_mib``. At the end of fit, rank 0 prints a per-rank table beside
:func:`~lightning_par3d.estimate_memory`'s prediction for the layout (computed then, in a fresh interpreter, since
the estimator needs a process without a process group: the LightningModule's class must be importable, not defined
in the script being run) and writes ``memory_stats.png`` (memory over steps, one panel
per rank, stacked by kind) and ``memory_stats.csv`` to ``dirpath`` (default: the logger's directory, else
``trainer.default_root_dir``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par3d.callbacks.bottleneck.analysis import OBSERVER
from lightning_par3d.callbacks.memory_report import format_summary, plot_memory, write_csv
from lightning_par3d.callbacks.run_context import output_directory, pp_rank, unconfigured_copy
from lightning_par3d.memory.meters import SavedTensorMeter, model_state_bytes

KINDS = ("params", "grads", "optimizer", "activations")
MIB = 2**20


@dataclass
class MemoryRecord:
    """One rank's memory at one step, in bytes."""

    step: int
    rank: int
    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    params_peak: int
    grads_peak: int
    optimizer_peak: int
    activations_peak: int
    cuda_allocated: int = 0
    cuda_peak: int = 0

    @property
    def total_peak(self) -> int:
        return sum(getattr(self, f"{kind}_peak") for kind in KINDS)

    def metrics(self) -> dict[str, float]:
        prefix = f"memory/rank{self.rank}/"
        out = {f"{prefix}{kind}_mib": getattr(self, kind) / MIB for kind in KINDS}
        out |= {f"{prefix}{kind}_peak_mib": getattr(self, f"{kind}_peak") / MIB for kind in KINDS}
        out[f"{prefix}total_peak_mib"] = self.total_peak / MIB
        if self.cuda_peak:
            out[f"{prefix}cuda_allocated_mib"] = self.cuda_allocated / MIB
            out[f"{prefix}cuda_peak_mib"] = self.cuda_peak / MIB
        return out


_FIELDS = tuple(MemoryRecord.__dataclass_fields__)


class MemoryStats(L.Callback):
    """Measures every rank's memory at every step; logs it, and at the end tabulates and plots it.

    Args:
        log_every_n_steps: how often all ranks' figures go to the loggers; default: the Trainer's.
        dirpath: where to write ``memory_stats.png`` and ``.csv``; default: the logger's directory, else
            ``trainer.default_root_dir``.
        estimate: compare with :func:`~lightning_par3d.estimate_memory` (run in a fresh interpreter by rank 0; the
            LightningModule's class must be importable by name).
        verbose: print the per-rank table at the end of fit (rank 0).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        dirpath: str | Path | None = None,
        estimate: bool = True,
        verbose: bool = True,
    ) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.estimate = estimate
        self.verbose = verbose
        self.records: list[MemoryRecord] = []
        self.all_records: list[MemoryRecord] = []
        self.estimated: Any = None
        self.plot_path: Path | None = None
        self._meter: SavedTensorMeter | None = None
        self._before_step: Any = None
        self._unconfigured: Any = None
        self._batch: Any = None

    # ---------------------------------------------------------------- measuring
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.estimate and trainer.is_global_zero:
            self._unconfigured = None
            try:  # the LightningModule before configure_model: what the estimator builds on fake tensors
                self._unconfigured = unconfigured_copy(pl_module)
            except Exception as err:
                rank_zero_info(f"MemoryStats: no estimate to compare with ({type(err).__name__}: {err}).")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._unconfigured is not None and self._batch is None:
            items = batch if isinstance(batch, (tuple, list)) else [batch]
            self._batch = tuple(
                torch.empty(t.shape, dtype=t.dtype, device="meta") for t in items if isinstance(t, torch.Tensor)
            )
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._before_step = None
        self._meter = SavedTensorMeter().__enter__()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        with torch.profiler.record_function(OBSERVER):  # BottleneckReport counts this as measuring, not training
            self._before_step = model_state_bytes(pl_module, trainer.optimizers)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._meter is None:
            return
        with torch.profiler.record_function(OBSERVER):
            self._record(trainer, pl_module)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        before = self._before_step
        # The optimizer step changes no storage but the first one (which creates the optimizer state): count again
        # only then, or when this batch took no step (gradient accumulation).
        first_step = before is not None and before.optimizer == 0
        now = model_state_bytes(pl_module, trainer.optimizers) if before is None or first_step else before
        before = before or now
        record = MemoryRecord(
            step=trainer.global_step,
            rank=trainer.global_rank,
            pp_rank=pp_rank(trainer),
            params=now.params,
            grads=now.grads,
            optimizer=now.optimizer,
            activations=self._meter.live,
            params_peak=max(now.params, before.params),
            grads_peak=max(now.grads, before.grads),
            optimizer_peak=max(now.optimizer, before.optimizer),
            activations_peak=self._meter.peak,
            cuda_allocated=torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
            cuda_peak=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        )
        self.records.append(record)
        self._meter = None
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50)
        if len(self.records) % max(every, 1) == 0:
            self._log(trainer, record)

    def _log(self, trainer: L.Trainer, record: MemoryRecord) -> None:
        """All ranks' figures of this step, gathered (one small collective) and logged by rank 0's loggers."""
        values = torch.tensor([float(getattr(record, f)) for f in _FIELDS], dtype=torch.float64)
        rows = _all_gather(values, trainer.strategy.root_device)
        metrics: dict[str, float] = {}
        for row in rows:
            metrics |= MemoryRecord(**{f: int(v) for f, v in zip(_FIELDS, row.tolist(), strict=True)}).metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ---------------------------------------------------------------- report
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        directory = output_directory(trainer, self.dirpath)
        everyone = _gather_records(self.records)
        if everyone is None:
            return
        self.all_records = everyone
        if self._unconfigured is not None and self._batch is not None:  # after training: it takes no step's time
            self.estimated = _estimate(self._unconfigured, trainer, self._batch)
        write_csv(everyone, directory / "memory_stats.csv")
        self.plot_path = plot_memory(everyone, self.estimated, directory / "memory_stats.png")
        if self.verbose:
            rank_zero_info(format_summary(everyone, self.estimated) + f"\n  plot: {self.plot_path}")


def _all_gather(values: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    if not dist.is_initialized():
        return [values]
    values = values.to(device)
    rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, values)
    return [r.cpu() for r in rows]


def _gather_records(records: list[MemoryRecord]) -> list[MemoryRecord] | None:
    if not dist.is_initialized():
        return records
    everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object([asdict(r) for r in records], everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return [MemoryRecord(**row) for rows in everyone for row in rows]


# ---------------------------------------------------------------- the estimate, in a fresh interpreter


def _optimizer_kind(trainer: L.Trainer) -> str | None:
    from lightning_par3d.zero.optimizer import zero_optimizers

    if not trainer.optimizers:
        return None
    optimizer = trainer.optimizers[0]
    zero = zero_optimizers([optimizer])
    optimizer = zero[0].wrapped if zero else optimizer
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd_momentum" if optimizer.defaults.get("momentum") else "sgd"
    return None


def _estimate(module: L.LightningModule, trainer: L.Trainer, shapes: tuple[torch.Tensor, ...]) -> Any:
    """:func:`~lightning_par3d.estimate_memory` for the run's layout and batch, or None (with the reason printed).

    The estimator simulates every rank in a fake process group of its own, which cannot exist beside this rank's
    real one; it runs in a fresh interpreter
    (:func:`~lightning_par3d.memory.estimate_process.estimate_in_fresh_interpreter`), which gets the module
    pickled."""
    from lightning_par3d.memory.estimate_process import estimate_in_fresh_interpreter

    config = getattr(trainer.strategy, "config", None)
    kind = _optimizer_kind(trainer)
    if config is None or kind is None:
        return None
    precision = str(trainer.precision)
    try:
        return estimate_in_fresh_interpreter(
            module, config, trainer.world_size, shapes, precision=precision, optimizer=kind
        )
    except Exception as err:
        rank_zero_info(f"MemoryStats: the estimate failed, so the table has no estimate column: {err}")
        return None
