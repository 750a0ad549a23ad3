"""Elastic runs (``Par3DConfig(elastic=True)``): the same training, whatever the world size of this launch.

When a node is lost or joins, torchrun's elastic agent (``--nnodes=MIN:MAX --max-restarts=K``) or a scheduler
restarts every rank at the new world size, and the script runs again from its start. Three things then decide
whether the run continues the trajectory it was on:

1. **The layout** (:func:`relayout`): the sizes the user set stay where they still divide the world (``pp``,
   ``tp`` and ``cp``: a model's split, tensor parallelism inside a node, the rows' split); data parallelism takes
   the rest. A world that ``pp × tp × cp`` does not divide ends with a message that says so, before any process
   group exists.
2. **The global batch** (:func:`accumulation_for`): samples per optimizer step = per-rank batch × data-parallel size
   × ``accumulate_grad_batches``. The checkpoint records it (:class:`ElasticState`); at a new data-parallel size the
   accumulation is what keeps it, or the resume is refused when no whole number does.
3. **The sample order** (:class:`ElasticSampler`): the epoch's permutation is the one ``DistributedSampler`` draws
   (the seed plus the epoch), and the position in it is a global sample offset, which does not depend on the world
   size. Optimizer step ``j`` of an epoch trains the samples at positions ``[j·G, (j+1)·G)`` of the permutation
   whatever the layout (rank ``r`` of ``D`` reads positions ``r, r + D, …`` batch by batch), so a run resumed at
   another layout trains each remaining sample of the epoch once, and none again.

The Trainer's glue is :mod:`lightning_par3d.integrations.lightning_elastic`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout


def relayout(config: Par3DConfig, world_size: int) -> tuple[Par3DConfig, str | None]:
    """The configuration to train ``world_size`` ranks with: ``config`` itself where its sizes fit, else the same
    ``pp``, ``tp`` and ``cp`` with data parallelism over the rest (``dp_replicate`` kept where it still divides it,
    as HSDP; ``ep`` kept where it still divides ``dp_shard × cp``, else its largest divisor that does: the experts
    resume at another ep as at any layout), and a line saying what changed. Raises ``ValueError`` when
    ``pp × tp × cp`` does not divide the world."""
    if config.layout == "auto":
        return config, None
    try:
        resolve_layout(config, world_size)
        return config, None
    except ValueError:
        pass
    fixed = config.pp * config.tp * config.cp
    kept = f"pp={config.pp} × tp={config.tp}" + (f" × cp={config.cp}" if config.cp > 1 else "")
    if world_size % fixed:
        raise ValueError(
            f"elastic: a world of {world_size} ranks cannot keep {kept} = {fixed}, which must divide the world size. "
            f"Launch a multiple of {fixed} ranks (torchrun --nnodes MIN:MAX with MIN nodes holding at least {fixed} "
            f"ranks), or lower tp, pp{' or cp' if config.cp > 1 else ''}."
        )
    rest = world_size // fixed
    replicas = config.dp_replicate if rest % config.dp_replicate == 0 else 1
    shard = rest // replicas
    zero = config.zero_stage if shard > 1 else None  # nothing left to shard over: replicas (zero_stage 0)
    # ep: the largest of its divisors that divides the new dp_shard × cp (each divides the experts, as ep did)
    ep = max(d for d in range(1, config.ep + 1) if config.ep % d == 0 and (shard * config.cp) % d == 0)
    changed = dataclasses.replace(config, dp_replicate=replicas, dp_shard=shard, dp=None, zero_stage=zero, ep=ep)
    layout = resolve_layout(changed, world_size)
    assert layout is not None
    experts = f"; ep={config.ep} → ep={ep}, which divides dp_shard={shard}" if ep != config.ep else ""
    return changed, f"elastic: {world_size} ranks, so {layout} ({kept} kept{experts})"


ELASTIC_FRONT_ENDS = ("Par3DStrategy",)
"""The front-ends that carry an elastic run's state through checkpoints and dataloaders (the Trainer's, so far)."""


def check_front_end(owner: str, config: Par3DConfig) -> None:
    """Refuses ``elastic=True`` on a front-end that cannot keep its promises yet, before anything starts."""
    if config.elastic and owner not in ELASTIC_FRONT_ENDS:
        raise ValueError(
            f"{owner}(elastic=True): elastic runs keep the global batch and the sample order through the Trainer's "
            f"checkpoints and dataloaders, and only the Trainer's strategy (Par3DStrategy) does that so far. Train "
            f"with Trainer(strategy=Par3DStrategy(elastic=True)), or set elastic=False and, after a restart at another "
            f"world size, resume from the last checkpoint at a layout and accumulation you choose."
        )


@dataclass(frozen=True)
class ElasticState:
    """What a checkpoint of an elastic run records, to resume at any world size."""

    global_batch: int
    """Samples per optimizer step over every data-parallel rank: per-rank batch × dp × accumulation."""
    world_size: int
    layout: str
    accumulate_grad_batches: int
    epoch: int
    samples_in_epoch: int
    """Samples of ``epoch``'s permutation trained when the checkpoint was written (a multiple of ``global_batch``
    when written at a step's end)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ElasticState:
        return cls(**values)


def accumulation_for(global_batch: int, rank_batch: int, layout: Layout) -> int:
    """``accumulate_grad_batches`` that keeps ``global_batch`` at ``rank_batch`` samples per data-parallel rank of
    ``layout``; ``ValueError`` naming the numbers where no whole number does."""
    per_pass = rank_batch * layout.dp
    if global_batch % per_pass:
        fix = (
            f"Use a per-rank batch size that divides {global_batch // layout.dp}, or a world whose data-parallel "
            f"size divides {global_batch // rank_batch}."
            if global_batch % layout.dp == 0
            else f"No per-rank batch size can at dp={layout.dp}: launch a world whose data-parallel size divides "
            f"{global_batch}."
        )
        raise ValueError(
            f"elastic: the run's global batch is {global_batch} samples, and at {layout} one batch of every "
            f"data-parallel rank is {rank_batch} × dp={layout.dp} = {per_pass} samples, which does not divide it: "
            f"no accumulate_grad_batches keeps the global batch. {fix}"
        )
    return global_batch // per_pass


class ElasticSampler(Sampler[int]):
    """``DistributedSampler``'s order (same permutation, same padding, rank ``r`` of ``num_replicas`` reads positions
    ``r, r + num_replicas, …``), started at a global sample offset in one epoch (``start_epoch``,
    ``start_sample``); every other epoch starts at 0. Its length is the whole epoch's, as Lightning's loop counts
    a resumed epoch's batches from the restored position."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start_epoch: int = 0,
        start_sample: int = 0,
    ) -> None:
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start_epoch, self.start_sample = start_epoch, start_sample
        if start_sample % num_replicas:
            raise ValueError(
                f"ElasticSampler: start_sample={start_sample} is not a multiple of num_replicas={num_replicas}."
            )
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """The epoch's global order, padded or cut to ``total_size`` as ``DistributedSampler`` does."""
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        start = self.start_sample if self.epoch == self.start_epoch else 0
        return iter(self.order()[start + self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
