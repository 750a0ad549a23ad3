"""What par3d did to a model, kept for as long as the model lives, so that a model parallelized once is reused.

Lightning's ``fit`` then ``test``, a second ``fit``, or a new engine in the same process hand the same module to
:meth:`Par3DEngine.parallelize <lightning_par3d.engine.Par3DEngine.parallelize>` again: :func:`reuse_problem` says
whether it can be reused as it is (its layout and settings are the engine's, and nobody replaced its submodules), or
what differs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

from lightning_par3d.compose import ParallelizeReport
from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.pipeline.runner import PipelineRunner
from lightning_par3d.pipeline.trunk import PipelineHost, PipelineSpec
from lightning_par3d.utils.model_changes import record_of, remember

MODEL_FIELDS = (
    "tp_plan",
    "fsdp_blocks",
    "split_points",
    "activation_checkpointing",
    "ac_every",
    "ac_blocks",
    "compile",
    "compile_options",
    "offload",
    "grad_compression",
    "init",
    "pretrained_path",
)
"""The config fields, beyond the layout, that shape a parallelized model: a module parallelized with other values
cannot be reused."""


@dataclass
class ModelRecord:
    """What par3d did to one module (weakly keyed by the module). It holds nothing that refers back to the module,
    so that a module that is dropped is freed."""

    layout: Layout
    settings: tuple[tuple[str, Any], ...]
    pipeline: PipelineRunner | None
    spec: PipelineSpec | None
    structure: tuple[int, ...]
    report: ParallelizeReport
    host: weakref.ref[PipelineHost] | None = None
    """For a plain model pipelined in a host: the host (weakly; a new one is made if it is gone)."""


def model_settings(config: Par3DConfig, precision: str) -> tuple[tuple[str, Any], ...]:
    """The settings that shape a parallelized model (:data:`MODEL_FIELDS` and the precision), comparable."""
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name in MODEL_FIELDS}
    values["precision"] = precision
    return tuple((k, repr(v)) for k, v in sorted(values.items()))


def structure(module: nn.Module) -> tuple[int, ...]:
    """The identities of the module's submodules (a host's: its model's), to tell a rebuilt model from the one
    that was parallelized."""
    if isinstance(module, PipelineHost):
        module = module.trunk
    return tuple(id(m) for m in module.modules())


def reuse_problem(
    module: nn.Module, record: ModelRecord, layout: Layout, settings: tuple[tuple[str, Any], ...]
) -> Exception | None:
    """Why ``module`` (parallelized before, as ``record`` says) cannot be reused at ``layout`` with ``settings``, as
    the error to raise; None if it can."""
    differences = []
    if record.layout != layout:
        differences.append(
            f"layout then: {record.layout} (ZeRO-{record.layout.zero}), now: {layout} (ZeRO-{layout.zero})"
        )
    for (name, then), (_, now) in zip(record.settings, settings, strict=True):
        if then != now:
            differences.append(f"{name} then: {then}, now: {now}")
    if differences:
        return ValueError(
            f"{type(module).__name__} was already parallelized by par3d with other settings ("
            + "; ".join(differences)
            + "). A model is parallelized once. Build a fresh model for the new layout, or save a checkpoint "
            "and load it into a fresh model at the new layout."
        )
    if structure(module) != record.structure:
        return RuntimeError(
            f"{type(module).__name__} was parallelized by par3d, but its submodules have been replaced since "
            "(a `configure_model` that builds a new model each time it is called?). Build the model only once, "
            "e.g. `if self.model is None: self.model = ...`, as Lightning asks of configure_model."
        )
    return None


def declares_pipeline(module: nn.Module) -> bool:
    """Whether ``module`` names its pipeline trunk (a LightningModule's ``pipeline_trunk``)."""
    return isinstance(getattr(module, "pipeline_trunk", None), str)


def parallelize_hosted(model: nn.Module, parallelize: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A plain model pipelined as the trunk of a :class:`~lightning_par3d.pipeline.trunk.PipelineHost`, which
    ``parallelize`` parallelizes; the host is remembered weakly in the model's record, so that parallelizing the same
    model again finds it (or puts a new host around the already pipelined model)."""
    record = record_of(model)
    if record is None:
        host = PipelineHost(model)
        trained = parallelize(host)
        remember(model, replace(record_of(host), host=weakref.ref(host)))
        return trained
    alive = record.host() if record.host is not None else None
    host = alive if alive is not None else PipelineHost(model)
    if alive is None:
        remember(host, record)
        remember(model, replace(record, host=weakref.ref(host)))
    return parallelize(host)
