"""The memory estimator in a fresh interpreter, for a process that already has a process group.

:func:`~lightning_par3d.memory.estimate.estimate_memory` simulates every rank over torch's fake process group, which
must be its process's default group; a rank of a real run already has one (``MemoryStats`` asks for the estimate at
the end of fit). :func:`estimate_in_fresh_interpreter` therefore runs it in a new interpreter
(:mod:`lightning_par3d.utils.fresh_interpreter`): the unconfigured LightningModule, the config and the batch shapes go
in pickled with ``cloudpickle``, the :class:`~lightning_par3d.memory.estimate.MemoryEstimate` comes back. Nothing of the
calling process's torch state is touched or copied.
"""

from __future__ import annotations

from typing import Any


def estimate_in_fresh_interpreter(
    module: Any,
    config: Any,
    world_size: int,
    batch: Any,
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    timeout_s: float = 600.0,
) -> Any:
    """:func:`~lightning_par3d.memory.estimate.estimate_memory` with these arguments, computed in a fresh
    interpreter. Raises ``RuntimeError`` when the module cannot be sent or the child ends without a result (and
    after ``timeout_s``), and the estimator's own error when it fails."""
    from lightning_par3d.memory.estimate import estimate_memory
    from lightning_par3d.utils.fresh_interpreter import call

    return call(
        estimate_memory, module, config, world_size, batch, precision=precision, optimizer=optimizer,
        what="the memory estimate", timeout_s=timeout_s,
    )  # fmt: skip
