"""Callbacks that show where memory and time go: ``MemoryStats`` and ``BottleneckReport``.

Activation checkpointing is not a callback: it is a strategy setting (``activation_checkpointing``), because it must
wrap the blocks after tensor parallelism and before FSDP2, in ``parallelize``'s fixed order.
"""

from lightning_par3d.callbacks.bottleneck import BottleneckReport
from lightning_par3d.callbacks.memory_stats import MemoryStats

__all__ = ["BottleneckReport", "MemoryStats"]
