"""The Trainer's part of elastic runs (``Par3DStrategy(elastic=True)``; see :mod:`lightning_par3d.engine.elastic`).

* The training dataloader (``process_dataloader``) reads through an
  :class:`~lightning_par3d.engine.elastic.ElasticSampler` in place of Lightning's ``DistributedSampler``: the same
  order, with its position a global sample offset.
* Every checkpoint records an :class:`~lightning_par3d.engine.elastic.ElasticState` (the global batch, the world, the
  layout, the accumulation and the epoch's sample position) beside Lightning's loop state.
* A resume from such a checkpoint (``trainer.fit(..., ckpt_path="last")`` finds the newest: par3d's saves are
  atomic) sets ``accumulate_grad_batches`` to keep the global batch at this launch's data-parallel size, starts the
  sampler at the recorded sample, restates Lightning's batch counters of the epoch in this launch's batches (so its
  accumulation boundaries and epoch end fall where they should), and says on rank 0 what changed.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.elastic import ElasticSampler, ElasticState, accumulation_for
from lightning_par3d.integrations.framework_private import update_dataloader

STATE_KEY = "par3d_elastic"
"""The checkpoint entry of an elastic run's :class:`~lightning_par3d.engine.elastic.ElasticState`."""


class ElasticRun:
    """The elastic part of one :class:`~lightning_par3d.integrations.trainer.Par3DStrategy`: what this launch's
    training dataloader reads, and the state a checkpoint carries to the next launch. Does nothing unless the
    config says ``elastic=True``."""

    def __init__(self, engine: Par3DEngine) -> None:
        self.engine = engine
        self._elastic_resume: ElasticState | None = None
        self._elastic_batch: tuple[int, int] | None = None
        """(per-rank batch, global batch) of this launch's training dataloader."""

    def check_launch(self) -> None:
        """Warns (rank 0) where torchrun's agents share one store across rendezvous rounds (torch's default): in
        torch 2.13 an agent that joins a running job then waits for the round's ``MASTER_ADDR``, which the running
        agent never writes again, and the join times out."""
        if self.engine.config.elastic and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank_zero_warn(
                "par3d elastic: torchrun's agents share one store across rendezvous rounds here, and a node that "
                "joins this job later will wait for the round's MASTER_ADDR until its join times out (torch 2.13). "
                "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, on every node."
            )

    def process_dataloader(self, dataloader: object, trainer: Any) -> object:
        """The training dataloader of an elastic run, reading through an ``ElasticSampler`` (see the module
        docstring); any other dataloader as it is."""
        if not self.engine.config.elastic or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, DistributedSampler):
            raise ValueError(
                "par3d elastic=True keeps the sample order through Lightning's distributed sampler, but the training "
                f"dataloader reads through {type(getattr(dataloader, 'sampler', None)).__name__}. Keep "
                "Trainer(use_distributed_sampler=True) and let the dataloader shuffle (or not) by itself."
            )
        rank_batch = dataloader.batch_size
        if rank_batch is None:
            raise ValueError(
                "par3d elastic=True counts the global batch in samples, but the training dataloader has no batch_size "
                "(it batches through a batch_sampler). Give the DataLoader batch_size= and let Lightning's sampler "
                "split the data."
            )
        layout = self.engine.layout
        resume, self._elastic_resume = self._elastic_resume, None
        start_epoch, start_sample = 0, 0
        if resume is None:
            global_batch = rank_batch * layout.dp * trainer.accumulate_grad_batches
        else:
            global_batch = resume.global_batch
            accumulate = accumulation_for(global_batch, rank_batch, layout)
            self._restate_batch_counters(trainer, resume.samples_in_epoch, rank_batch * layout.dp)
            start_epoch, start_sample = resume.epoch, resume.samples_in_epoch
            trainer.accumulate_grad_batches = accumulate
            rank_zero_info(
                f"par3d elastic: resumed at step {trainer.global_step} (sample {start_sample} of epoch {start_epoch}) "
                f"from a run of {resume.world_size} ranks ({resume.layout}); now {layout.world_size} ranks "
                f"({layout}); accumulate_grad_batches {resume.accumulate_grad_batches} -> {accumulate} keeps the "
                f"global batch of {global_batch} samples."
            )
        self.engine.accumulate_grad_batches = trainer.accumulate_grad_batches
        self._elastic_batch = (rank_batch, global_batch)
        old = dataloader.sampler
        sampler = ElasticSampler(
            old.dataset,  # type: ignore[arg-type]  # DistributedSampler needs a sized dataset too
            old.num_replicas, old.rank, old.shuffle, old.seed, old.drop_last, start_epoch, start_sample
        )  # fmt: skip
        return update_dataloader(dataloader, sampler)

    @staticmethod
    def _restate_batch_counters(trainer: Any, samples_in_epoch: int, samples_per_batch: int) -> None:
        """Lightning restored the epoch's batch counters in the batches of the run that saved; restates them in this
        launch's (``samples_per_batch`` over every data-parallel rank)."""
        if samples_in_epoch % samples_per_batch:
            raise ValueError(
                f"par3d elastic: the checkpoint was written {samples_in_epoch} samples into its epoch, which is not a "
                f"whole number of this launch's batches of {samples_per_batch} samples over every data-parallel rank."
            )
        progress = trainer.fit_loop.epoch_loop.batch_progress
        delta = samples_in_epoch // samples_per_batch - progress.current.ready
        for counts in (progress.current, progress.total):
            counts.ready += delta
            counts.started += delta
            counts.processed += delta
            counts.completed += delta

    def elastic_state(self, trainer: Any) -> ElasticState:
        """What a checkpoint written now records for an elastic resume."""
        assert self._elastic_batch is not None, "elastic: no training dataloader was processed"
        rank_batch, global_batch = self._elastic_batch
        layout = self.engine.layout
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return ElasticState(
            global_batch=global_batch,
            world_size=layout.world_size,
            layout=str(layout),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            epoch=trainer.current_epoch,
            samples_in_epoch=ready * rank_batch * layout.dp,
        )

    def add_state(self, checkpoint: dict[str, Any], trainer: Any) -> None:
        """Records the elastic state in a checkpoint being saved (elastic runs only)."""
        if self.engine.config.elastic and trainer is not None and self._elastic_batch is not None:
            checkpoint[STATE_KEY] = self.elastic_state(trainer).to_dict()

    def take_state(self, checkpoint: dict[str, Any]) -> None:
        """Keeps a loaded checkpoint's elastic state for the training dataloader (elastic runs only)."""
        if self.engine.config.elastic and STATE_KEY in checkpoint:
            self._elastic_resume = ElasticState.from_dict(checkpoint[STATE_KEY])
