"""The batches an epoch gives each pipeline, checked before the first step.

Under pp every batch is split into equal microbatches. A batch that ``microbatches`` divides runs as configured; an
epoch's partial last batch that it does not divide (2,879 samples in batches of 16: the last holds 15) runs as the
nearest count of equal microbatches that divides it and suits the schedule, below ``microbatches`` first (15
samples: 3 microbatches of 5), else above (13 samples: 13 of 1), whose mean loss is one process's on that batch;
where no count can (fewer samples than the schedule has stages), the run fails before training with the fix: drop
that batch (``DataLoader(..., drop_last=True)``) or change the dataset's length. A full batch that ``microbatches``
does not divide is refused before training too.

:func:`epoch_shape` reads a ``DataLoader`` as the front-ends will shard it (a ``DistributedSampler`` over the
data-parallel ranks, padded so that every rank reads the same number of samples); :func:`check_epoch` decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_par3d.config.schedules import microbatches_for

if TYPE_CHECKING:
    from lightning_par3d.config import Layout


@dataclass(frozen=True)
class EpochShape:
    """What one data-parallel rank reads in an epoch."""

    batch_size: int
    samples: int
    """Samples per data-parallel rank and epoch."""

    @property
    def last_batch(self) -> int:
        """The partial last batch's samples (0 when the batch size divides the epoch)."""
        return self.samples % self.batch_size


def limited(shape: EpochShape, *limits: int | float) -> EpochShape:
    """The part of an epoch that batch limits let run (each a count of batches, or a fraction of the epoch's, as
    Lightning's ``limit_*_batches``; a run's ``max_steps`` in batches): a limit that stops before the partial last
    batch leaves full batches only."""
    batches = math.ceil(shape.samples / shape.batch_size)
    kept = min((int(x) if isinstance(x, int) else int(batches * float(x)) for x in limits), default=batches)
    if kept >= batches:
        return shape
    return EpochShape(shape.batch_size, kept * shape.batch_size)


def epoch_shape(loader: Any, dp: int) -> EpochShape | None:
    """The batch size and samples per rank of ``loader`` once split over ``dp`` data-parallel ranks by a
    ``DistributedSampler`` (which pads the dataset to a multiple of ``dp``); None when it cannot be told (no
    ``batch_size``, a dataset without a length, a custom batch sampler) or when the loader drops its partial last
    batch itself."""
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(loader, DataLoader) or not isinstance(loader.batch_size, int) or loader.drop_last:
        return None
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return None
    try:
        size = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if isinstance(loader.sampler, DistributedSampler):  # already sharded by the user
        return EpochShape(loader.batch_size, len(loader.sampler))
    return EpochShape(loader.batch_size, math.ceil(size / dp))


def check_epoch(shape: EpochShape, layout: Layout, what: str) -> str | None:
    """Under pp: raises ``ValueError`` when a batch of ``shape`` cannot run (see the module docstring); returns a
    line for the log when the partial last batch runs as fewer microbatches, else None. ``what`` names the loader
    ("the training dataloader")."""
    if layout.pp == 1:
        return None
    m = layout.microbatches
    if shape.batch_size % m:
        raise ValueError(
            f"The batch of {shape.batch_size} samples per data-parallel rank of {what} is not divisible by "
            f"microbatches={m}. Choose a batch size that is a multiple of microbatches, or change microbatches."
        )
    last = shape.last_batch
    if last == 0 or last % m == 0:
        return None
    count = microbatches_for(last, layout.schedule, m, layout.pp, layout.virtual_stages)
    if count is None:
        raise ValueError(
            f"The last batch of each epoch of {what} holds {last} samples per data-parallel rank ({shape.samples} "
            f"samples in batches of {shape.batch_size}), which no count of equal microbatches that the "
            f"{layout.schedule!r} schedule runs over pp={layout.pp} can split. Drop it (DataLoader(..., "
            "drop_last=True)), or give the dataset a length whose share per data-parallel rank the batch size "
            "divides."
        )
    return (
        f"the last batch of each epoch of {what} holds {last} samples per data-parallel rank, which microbatches={m} "
        f"does not divide: it runs as {count} microbatches of {last // count} (one process's mean loss on that "
        "batch). Pass drop_last=True to the DataLoader to skip it instead."
    )


def check_loader(runner: Any, loader: Any, dp: int, what: str, limits: Sequence[int | float] = ()) -> str | None:
    """:func:`check_epoch` for ``loader`` as the front-end will shard it over ``dp`` ranks, of which the run reads at
    most ``limits`` batches (each a count or a fraction of the epoch): raises ``ValueError`` if a batch cannot be split
    into ``runner``'s microbatches; returns a line for the log if the epoch's partial last batch runs as fewer (which
    the runner then does not say again), else None, also where the loader's epoch cannot be told."""
    shape = epoch_shape(loader, dp)
    if shape is None or runner.layout is None:
        return None
    shape = limited(shape, *limits)
    note = check_epoch(shape, runner.layout, what)
    if note is not None:
        runner.announced.add(shape.last_batch)
    return note
