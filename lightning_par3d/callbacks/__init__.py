"""Callbacks that show where memory and time go: ``MemoryStats``, ``BottleneckReport`` and a ``ThroughputMonitor``
that counts each sample once under tensor and pipeline parallelism; and ``SavePretrained``, which writes a trained
Hugging Face transformers model as a ``save_pretrained`` directory from any layout.

Activation checkpointing is not a callback: it is a strategy setting (``activation_checkpointing``), because it must
wrap the blocks after tensor parallelism and before FSDP2, in ``parallelize``'s fixed order.
"""

from lightning_par3d.callbacks.bottleneck import BottleneckReport
from lightning_par3d.callbacks.memory_stats import MemoryStats
from lightning_par3d.callbacks.save_pretrained import SavePretrained
from lightning_par3d.callbacks.throughput import ThroughputMonitor

__all__ = ["BottleneckReport", "MemoryStats", "SavePretrained", "ThroughputMonitor"]
