"""The private APIs of Lightning and Accelerate that par3d's front-ends use, each in one place, with the version it
was read from, why, and what would replace it, as :mod:`lightning_par3d.utils.torch_private` does for torch's.

A Lightning or Accelerate upgrade that moves one of them breaks here, at import, and
``tests/test_layers.py::test_the_private_framework_apis_par3d_uses_are_where_they_were_read`` names it; no other
module of par3d imports a private name of either (the same test checks).

Read from Lightning 2.6.6 and Accelerate 1.15.0 (:data:`READ_FROM`).

Lightning (``lightning.fabric`` and ``lightning.pytorch``):

* ``_SubprocessScriptLauncher`` (both): the launcher of ``devices=N`` scripts; par3d's Trainer launcher subclasses
  it (to put back what a killed save left aside before the ranks start) and the Fabric strategy names it as its
  ``launcher_class``, as Lightning's own strategies do. No public launcher class exists.
* ``_BackwardSyncControl``: the base of ``fabric.no_backward_sync``'s per-strategy control, which every strategy
  with its own gradient sync implements (Lightning's DDP and FSDP strategies do the same).
* ``_sync_ddp_if_available`` and ``_all_gather_ddp_if_available``: Lightning's reduction and gather over a group,
  used where a user passes a group of their own (par3d's default is the data-parallel group).
* ``_update_dataloader``, ``_get_dataloader_init_args_and_kwargs`` and ``_reinstantiate_wrapped_cls``: Lightning's
  way to re-make a dataloader from the arguments it saved when it was built (a subclass too), for an elastic
  run's sampler and ``layout="auto"``'s batch size.
* ``_DeviceDtypeModuleMixin``: what Lightning reads a module's ``.device`` from; par3d moves the model to meta and
  back, which Lightning's bookkeeping does not see.
* ``_PATH``: Lightning's type of a checkpoint path, in the signatures par3d overrides.
* ``_init_dist_connection``, ``_get_default_process_group_backend_for_device`` and ``_distributed_is_initialized``:
  how Lightning's strategies create the default process group through the cluster environment (torchrun's, SLURM's,
  Lightning's own launcher's variables), which par3d's strategies create the same way.
* ``_format_summary_table``: the table of ``ModelSummary``, which par3d fills with the whole model's counts at any
  layout (:mod:`~lightning_par3d.integrations.lightning_summary`).
* ``LightningModule._compiler_ctx`` and ``Strategy._lightning_module``: how ``trainer.fit(torch.compile(module))``
  reaches the strategy (:mod:`~lightning_par3d.integrations.lightning_compile`).

Accelerate:

* ``Accelerator._models`` and ``_optimizers``: the prepared models and optimizers, which ``save_state`` and
  ``load_state`` save and load themselves; par3d saves those as one sharded checkpoint of its own, so it hands
  Accelerate empty lists for the call (:func:`without_models`) and registers what it prepared
  (:func:`prepared_models`, :func:`prepared_optimizers`).
* ``Accelerator._do_sync``: the point where Accelerate decides a gradient-accumulation step syncs; par3d's
  accelerator overrides it to tell the engine (no public hook exists).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as FabricScriptLauncher,
    )
    from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
    from lightning.fabric.utilities.data import _update_dataloader as update_dataloader
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin as DeviceDtypeModuleMixin
    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_over
    from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device as default_backend_for,
    )
    from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_over
    from lightning.fabric.utilities.types import _PATH as PATH
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as TrainerScriptLauncher,
    )
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs as dataloader_init_arguments
    from lightning.pytorch.utilities.data import _reinstantiate_wrapped_cls as reinstantiate_dataloader
    from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table as format_summary_table

_LIGHTNING = {
    "FabricScriptLauncher": ("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    "BackwardSyncControl": ("lightning.fabric.strategies.strategy", "_BackwardSyncControl"),
    "update_dataloader": ("lightning.fabric.utilities.data", "_update_dataloader"),
    "DeviceDtypeModuleMixin": ("lightning.fabric.utilities.device_dtype_mixin", "_DeviceDtypeModuleMixin"),
    "all_gather_over": ("lightning.fabric.utilities.distributed", "_all_gather_ddp_if_available"),
    "sync_over": ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available"),
    "PATH": ("lightning.fabric.utilities.types", "_PATH"),
    "TrainerScriptLauncher": ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    "dataloader_init_arguments": ("lightning.pytorch.utilities.data", "_get_dataloader_init_args_and_kwargs"),
    "reinstantiate_dataloader": ("lightning.pytorch.utilities.data", "_reinstantiate_wrapped_cls"),
    "distributed_is_initialized": ("lightning.fabric.utilities.distributed", "_distributed_is_initialized"),
    "default_backend_for": ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    "init_dist_connection": ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    "format_summary_table": ("lightning.pytorch.utilities.model_summary.model_summary", "_format_summary_table"),
}
"""Each Lightning name: (module, private name). Imported on first use, so that the Accelerate front-end, which uses
only :func:`without_models` and friends, imports no Lightning."""


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING:
        module, private = _LIGHTNING[name]
        return getattr(importlib.import_module(module), private)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


READ_FROM = {"lightning": "2.6.6", "accelerate": "1.15.0"}
"""The versions whose source these uses were read from."""
ACCELERATOR_ATTRIBUTES = ("_models", "_optimizers")
"""``Accelerator``'s private attributes par3d reads and writes (see the module docstring)."""
ACCELERATOR_METHODS = ("_do_sync",)
"""``Accelerator``'s private methods par3d overrides."""

__all__ = [
    "ACCELERATOR_ATTRIBUTES",
    "ACCELERATOR_METHODS",
    "PATH",
    "READ_FROM",
    "BackwardSyncControl",
    "DeviceDtypeModuleMixin",
    "FabricScriptLauncher",
    "TrainerScriptLauncher",
    "all_gather_over",
    "dataloader_init_arguments",
    "default_backend_for",
    "distributed_is_initialized",
    "format_summary_table",
    "init_dist_connection",
    "prepared_models",
    "prepared_optimizers",
    "reinstantiate_dataloader",
    "sync_over",
    "update_dataloader",
    "without_models",
]


def prepared_models(accelerator: Any) -> list[Any]:
    """The models ``accelerator`` prepared (Accelerate's own list: append to it to register one)."""
    return accelerator._models


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The optimizers ``accelerator`` prepared (Accelerate's own list: append to it to register one)."""
    return accelerator._optimizers


@contextlib.contextmanager
def without_models(accelerator: Any) -> Iterator[tuple[list[Any], list[Any]]]:
    """Accelerate's ``save_state`` or ``load_state`` within, with no model or optimizer of its own to save or load
    (par3d saves those as one sharded checkpoint); yields the prepared models and optimizers, put back after."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield models, optimizers
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers
