"""A training dataloader re-made at the per-rank batch size ``layout="auto"`` chose, the same way behind every
front-end.

``layout="auto"`` keeps the global batch by choosing each data-parallel rank's ``batch_size`` (and the accumulation):
the loader the user built is re-made with that size, everything else as it was. A loader that batches through a
``batch_sampler`` has no ``batch_size`` to change, and is refused with the fix, at every front-end: re-made silently
at its own size, it would train another global batch than the one the plan kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

KEPT = (
    "sampler", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)  # fmt: skip
"""Every argument of torch's ``DataLoader`` but the dataset, the batch size and the ones a sampler replaces."""


def with_batch_size(loader: Any, batch_size: int, remake: Callable[[Any, int], Any] | None = None) -> Any:
    """``loader`` at ``batch_size`` per data-parallel rank: as it is where the size is already that, else re-made by
    ``remake(loader, batch_size)`` (a front-end's own way, Lightning's for its wrapped loaders and subclasses), else
    as a torch ``DataLoader`` with every other argument kept (:data:`KEPT`). Raises ``ValueError`` for a loader that
    batches through a ``batch_sampler``, and (without ``remake``) for a ``DataLoader`` subclass, whose own
    arguments are unknown here."""
    if not isinstance(loader, DataLoader) or loader.batch_size == batch_size:
        return loader
    if loader.batch_size is None:
        raise ValueError(
            "layout='auto' keeps the global batch by choosing each rank's batch_size, but the training dataloader "
            "batches through a batch_sampler. Give the DataLoader batch_size= (and let the sampler split the data), "
            "or pin the layout."
        )
    if remake is not None:
        return remake(loader, batch_size)
    if type(loader) is not DataLoader:
        raise ValueError(
            f"layout='auto' keeps the global batch by choosing each rank's batch_size, and re-makes the training "
            f"dataloader with it, but it is a {type(loader).__name__}, a DataLoader subclass whose own arguments "
            "par3d cannot know. Give a torch DataLoader, or pin the layout."
        )
    return DataLoader(loader.dataset, batch_size=batch_size, **{name: getattr(loader, name) for name in KEPT})
