"""The Trainer's dataloaders checked against the pipeline's microbatches before the first step.

Under pp the strategy's ``setup`` reads, for the run about to start (fit, validate, test or predict), each
dataloader Lightning will read and how many of its batches the run reaches (``limit_*_batches``, and for training
``max_steps``), and asks the engine (:meth:`Par3DEngine.check_epoch
<lightning_par3d.engine.Par3DEngine.check_epoch>`): a batch that cannot be split into microbatches fails there, and
an epoch's partial last batch that runs as fewer microbatches is said once, on rank 0.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.rebatching import with_batch_size


def check_epochs(engine: Par3DEngine, trainer: pl.Trainer) -> None:
    """Checks the batches of the trainer's current run against the pipeline (nothing without pp)."""
    if engine.pipeline is None:
        return
    for source, what, limits in data_sources(trainer):
        if not source.is_defined() or 0 in limits:
            continue
        loaders = source.dataloader()
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            if what == "the training dataloader":
                loader = rebatched(engine, loader)
            note = engine.check_epoch(loader, what, limits)
            if note is not None:
                rank_zero_info(f"par3d: {note}")


def rebatched(engine: Par3DEngine, loader: Any) -> Any:
    """The training ``loader`` at the per-rank batch size ``layout="auto"`` chose to keep the global batch
    (:attr:`Par3DEngine.batch_split <lightning_par3d.engine.Par3DEngine.batch_split>`): re-made with that
    ``batch_size`` as Lightning re-makes dataloaders (its own saved arguments), or as it is where the size is already
    right or nothing was chosen."""

    split = engine.batch_split
    return loader if split is None else with_batch_size(loader, split.rank_batch, _as_lightning_remakes)


def _as_lightning_remakes(loader: Any, batch_size: int) -> Any:
    """``loader`` re-made with ``batch_size`` from the arguments Lightning saved when it was built (a subclass too)."""
    from lightning_par3d.integrations.framework_private import dataloader_init_arguments, reinstantiate_dataloader

    saved_args, kwargs = dataloader_init_arguments(loader, loader.sampler)
    kwargs["batch_size"] = batch_size
    if "batch_sampler" in kwargs:
        kwargs["batch_sampler"] = None
    args = [batch_size if i == 1 and isinstance(a, int) else a for i, a in enumerate(saved_args)]
    return reinstantiate_dataloader(loader, *args, **kwargs)


def data_sources(trainer: pl.Trainer) -> list[tuple[Any, str, tuple[int | float, ...]]]:
    """The (data source, its name, the limits on the batches the run reads of it) of each dataloader the trainer's
    current run reads: Lightning's ``limit_*_batches``, and for training ``max_steps`` in batches."""
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        train_limits: tuple[int | float, ...] = (trainer.limit_train_batches or 0,)
        if trainer.max_steps > 0:
            train_limits += (trainer.max_steps * trainer.accumulate_grad_batches,)
        validation = trainer.fit_loop.epoch_loop.val_loop._data_source
        return [
            (trainer.fit_loop._data_source, "the training dataloader", train_limits),
            (validation, "the validation dataloader", (trainer.limit_val_batches or 0,)),
        ]
    loops: dict[TrainerFn, tuple[Any, str, Any]] = {
        TrainerFn.VALIDATING: (trainer.validate_loop, "the validation dataloader", trainer.limit_val_batches),
        TrainerFn.TESTING: (trainer.test_loop, "the test dataloader", trainer.limit_test_batches),
        TrainerFn.PREDICTING: (trainer.predict_loop, "the predict dataloader", trainer.limit_predict_batches),
    }
    if fn not in loops:
        return []
    loop, what, limit = loops[fn]
    return [(loop._data_source, what, (limit or 0,))]
