"""``Par3DEngine``: one model's distributed life at one par3d layout, in one framework-free object (see the package
docstring for the order of calls). A facade: each job is a module of its own, which this class calls with its
state, or a part it holds, whose names it reads as its own (:class:`~lightning_par3d.utils.parts.PartOf`).

==========================================  ===========================================================================
job                                         module
==========================================  ===========================================================================
validation, process groups, layout, the     :mod:`~lightning_par3d.engine.placement` (the part ``engine.placement``)
coordinates, reductions over the dp ranks,
this rank's failure
reusing a model parallelized before         :mod:`~lightning_par3d.engine.records`
optimizers (pointing, ZeRO-1/2)             :mod:`~lightning_par3d.engine.optimizers`
steps, accumulation, clipping               :mod:`~lightning_par3d.engine.steps`
the token mean of the global batch          :mod:`~lightning_par3d.engine.tokens`
collectives over the data-parallel ranks    :mod:`~lightning_par3d.engine.collectives`
checkpoints                                 :mod:`~lightning_par3d.engine.saving` (the part ``engine.saves``)
failures                                    :mod:`~lightning_par3d.distributed.faults`
elastic re-layout                           :mod:`~lightning_par3d.engine.elastic`
==========================================  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning_par3d.checkpoint import dcp
from lightning_par3d.compose import ParallelizeReport, parallelize
from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.engine import collectives, own_loss, records, router_loss, saving, steps, tokens
from lightning_par3d.engine.context_rows import cut_call
from lightning_par3d.engine.optimizers import setup_optimizers as prepare_optimizers
from lightning_par3d.engine.pipeline_router_loss import PipelinedRouterLoss
from lightning_par3d.engine.placement import Placement
from lightning_par3d.parallel.compression import compression_of
from lightning_par3d.parallel.context_parallel import ContextParallel, cut_declared_loss
from lightning_par3d.parallel.data_parallel import replicate_with_ddp
from lightning_par3d.parallel.materialize import build_context
from lightning_par3d.pipeline.batches import check_loader
from lightning_par3d.pipeline.runner import PendingPipelineOutput, PipelineRunner
from lightning_par3d.pipeline.trunk import PipelineHost, PipelineSpec
from lightning_par3d.planning.at_launch import BatchSplit
from lightning_par3d.utils.model_changes import record_of, remember
from lightning_par3d.utils.parts import PartOf
from lightning_par3d.zero.optimizer import ZeroOptimizer

LossFn = Callable[[Any, Any], torch.Tensor]
Backward = Callable[[torch.Tensor], Any]


class Par3DEngine:
    """One model's distributed life at one par3d layout: validation, process groups and mesh (its
    :class:`~lightning_par3d.engine.placement.Placement`, whose names it reads as its own), the build context,
    ``parallelize``, optimizer setup, the step (pipelined or not), the token mean, gradient sync and clipping,
    reductions over the data-parallel ranks, sharded checkpoints and teardown. Independent of Lightning, Fabric and
    Accelerate."""

    # Where this rank is: the placement's (lightning_par3d.engine.placement), read (and set) through the engine.
    config = PartOf[Par3DConfig]("placement")
    precision = PartOf[str]("placement")
    batch_split = PartOf[BatchSplit | None]("placement")
    layout = PartOf[Layout]("placement")
    mesh = PartOf[Par3DMesh]("placement")
    device = PartOf[torch.device]("placement")
    rank = PartOf[int]("placement")
    dp_size = PartOf[int]("placement")
    dp_rank = PartOf[int]("placement")
    holds_last_stage = PartOf[bool]("placement")
    awaits_layout = PartOf[bool]("placement")
    resolve = PartOf[Callable[..., Layout | None]]("placement")
    setup = PartOf[Callable[..., None]]("placement")
    choose_layout = PartOf[Callable[..., Layout]]("placement")
    barrier = PartOf[Callable[[], None]]("placement")
    sampler_kwargs = PartOf[Callable[[], dict[str, int]]]("placement")
    reduce = PartOf[Callable[..., torch.Tensor]]("placement")
    attach_metrics = PartOf[Callable[..., int]]("placement")
    failed = PartOf[bool]("placement")
    note_step = PartOf[Callable[[int], None]]("placement")
    describe_failure = PartOf[Callable[[BaseException], str]]("placement")
    failed_first = PartOf[Callable[[], bool]]("placement")
    # The checkpoints: the saves' (lightning_par3d.engine.saving.ModelSaves).
    model_state = PartOf[Callable[[], dict[str, Any]]]("saves")
    optimizer_state = PartOf[Callable[[Any], dict[str, Any]]]("saves")
    save_pretrained = PartOf[Callable[[str | Path], Path]]("saves")
    save = PartOf[Callable[..., None]]("saves")
    load = PartOf[Callable[..., dict[str, Any]]]("saves")
    wait_for_saves = PartOf[Callable[[], None]]("saves")
    background = PartOf[dcp.BackgroundSaves | None]("saves")

    def __init__(self, config: Par3DConfig, precision: str = "32-true") -> None:
        self.placement = Placement(config, precision)
        """Where this rank is (:class:`~lightning_par3d.engine.placement.Placement`); ``layout``, … are its."""
        self.accumulate_grad_batches = 1
        """Batches per optimizer step (gradient accumulation); the pipeline scales its losses by it."""
        self.clear_grads_first = False
        """Set per batch by a front-end whose framework clears gradients only after the step function (Lightning):
        the pipeline then clears them before its backward, on the first batch of each accumulation window."""
        self._module: nn.Module | None = None
        self._forward_module: nn.Module | None = None
        self._record: records.ModelRecord | None = None
        self._zero: list[ZeroOptimizer] = []
        self._names_before: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._steps = 0
        self._tokens: tokens.TokenMean | None = None
        self._context: ContextParallel | None = None  # cp > 1: the model's rows cut and attention gathered
        self.router: PipelinedRouterLoss | None = None  # pp: a mixture of experts' router load-balancing loss
        self.saves = saving.ModelSaves(self.placement, self._saved_module)
        """The checkpoints (:class:`~lightning_par3d.engine.saving.ModelSaves`): ``save``, ``load``, … are its."""

    # ---------------------------------------------------------------- the model
    @contextmanager
    def init_context(self) -> Iterator[None]:
        """Where the model is built: for real on rank 0 (on CPU) and on the meta device elsewhere with
        ``init="rank0"``, on meta everywhere with ``init="meta"``; seeded with ``config.seed`` if set."""
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        with build_context(self.config.init, self.rank):
            yield

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Applies the layout to ``module`` in place (:func:`lightning_par3d.compose.parallelize`); returns what to
        train: ``module``, ``DistributedDataParallel`` over it (pure replication), or under pp for a model that
        declares no ``pipeline_trunk``, a :class:`~lightning_par3d.pipeline.trunk.PipelineHost` around it (run it
        with :meth:`train_step`). A module parallelized before is reused, or refused with what differs
        (:mod:`~lightning_par3d.engine.records`)."""
        if self.layout.pp > 1 and not isinstance(module, PipelineHost) and not records.declares_pipeline(module):
            return records.parallelize_hosted(module, self.parallelize)
        record = record_of(module)
        if record is not None:
            return self._reuse(module, record)
        self._names_before = WeakIdKeyDictionary({p: n for n, p in module.named_parameters()})
        result = parallelize(module, self.mesh, self.config, self.device, self.precision)
        record = records.ModelRecord(
            layout=self.layout,
            settings=records.model_settings(self.config, self.precision),
            pipeline=result.pipeline,
            spec=result.spec,
            structure=records.structure(module),
            report=result.report,
        )
        remember(module, record)
        self._adopt(module, result.forward_module, record)
        return result.forward_module

    def _reuse(self, module: nn.Module, record: records.ModelRecord) -> nn.Module:
        settings = records.model_settings(self.config, self.precision)
        problem = records.reuse_problem(module, record, self.layout, settings)
        if problem is not None:
            raise problem
        trained = self._forward_module if self._module is module and self._forward_module is not None else None
        if trained is None and self.layout.data_parallel == "ddp":
            trained = replicate_with_ddp(module, self.mesh, self.device, compression_of(self.config))
        self._adopt(module, trained or module, record)
        return self.forward_module

    def _adopt(self, module: nn.Module, trained: nn.Module, record: records.ModelRecord) -> None:
        self._module, self._forward_module, self._record = module, trained, record
        own_loss.attach_runs(self, module, record.spec)  # pp: the trunk's calls and the declared loss run the schedule
        if self.token_mean is not None:  # under pp the declared (or the model's own) loss runs inside the schedule
            self.token_mean.source = tokens.source_for(module, self.token_mean, record.spec)
        # cp > 1: the declared loss's targets cut to this rank's positions, outside the token mean's share
        self._context = cut_declared_loss(module, self.token_mean) if self.layout.cp > 1 else None
        if self.layout.pp > 1:
            self.router = own_loss.install_router(self, module)
        else:
            router_loss.install_for(module, self.placement, lambda: self.accumulate_grad_batches, self.token_mean)
        self.attach_metrics(module)

    @property
    def module(self) -> nn.Module:
        """The parallelized module (the user's object)."""
        if self._module is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._module

    @property
    def forward_module(self) -> nn.Module:
        """What to call for forward and backward: the module, or ``DistributedDataParallel`` over it."""
        if self._forward_module is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._forward_module

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline runner under pp > 1, else None."""
        return self._record.pipeline if self._record is not None else None

    @property
    def pipeline_spec(self) -> PipelineSpec | None:
        """The trunk and loss names the model declared for pipelining (None without pp, or for a hosted model)."""
        record = self._record
        if record is None or record.spec is None or isinstance(self._module, PipelineHost):
            return None
        return record.spec

    @property
    def report(self) -> ParallelizeReport:
        if self._record is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._record.report

    def describe(self) -> str:
        """One line for the log: the layout, what was applied, and what the step's loss averages over."""
        mean = _describe_mean(self.token_mean)
        return f"par3d: {self.layout} on {self.layout.world_size} ranks; {self.report}; loss: {mean}."

    # ---------------------------------------------------------------- optimizers
    def setup_optimizers(self, optimizers: Sequence[Optimizer], schedulers: Iterable[Any] = ()) -> list[Optimizer]:
        """The optimizers to step, over the parallelized parameters, ZeRO-1/2-wrapped where the layout says
        (:func:`lightning_par3d.engine.optimizers.setup_optimizers`). Earlier ZeRO wrappers are closed."""
        self.close_optimizers()
        ready, self._zero = prepare_optimizers(
            optimizers, schedulers, self.module, self._names_before, self.layout, self.mesh
        )
        return ready

    def holds_stale_parameters(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` holds parameters of the model as it was before :meth:`parallelize`."""
        return any(p in self._names_before for g in optimizer.param_groups for p in g["params"])

    def close_optimizers(self) -> None:
        """Removes the gradient hooks of this engine's ZeRO wrappers."""
        for zero in self._zero:
            zero.close()
        self._zero = []

    # ---------------------------------------------------------------- steps
    def run_pipeline(self, pending: PendingPipelineOutput, targets: Any, loss_fn: LossFn, train: bool | None = None,
                     own: bool = False) -> torch.Tensor:  # fmt: skip
        """Runs the schedule for one batch: forward and backward if ``train`` (default: the module training, gradients
        on), else forward only; the batch's loss on every rank. ``own``: the model's own loss (:meth:`own_loss`)."""
        runner = self._require_pipeline()
        own_loss.check_router_joins(self.router, own)
        if train is None:
            train = self.module.training and torch.is_grad_enabled()
        share, accumulate = None, self.accumulate_grad_batches
        if self._context is not None:  # cp: this rank's positions of the ids and the targets
            pending, targets = cut_call(pending, targets, self._context)
        if train and self.token_mean is not None:
            share, accumulate = tokens.pipeline_share(self.token_mean, targets)
        return runner.run(
            pending, targets, loss_fn, train=train, device=self.device, accumulate=accumulate,
            zero_grad_first=self.clear_grads_first, zero=self._zero, share=share,
        )  # fmt: skip

    def train_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn,
                   backward: Backward | None = None) -> torch.Tensor:  # fmt: skip
        """Forward and backward of one batch at any layout; returns the batch's loss (detached) on every rank.
        Without pp ``backward(loss)`` (default ``loss.backward()``) runs the backward; under pp the schedule. Under
        ``loss_mean="tokens"`` the loss is the batch's share of the global token mean (:meth:`start_batch` first)."""
        self._steps += 1
        self.note_step(self._steps)
        if self.layout.pp > 1:
            with torch.enable_grad():
                return self.run_pipeline(steps.pending(inputs), targets, loss_fn, train=True)
        if self.token_mean is not None:
            loss_fn = self.token_mean.wrap(loss_fn)
        loss_fn = self._context.cut_loss(loss_fn) if self._context is not None else loss_fn
        return steps.plain_train_step(model, inputs, targets, loss_fn, backward)

    def eval_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one batch, forward only, at any layout (on every rank)."""
        with torch.no_grad():
            if self.layout.pp == 1:
                loss_fn = self._context.cut_loss(loss_fn) if self._context is not None else loss_fn
                return loss_fn(steps.call(model, inputs), targets).detach()
            return self.run_pipeline(steps.pending(inputs), targets, loss_fn, train=False)

    def own_loss(self, trunk: nn.Module, pending: PendingPipelineOutput) -> PendingPipelineOutput:
        """Under pp: ``trunk``'s call with ``labels=`` run with the model's own loss (:mod:`.own_loss`)."""
        return own_loss.run_own_loss(self, pending, trunk)

    def forward_only(self, pending: PendingPipelineOutput) -> Any:
        """Under pp: the trunk's outputs for one call, forward only, broadcast to every pipeline rank."""
        runner, pending = self._require_pipeline(), _this_ranks(pending, self._context)
        with torch.no_grad():
            return runner.share_outputs(runner.predict(pending, self.device), self.device)

    def predict_step(self, model: nn.Module, inputs: Any) -> Any:
        """The model's outputs for one batch, forward only; under pp on the last stage's ranks (None elsewhere)."""
        with torch.no_grad():
            if self.layout.pp == 1:
                return steps.call(model, inputs)
            return self._require_pipeline().predict(_this_ranks(steps.pending(inputs), self._context), self.device)

    def _require_pipeline(self) -> PipelineRunner:
        runner = self.pipeline
        if runner is None:
            raise RuntimeError("This model is not pipelined (pp=1): call it directly.")
        return runner

    def no_sync(self, enabled: bool = True) -> Any:
        """A context in which backward passes keep their gradients local (the non-final batches of gradient
        accumulation: :func:`lightning_par3d.engine.steps.no_sync`)."""
        return steps.no_sync(self.forward_module, self._zero) if enabled else nullcontext()

    def clip_grad_norm_(
        self, source: Optimizer | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Scales gradients so that their norm over every tp, dp and pp shard (one process's norm) is at most
        ``max_norm``; returns it before clipping. ``source``: the optimizer (Trainer, Fabric) or parameters."""
        pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        return steps.clip_grad_norm(source, max_norm, norm_type, self._zero, pp_group)

    # ---------------------------------------------------------------- data and logged values
    def check_epoch(self, loader: Any, what: str, limits: Sequence[int | float] = ()) -> str | None:
        """Under pp, before the first step: the batches of ``loader`` checked against the microbatches
        (:func:`lightning_par3d.pipeline.batches.check_loader`); a line for the log, or None."""
        runner = self.pipeline
        return check_loader(runner, loader, self.dp_size, what, limits) if runner is not None else None

    def gather(self, data: Any, as_objects: bool = False) -> Any:
        """The batch values ``data`` of every data-parallel rank, on every rank
        (:func:`lightning_par3d.engine.collectives.gather`)."""
        return collectives.gather(
            data, as_objects, self.layout, self.mesh, self.holds_last_stage, self.pipeline, self.device
        )

    # ---------------------------------------------------------------- the token mean
    @property
    def token_mean(self) -> tokens.TokenMean | None:
        """The token-mean state under ``loss_mean="tokens"`` (None otherwise)."""
        if self._tokens is None and self.config.loss_mean == "tokens":
            self._tokens = tokens.TokenMean.of(self.placement, lambda: self.accumulate_grad_batches)
        return self._tokens if self.config.loss_mean == "tokens" else None

    def start_batch(self) -> None:
        """A training batch begins (front-ends call this once per batch, before its loss): under
        ``loss_mean="tokens"`` its place in the accumulation window (:meth:`tokens.TokenMean.start_batch`)."""
        if self.token_mean is not None:
            self.token_mean.start_batch()

    def backward_factor(self, divided_by: int) -> float:
        """What a front-end multiplies a training loss by before its backward when its framework divides the loss by
        ``divided_by`` (:meth:`tokens.TokenMean.backward_factor`); 1 outside ``loss_mean="tokens"``."""
        return self.token_mean.backward_factor(divided_by) if self.token_mean is not None else 1.0

    # ---------------------------------------------------------------- checkpoints
    def _saved_module(self) -> nn.Module:
        return saving.saved_module(self.module, self.forward_module)

    # ---------------------------------------------------------------- the end
    def teardown(self) -> None:
        """Waits for a save in flight; closes the ZeRO wrappers' gradient hooks; runs no collective. The mesh and the
        parallelized model stay for the next run of this layout in this process."""
        try:
            if self.background is not None and not self.failed:  # after a failure, the ranks may be gone
                self.background.wait()
        finally:
            self.close_optimizers()


def _describe_mean(token_mean: tokens.TokenMean | None) -> str:
    """What a step's loss averages over, for the engine's line in the log."""
    if token_mean is None:
        return "each microbatch's own mean"
    if token_mean.source == tokens.NONE:
        return "the global batch's token mean in train_step, else each batch's own mean"
    return "the global batch's token mean"


def _this_ranks(pending: PendingPipelineOutput, context: ContextParallel | None) -> PendingPipelineOutput:
    """A pipelined call as this rank's stages take it: under cp, its token ids at this rank's positions."""
    return pending if context is None else cut_call(pending, None, context)[0]
