"""torchmetrics states through the build: metrics keep the values a single process's metrics hold.

A torchmetrics ``Metric`` keeps its states (and their defaults) as plain tensor attributes, which ``module.to("meta")``
and ``to_empty()`` replace too, with nothing to fill them from: DCP fills parameters and buffers only, so the
states would hold uninitialized memory (accuracy 1.0 for 0.0, counts of −2.7e24). :func:`detach_metrics` therefore
takes every subtree of the model that holds metrics and no parameters or buffers (a metric, a
``MetricCollection``, a ``ModuleDict`` of metrics) out of the model before it is moved to meta, and
:func:`reattach_metrics` puts it back, in its place and order, once the model is materialized, moved to the
device. A metric that was itself built on the meta device (in ``configure_model`` on a rank other than 0) takes
rank 0's defaults and states; under ``bf16-true`` floating states are kept in fp32, so that counts and sums stay
exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class _Detached:
    parent: nn.Module
    name: str
    order: list[str]
    subtree: nn.Module


def _metric_class() -> type | None:
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional outside Lightning
        return None
    return Metric


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def detach_metrics(module: nn.Module) -> list[_Detached]:
    """Takes every metric-holding subtree without parameters or buffers out of ``module``; returns where each was."""
    metric = _metric_class()
    if metric is None:
        return []
    found: list[_Detached] = []

    def visit(parent: nn.Module) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if any(isinstance(m, metric) for m in child.modules()) and not _holds_state(child):
                found.append(_Detached(parent, name, list(parent._modules), child))
                del parent._modules[name]
            else:
                visit(child)

    visit(module)
    return found


def metrics_in(detached: list[_Detached]) -> list[Any]:
    """Every metric in the detached subtrees, in model order."""
    metric = _metric_class()
    return [m for d in detached for m in d.subtree.modules() if metric is not None and isinstance(m, metric)]


def snapshot(metrics: list[Any]) -> list[dict[str, Any] | None]:
    """Each metric's defaults and states on the CPU, or None where they are on the meta device (no values)."""
    shots: list[dict[str, Any] | None] = []
    for metric in metrics:
        tensors = [t for k in metric._defaults for t in _tensors(metric._defaults[k]) + _tensors(getattr(metric, k))]
        if any(t.is_meta for t in tensors):
            shots.append(None)
            continue
        shots.append(
            {
                "defaults": {k: _to_cpu(v) for k, v in metric._defaults.items()},
                "states": {k: _to_cpu(getattr(metric, k)) for k in metric._defaults},
            }
        )
    return shots


def reattach_metrics(
    detached: list[_Detached], device: torch.device, rank0_shots: list[dict[str, Any] | None], precision: str
) -> None:
    """Puts the subtrees back where they were, with real states (their own, or rank 0's where theirs were built on
    meta), on ``device``."""
    metrics = metrics_in(detached)
    own = snapshot(metrics)
    for index, (metric, shot) in enumerate(zip(metrics, own, strict=True)):
        source = shot if shot is not None else rank0_shots[index]
        if source is None:
            raise RuntimeError(
                f"The torchmetrics {type(metric).__name__} was built on the meta device on every rank, so its "
                "default state is unknown. Create metrics in the LightningModule's __init__ (not configure_model), "
                "or use init='rank0'."
            )
        if shot is None:
            _restore(metric, source)
    for held in detached:
        held.parent._modules[held.name] = held.subtree
        ordered = {k: held.parent._modules[k] for k in held.order if k in held.parent._modules}
        ordered.update(held.parent._modules)
        held.parent._modules.clear()
        held.parent._modules.update(ordered)
        held.subtree.to(device)
    if precision == "bf16-true":
        for metric in metrics:
            if metric.dtype in (torch.bfloat16, torch.float16):
                metric.set_dtype(torch.float32)


def _restore(metric: Any, source: dict[str, Any]) -> None:
    metric._defaults = copy.deepcopy(source["defaults"])
    for key, value in source["states"].items():
        setattr(metric, key, copy.deepcopy(value))
    metric._computed = None
    metric._forward_cache = None
    metric._device = torch.device("cpu")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return copy.deepcopy(value)
