"""``trainer.fit(torch.compile(module))`` under par3d: Lightning's documented way to compile, taken as Lightning's
own DDP and FSDP strategies take it, but compiled per block.

Lightning unwraps the ``OptimizedModule`` that ``torch.compile`` returns (``from_compiled``: the LightningModule,
its ``forward`` and step methods wrapped by dynamo) and then refuses it for every strategy but its single-device,
DDP and FSDP ones. par3d takes such a module back to its uncompiled methods (Lightning's ``to_uncompiled``) and sets
``compile=True`` with the options the user compiled with, so that each repeated block is compiled in place after
tensor parallelism and activation checkpointing and before FSDP2, as ``compile=True`` does: a whole-module compile
would run outside the hooks FSDP2 adds later, and would put ``_orig_mod.`` in every parameter's name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.utilities.compile import to_uncompiled

from lightning_par3d.config import Par3DConfig
from lightning_par3d.utils.torch_private import compile_options_of

if TYPE_CHECKING:
    from lightning_par3d.engine import Par3DEngine


class _Compiled:
    """What ``compile_options_of`` reads: the dynamo context Lightning kept of the compiled module."""

    def __init__(self, dynamo_ctx: object) -> None:
        self.dynamo_ctx = dynamo_ctx


def take_compiled(module: pl.LightningModule, config: Par3DConfig) -> Par3DConfig:
    """Takes ``module`` (unwrapped by Lightning from ``torch.compile``) back to its uncompiled methods, in place, and
    returns ``config`` with ``compile=True`` and the options ``torch.compile`` was called with. Options set on the
    strategy too (``compile_options``) win over the ones read from the compiled module."""
    context = module._compiler_ctx
    assert context is not None
    options = compile_options_of(_Compiled(context["dynamo_ctx"]))
    to_uncompiled(module)
    return dataclasses.replace(config, compile=True, compile_options={**options, **config.compile_options})


class TakesCompiledModules:
    """Mixed into the Trainer's strategy: where Lightning puts the module it trains (``strategy._lightning_module``,
    set by ``trainer.fit`` right after unwrapping a compiled module and before its check that refuses compiled
    modules for other strategies than its own), a compiled module is taken back by :func:`take_compiled`."""

    engine: Par3DEngine

    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_par3d_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        if module is not None and getattr(module, "_compiler_ctx", None) is not None:
            self.engine.config = take_compiled(module, self.engine.config)
        self.__dict__["_par3d_lightning_module"] = module
