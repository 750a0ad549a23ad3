"""Running one batch through this rank's pipeline stages with a ``torch.distributed.pipelining`` schedule.

:func:`build_runner` wraps this rank's stage modules in torch ``PipelineStage`` objects and builds the configured
torch schedule over them. :meth:`PipelineRunner.run` then runs a batch (forward and backward in training, forward
only in evaluation), with the loss given for that call, and returns the batch's mean loss on every pipeline rank
(broadcast from the rank that holds the last stage). The runner holds no reference to the model that owns the
stages, so a model that is dropped is freed with its runner.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.config.schedules import SINGLE_STAGE_SCHEDULES, TORCH_SCHEDULES, microbatches_for

if TYPE_CHECKING:
    from lightning_par3d.config import Layout
    from lightning_par3d.distributed.mesh import Par3DMesh

LossFn = Callable[[Any, Any], torch.Tensor]
Share = Callable[[torch.Tensor, Any], torch.Tensor]
"""``share(mean, targets)``: a microbatch's mean loss as its share of the global batch's token mean."""


@dataclass
class PendingPipelineOutput:
    """What the pipelined trunk returns in a training step: the call's arguments, kept until the loss says what to
    compute (the schedule runs forward and backward together, inside the declared ``pipeline_loss``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._unreadable(name))

    def _unreadable(self, name: str) -> str:
        """Why ``.name`` cannot be read from this output, and what to do instead."""
        return (
            f"par3d: under pp, in a training step, the pipelined trunk's output exists only inside the schedule, "
            f"which runs with the loss: `.{name}` cannot be read from it. Pass the trunk's output straight to the "
            "declared `pipeline_loss` (metrics that need the logits can be updated inside that loss, where they are "
            "real, on the last stage), or compute it in a forward-only step (validation, test, predict, "
            "torch.no_grad()), where the trunk returns the real output on every rank."
        )


@dataclass
class OwnLossOutput(PendingPipelineOutput):
    """What a pipelined transformers causal LM called with ``labels=`` returns (its own loss run at once): ``loss``
    and, for a mixture of experts adding its router's loss, ``aux_loss``, on every rank. Its logits stayed inside the
    schedule, on the last stage."""

    loss: Any = None
    aux_loss: Any = None

    def _unreadable(self, name: str) -> str:
        return (
            f"par3d: under pp a call of the model with labels= returns its own .loss (and a router's .aux_loss); "
            f"`.{name}` stayed inside the pipeline schedule, on the last stage. For the logits, call the model "
            "without labels= in a forward-only step (validation, test, predict, torch.no_grad()), where it returns "
            "them on every rank."
        )


@dataclass
class PipelineRunner:
    """This rank's part of the pipeline: its stage modules, torch's schedule over them, and where the last stage is.

    Built by :func:`build_runner`; owned by the engine that parallelized the model. A batch that ``microbatches``
    does not divide (an epoch's partial last batch) runs as fewer equal microbatches, through a schedule of its own
    (:meth:`schedule_for`), so that its mean loss is one process's.
    """

    schedule: Any
    n_microbatches: int
    pp_group: Any
    last_stage_rank: int
    """Global rank of the pipeline peer holding the last stage (where the loss and the outputs are)."""
    holds_last_stage: bool
    stage_modules: list[nn.Module] = field(default_factory=list)
    layout: Layout | None = None
    make_schedule: Callable[[int], Any] | None = None
    """Builds this rank's stages and schedule for another number of microbatches (set by :func:`build_runner`)."""
    announced: set[int] = field(default_factory=set)
    """Batch sizes whose microbatch count was told to the user already (at setup, or at their first run)."""
    _schedules: dict[int, Any] = field(default_factory=dict)
    _apart: dict[int, Any] = field(default_factory=dict)
    """Forward-only schedules kept apart from training's (:meth:`predict`'s ``apart``), by microbatch count."""
    _loss_fn: LossFn | None = None
    _share: Share | None = None
    _grad_scale: float = 1.0

    def microbatches_for(self, batch: int | None) -> int:
        """How many equal microbatches a batch of ``batch`` samples per data-parallel rank runs as
        (:func:`~lightning_par3d.config.schedules.microbatches_for`); raises ``ValueError`` naming the fix if
        none can. ``None`` (a batch without a leading dimension) runs as configured."""
        if batch is None or batch % self.n_microbatches == 0 or self.layout is None:
            return self.n_microbatches
        layout = self.layout
        count = microbatches_for(batch, layout.schedule, self.n_microbatches, layout.pp, layout.virtual_stages)
        if count is None:
            raise ValueError(partial_batch_message(batch, layout))
        if batch not in self.announced:
            self.announced.add(batch)
            if _rank() == 0:
                warnings.warn(
                    f"par3d: a batch of {batch} samples per data-parallel rank runs as {count} microbatches of "
                    f"{batch // count}: microbatches={self.n_microbatches} does not divide it (an epoch's partial "
                    "last batch, typically; drop it with DataLoader(..., drop_last=True)).",
                    stacklevel=2,
                )
        return count

    def schedule_for(self, count: int) -> Any:
        """The schedule that runs ``count`` microbatches: the configured one, or one built on first use (new torch
        ``PipelineStage`` objects over the same stage modules: their buffers have the microbatch's shape)."""
        if count == self.n_microbatches:
            return self.schedule
        if count not in self._schedules:
            assert self.make_schedule is not None, "a runner without make_schedule runs its own microbatches only"
            self._schedules[count] = self.make_schedule(count)
        return self._schedules[count]

    def _scaled_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of one microbatch, scaled so that the summed gradients are those of the batch mean (and of
        the accumulation window's mean: a framework's own division by the accumulation count never reaches a
        backward that already ran inside the schedule); with ``share``, its share of the global batch's token
        mean first."""
        assert self._loss_fn is not None, "the schedule ran outside PipelineRunner.run"
        loss = self._loss_fn(outputs, targets)
        if self._share is not None:
            loss = self._share(loss, targets)
        return loss * self._grad_scale

    def run(
        self,
        pending: PendingPipelineOutput,
        targets: Any,
        loss_fn: LossFn,
        train: bool,
        device: torch.device,
        accumulate: int = 1,
        zero_grad_first: bool = False,
        zero: Sequence[Any] = (),
        share: Share | None = None,
    ) -> torch.Tensor:
        """Runs the schedule over one batch and returns its loss on every pipeline rank.

        ``train`` runs forward and backward (gradients accumulate into the stages' parameters, scaled by
        ``1 / (microbatches × accumulate)``), else forward only; the loss returned is the mean of the microbatches'.
        With ``share`` (training under ``loss_mean="tokens"``: ``share(mean, targets)`` is a microbatch's share of
        the global batch's token mean, :mod:`lightning_par3d.engine.tokens`), each microbatch's loss is its share,
        the gradients are scaled by ``1 / accumulate`` only, and the loss returned is the shares' sum.
        ``zero_grad_first`` clears the stages' gradients first (the first batch of an accumulation window). ``zero``
        are the ZeRO-1 optimizers over the stages: their gradient reduction is held during the schedule's many
        backward passes and done once after them.
        """
        self._check_call(pending)
        count = self.microbatches_for(_batch_size(targets))
        self._share = share if train else None
        self._grad_scale = 1.0 / (count * (accumulate if train else 1))
        if self._share is not None:
            self._grad_scale = 1.0 / accumulate
        if train and zero_grad_first:
            for stage in self.stage_modules:
                stage.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule = self.schedule_for(count)
        step = schedule.step if train else schedule.eval
        syncing = [z for z in zero if z.require_backward_grad_sync] if train else []
        self._loss_fn = loss_fn
        try:
            with ExitStack() as no_sync:
                for optimizer in zero:
                    no_sync.enter_context(optimizer.no_sync())
                step(*pending.args, target=targets, losses=losses, **pending.kwargs)
        finally:
            self._loss_fn = None
        for optimizer in syncing:
            optimizer.reduce_gradients()
        if self.holds_last_stage:
            pieces = 1 if self._share is not None else count  # shares add up; means average
            loss = torch.stack([x.detach().float() for x in losses]).sum() / self._grad_scale / pieces
        else:
            loss = torch.zeros((), device=device, dtype=torch.float32)  # fp32 on every rank, as on the last
        return self.broadcast_from_last_stage(loss)

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the rank holding the last stage has it, on every pipeline rank (same shape and dtype)."""
        dist.broadcast(tensor, src=self.last_stage_rank, group=self.pp_group)
        return tensor

    def broadcast_object_from_last_stage(self, obj: Any) -> Any:
        """A picklable object from the rank holding the last stage, on every pipeline rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group)
        return box[0]

    def predict(self, pending: PendingPipelineOutput, device: torch.device, apart: bool = False) -> Any:
        """Forward only, without a loss: the merged outputs on the ranks holding the last stage, None elsewhere.
        ``apart``: through a schedule of its own (new torch ``PipelineStage`` objects over the same modules), so that
        the training schedule's first run still infers its stages' metadata with their backward (a zero-bubble
        schedule whose first run was forward only has stages without one)."""
        first = pending.args[0] if pending.args else next(iter(pending.kwargs.values()))
        dummy_targets = torch.zeros(first.shape[0], device=device)
        self._check_call(pending)
        count = self.microbatches_for(first.shape[0])
        if apart and self.make_schedule is not None:
            if count not in self._apart:
                self._apart[count] = self.make_schedule(count)
            schedule = self._apart[count]
        else:
            schedule = self.schedule_for(count)
        self._loss_fn, self._grad_scale, self._share = _zero_loss, 1.0, None  # no training step's token share
        try:
            outputs = schedule.eval(*pending.args, target=dummy_targets, losses=[], **pending.kwargs)
        finally:
            self._loss_fn = None
        return outputs if self.holds_last_stage else None

    def share_outputs(self, outputs: Any, device: torch.device) -> Any:
        """The last stage's ``outputs`` (tensors, nested in tuples, lists or dicts, or other picklable values) on every
        pipeline rank: their structure and shapes broadcast as an object, then each tensor (a DTensor gathered
        whole first, by the last stage's tensor-parallel ranks together)."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_flatten, tree_unflatten

        leaves: list[Any] = []
        described = None
        if self.holds_last_stage:
            flat, spec = tree_flatten(outputs)
            leaves = [leaf.full_tensor() if isinstance(leaf, DTensor) else leaf for leaf in flat]
            kinds = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves]
            described = (spec, kinds)
        spec, kinds = self.broadcast_object_from_last_stage(described)
        shared = []
        for i, (shape, what) in enumerate(kinds):
            if shape == "value":
                shared.append(what)
                continue
            tensor = (
                leaves[i].detach().contiguous()
                if self.holds_last_stage
                else torch.empty(shape, dtype=what, device=device)
            )
            shared.append(self.broadcast_from_last_stage(tensor))
        return tree_unflatten(shared, spec)

    def _check_call(self, pending: PendingPipelineOutput) -> None:
        if self.stage_modules:
            check_pipeline_call(self.stage_modules[0], pending)


def check_pipeline_call(stage: nn.Module, pending: PendingPipelineOutput) -> None:
    """Refuses a trunk call that the pipeline stages cannot take, before the schedule runs.

    torch's schedule hands the call's positional arguments to the first stage only and its keyword arguments to
    every stage's forward: a keyword argument that the stage forward has no parameter for, or a positional
    argument past those it takes, would fail inside the schedule (one rank raising while its peers wait in a
    send or receive) or, worse, be dropped. Every pipeline rank reads the same batch and its stages share the
    trunk's forward, so every rank raises here alike, before any of them communicates.
    """
    signature = inspect.signature(stage.forward)
    try:
        signature.bind(*pending.args, **pending.kwargs)
        return
    except TypeError:
        pass
    model = _model_class_name(stage)
    takes = ", ".join(n for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    unknown = [repr(name) for name, value in pending.kwargs.items() if not _binds(signature, name, value)]
    what = f"the keyword argument {', '.join(unknown)}" if unknown else f"{len(pending.args)} positional arguments"
    raise TypeError(
        f"The pipelined {model} cannot take {what}: under pp > 1 each stage's forward takes ({takes}) and gets "
        "the call's keyword arguments, while positional arguments past the first reach the first stage only. "
        "Drop the argument (for padded batches: pack the sequences into full rows instead, or use a model whose "
        "forward takes attention_mask, as par3d's stages of a transformers decoder do), pass it by keyword if the "
        "forward takes it so, or train without pipeline parallelism."
    )


def _binds(signature: inspect.Signature, name: str, value: Any) -> bool:
    try:
        signature.bind_partial(**{name: value})
    except TypeError:
        return False
    return True


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _batch_size(targets: Any) -> int | None:
    return targets.shape[0] if isinstance(targets, torch.Tensor) and targets.dim() else None


def partial_batch_message(batch: int, layout: Layout) -> str:
    """Why a batch of ``batch`` samples per data-parallel rank cannot run under ``layout``'s pipeline, and the fix."""
    return (
        f"A batch of {batch} samples (per data-parallel rank) cannot be split into microbatches that the "
        f"{layout.schedule!r} schedule can run over pp={layout.pp}: microbatches={layout.microbatches} does not divide "
        f"it, and no smaller count that divides it suits the schedule. If it is an epoch's partial last batch, drop "
        "it (DataLoader(..., drop_last=True)) or give the dataset a length whose share per data-parallel rank the "
        "batch size divides; otherwise choose a batch size that is a multiple of microbatches."
    )


def _model_class_name(module: nn.Module) -> str:
    """The model's own class (not the wrappers torch's FSDP or par3d mix into it)."""
    own = (c for c in type(module).__mro__ if not c.__module__.startswith(("torch.", "lightning_par3d.")))
    return next(own, type(module)).__name__


def _zero_loss(outputs: Any, targets: Any) -> torch.Tensor:
    first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return first.sum() * 0.0


STATIC_STAGE_IO: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
"""Stage index → example (inputs, outputs) of one microbatch (meta tensors), handed to torch's ``PipelineStage`` as
its static metadata. Filled only by the dry run (:mod:`lightning_par3d.tools.dry_run`), whose fake process group
cannot carry the shapes that stages otherwise exchange at the first step; empty in a run, whose stages infer their
metadata from the first microbatch."""


def build_runner(stage_modules: list[nn.Module], mesh: Par3DMesh, device: torch.device) -> PipelineRunner:
    """The torch ``PipelineStage`` objects for this rank's stage modules, and the layout's torch schedule over
    them."""
    from torch.distributed.pipelining import PipelineStage

    layout = mesh.layout
    rank = dist.get_rank()
    pp_group = mesh["pp"].get_group()
    indices = layout.stage_indices(mesh.coords(rank).pp)
    runner = PipelineRunner(
        schedule=None,
        n_microbatches=layout.microbatches,
        pp_group=pp_group,
        last_stage_rank=mesh.group_ranks("pp", rank)[layout.last_stage_owner],
        holds_last_stage=(layout.n_stages - 1) in indices,
        stage_modules=stage_modules,
        layout=layout,
    )

    def make_schedule(count: int) -> Any:
        stages = [
            PipelineStage(module, index, layout.n_stages, device, group=pp_group, **_static_io(index))
            for module, index in zip(stage_modules, indices, strict=True)
        ]
        return torch_schedule(replace(layout, microbatches=count), stages, runner._scaled_loss, scale_grads=False)

    runner.schedule = make_schedule(layout.microbatches)
    runner.make_schedule = make_schedule
    return runner


def _static_io(index: int) -> dict[str, Any]:
    if index not in STATIC_STAGE_IO:
        return {}
    inputs, outputs = STATIC_STAGE_IO[index]
    return {"input_args": inputs, "output_args": outputs}


def torch_schedule(layout: Layout, stages: list[Any], loss_fn: LossFn, **options: Any) -> Any:
    """The torch schedule the layout names, over this rank's ``PipelineStage`` objects."""
    import torch.distributed.pipelining.schedules as schedules

    cls = getattr(schedules, TORCH_SCHEDULES[layout.schedule])
    target = stages[0] if layout.schedule in SINGLE_STAGE_SCHEDULES else stages
    return cls(target, n_microbatches=layout.microbatches, loss_fn=loss_fn, **options)
