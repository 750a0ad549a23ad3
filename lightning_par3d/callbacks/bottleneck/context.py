"""What the report knows of the run besides its measured steps: the layout and settings, the batch's tokens, the
dataloader's workers, and the model's FLOPs (``measure_flops`` on a meta copy) with the device's peak."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_par3d.callbacks.bottleneck.findings import ReportContext


def batch_facts(batch: Any) -> dict[str, Any]:
    """The tokens, shape and dtype of a training batch's first tensor (what the FLOPs and the advice read)."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(first, torch.Tensor):
        return {"tokens": None}
    tokens = first.numel() if not first.is_floating_point() else first.shape[0]
    return {"tokens": tokens, "input_shape": tuple(first.shape), "input_dtype": first.dtype}


def report_context(trainer: L.Trainer, sampled: int, facts: dict[str, Any], unconfigured: Any) -> ReportContext:
    """The run's :class:`~lightning_par3d.callbacks.bottleneck.findings.ReportContext`. Under another strategy than
    par3d's, every rank reads as a replica (the suggestions then say less)."""
    from lightning_par3d.config import Layout

    strategy = trainer.strategy
    layout = getattr(strategy, "layout", None) or Layout(1, trainer.world_size, 1, 1)
    config = getattr(strategy, "config", None)
    tokens = facts.get("tokens")
    flops, peak = model_flops(trainer, layout, facts, unconfigured)
    return ReportContext(
        layout=layout,
        schedule=getattr(config, "pipeline_schedule", "1f1b"),
        microbatches=getattr(config, "microbatches", 1),
        virtual_stages=getattr(config, "virtual_stages", 1),
        num_workers=getattr(trainer.train_dataloader, "num_workers", None),
        devices_per_node=max(trainer.num_devices, 1),
        sampled_steps=sampled,
        tokens_per_step=tokens * layout.dp if tokens else None,
        flops_per_step=flops,
        peak_flops=peak,
    )


def model_flops(trainer: L.Trainer, layout: Any, facts: dict[str, Any], unconfigured: Any) -> tuple[Any, Any]:
    """Model FLOPs of one global batch (forward and backward, measured by ``measure_flops`` on the meta copy
    ``unconfigured``, which it configures), and the device's peak FLOPs from Lightning's table (None where it has
    none, as for CPUs)."""
    from lightning.fabric.utilities.throughput import get_available_flops, measure_flops

    shape = facts.get("input_shape")
    if unconfigured is None or shape is None:
        return None, None
    try:
        with torch.device("meta"):
            unconfigured.configure_model()
            x = torch.zeros((shape[0] * layout.dp, *shape[1:]), dtype=facts["input_dtype"])
            flops = measure_flops(unconfigured, lambda: unconfigured(x), lambda y: y.sum())
    except Exception:  # a model whose forward does not take the batch's first tensor: no FLOPs figure
        return None, None
    dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
    return flops, get_available_flops(trainer.strategy.root_device, dtype)
