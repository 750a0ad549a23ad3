"""Pipeline parallelism inside Lightning's loop, on ``torch.distributed.pipelining``.

The LightningModule declares, once, its pipelined trunk and its loss::

    class GPTModule(L.LightningModule):
        pipeline_trunk = "model"     # the attribute holding the module to split into stages
        pipeline_loss = "loss_fn"    # a method (trunk outputs, targets) -> scalar loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.model(x), y)   # the same code at every layout

Under ``pp > 1`` the trunk attribute holds this rank's stages (grafted at their original names) and its call
returns a :class:`PendingPipelineOutput` instead of running; the loss method, given that, runs the whole pipeline
schedule for the batch (forward and backward in training, forward only in evaluation) and returns the mean loss,
broadcast from the last stage to every pipeline rank. The strategy then skips Lightning's own backward: it has
already run, once, inside the schedule.
"""

from __future__ import annotations

import types
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_par3d.pipeline_split import LOOP_SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES, stage_indices

if TYPE_CHECKING:
    from lightning_par3d.mesh import Par3DMesh

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
assert set(TORCH_SCHEDULES) == set(SINGLE_STAGE_SCHEDULES + LOOP_SCHEDULES + V_SCHEDULES)


@dataclass
class PendingPipelineOutput:
    """What the pipelined trunk returns: the call's arguments, kept until the loss says what to compute."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def declared_pipeline(module: nn.Module) -> tuple[str, str]:
    """The LightningModule's ``pipeline_trunk`` and ``pipeline_loss`` names, checked."""
    trunk, loss = getattr(module, "pipeline_trunk", None), getattr(module, "pipeline_loss", None)
    if not isinstance(trunk, str) or not isinstance(loss, str):
        raise TypeError(
            f"pp > 1 needs {type(module).__name__} to declare `pipeline_trunk = '<attribute of the module to split>'` "
            "and `pipeline_loss = '<method (outputs, targets) -> loss>'` as class attributes (see "
            "lightning_par3d.pipeline)."
        )
    if not isinstance(getattr(module, trunk, None), nn.Module):
        raise TypeError(f"pipeline_trunk={trunk!r}, but {type(module).__name__}.{trunk} is not an nn.Module.")
    if not callable(getattr(module, loss, None)):
        raise TypeError(f"pipeline_loss={loss!r}, but {type(module).__name__}.{loss} is not a method.")
    return trunk, loss


@dataclass
class PipelineRunner:
    """Runs this rank's part of the schedule for one batch and returns the batch's mean loss on every pp rank."""

    schedule: Any
    n_microbatches: int
    pp_group: Any
    last_stage_rank: int  # global rank of the pipeline rank holding the last stage
    holds_last_stage: bool
    loss_fn: Any
    stage_modules: list[nn.Module] = field(default_factory=list)
    grad_scale: float = 1.0
    accumulate: int = 1
    zero_grad_first: bool = True
    """Set by the strategy per batch: whether this batch opens an accumulation window, so that the gradients are
    cleared before the schedule's backward (Lightning clears them after ``training_step``, which here is too late:
    the backward has already run inside it)."""
    zero: list[Any] = field(default_factory=list)
    """ZeRO-1 optimizers over the stages' parameters (set by the strategy): the schedule's backward passes keep the
    gradients local, and they are all-reduced once, after the last microbatch (unless accumulation holds them)."""

    def scaled_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The user's loss for one microbatch, scaled so that the summed gradients are those of the batch mean
        (and of the accumulation window's mean: Lightning's own division by ``accumulate_grad_batches`` never
        reaches a backward that already ran)."""
        return self.loss_fn(outputs, targets) * self.grad_scale

    def run(self, pending: PendingPipelineOutput, targets: Any, train: bool, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        batch = targets.shape[0] if isinstance(targets, torch.Tensor) else None
        if batch is not None and batch % self.n_microbatches:
            raise ValueError(
                f"The batch of {batch} samples (per data-parallel rank) is not divisible by microbatches="
                f"{self.n_microbatches}. Choose a batch size that is a multiple of microbatches, or change "
                "microbatches."
            )
        self.grad_scale = 1.0 / (self.n_microbatches * (self.accumulate if train else 1))
        if train and self.zero_grad_first:
            for stage in self.stage_modules:
                stage.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        syncing = [z for z in self.zero if z.require_backward_grad_sync] if train else []
        with ExitStack() as no_sync:
            for zero in self.zero:
                no_sync.enter_context(zero.no_sync())
            run(*pending.args, target=targets, losses=losses, **pending.kwargs)
        for zero in syncing:
            zero.reduce_gradients()
        if self.holds_last_stage:
            loss = torch.stack([x.detach().float() for x in losses]).sum() / self.grad_scale / self.n_microbatches
        else:
            loss = torch.zeros((), device=device, dtype=torch.float32)  # fp32 on every rank, as on the last
        dist.broadcast(loss, src=self.last_stage_rank, group=self.pp_group)
        return loss

    def predict(self, pending: PendingPipelineOutput, device: torch.device) -> Any:
        """Forward only, without a loss: the merged outputs on the ranks holding the last stage, None elsewhere."""
        first = pending.args[0] if pending.args else next(iter(pending.kwargs.values()))
        dummy_targets = torch.zeros(first.shape[0], device=device)
        saved, self.loss_fn = self.loss_fn, _zero_loss
        try:
            outputs = self.schedule.eval(*pending.args, target=dummy_targets, losses=[], **pending.kwargs)
        finally:
            self.loss_fn = saved
        return outputs if self.holds_last_stage else None


def _zero_loss(outputs: Any, targets: Any) -> torch.Tensor:
    first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return first.sum() * 0.0


def build_schedule(
    schedule_name: str,
    stage_modules: list[nn.Module],
    mesh: Par3DMesh,
    n_microbatches: int,
    virtual_stages: int,
    device: torch.device,
    loss_fn: Any,
) -> PipelineRunner:
    """The torch ``PipelineStage`` objects for this rank's stage modules, and the named torch schedule over them."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    pp = mesh.layout.pp
    rank = dist.get_rank()
    pp_rank = mesh.coords(rank).pp
    pp_group = mesh["pp"].get_group()
    n_stages = pp * (2 if schedule_name in V_SCHEDULES else virtual_stages)
    indices = stage_indices(schedule_name, pp_rank, pp, virtual_stages)
    stages = [
        PipelineStage(module, index, n_stages, device, group=pp_group)
        for module, index in zip(stage_modules, indices, strict=True)
    ]
    runner = PipelineRunner(
        schedule=None,
        n_microbatches=n_microbatches,
        pp_group=pp_group,
        last_stage_rank=mesh.group_ranks("pp", rank)[stage_indices_owner(schedule_name, n_stages - 1, pp)],
        holds_last_stage=(n_stages - 1) in indices,
        loss_fn=loss_fn,
        stage_modules=stage_modules,
    )
    cls = getattr(schedules, TORCH_SCHEDULES[schedule_name])
    target = stages[0] if schedule_name in SINGLE_STAGE_SCHEDULES else stages
    runner.schedule = cls(target, n_microbatches=n_microbatches, loss_fn=runner.scaled_loss, scale_grads=False)
    return runner


def stage_indices_owner(schedule_name: str, stage: int, pp: int) -> int:
    """The pipeline rank that holds global stage ``stage``."""
    if schedule_name in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def install_trunk(module: nn.Module, trunk_attr: str, holder: nn.Module) -> None:
    """Puts ``holder`` (this rank's stages at their original names) in place of the trunk and makes calling it
    return a :class:`PendingPipelineOutput`."""
    base = type(holder)
    holder.__class__ = type(f"Pipelined{base.__name__}", (_PipelinedTrunk, base), {})
    module.register_module(trunk_attr, holder)


def install_loss(module: nn.Module, loss_attr: str, runner: PipelineRunner) -> None:
    """Wraps the loss method so that, given a :class:`PendingPipelineOutput`, it runs the schedule."""
    user_loss = getattr(module, loss_attr)

    def loss(self: nn.Module, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(outputs, PendingPipelineOutput):
            train = self.training and torch.is_grad_enabled()
            return runner.run(outputs, targets, train=train, device=_device_of(self))
        return user_loss(outputs, targets, *args, **kwargs)

    setattr(module, loss_attr, types.MethodType(loss, module))

    def optimizer_zero_grad(self: nn.Module, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """par3d under pp: the pipeline cleared the gradients before its backward; clearing them now would
        discard the backward that already ran inside ``training_step``."""

    module.optimizer_zero_grad = types.MethodType(optimizer_zero_grad, module)  # type: ignore[assignment]
    object.__setattr__(module, "_par3d_pipeline", runner)


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class _PipelinedTrunk(nn.Module):
    """Mixed into the trunk's class under pp: calling it defers the computation to the pipeline schedule."""

    def forward(self, *args: Any, **kwargs: Any) -> PendingPipelineOutput:
        return PendingPipelineOutput(args, kwargs)


class PipelineHost(nn.Module):
    """Holds a plain model as the pipelined trunk, for Fabric scripts (which have no LightningModule to declare
    one). The model object itself becomes this rank's stages, so Fabric's references to it stay valid and its
    state dict keeps the original names."""

    pipeline_trunk = "trunk"
    pipeline_loss = "loss"

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.loss_fn: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.trunk(*args, **kwargs)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self.loss_fn is None:
            raise RuntimeError("PipelineHost.loss needs loss_fn: call Par3DFabricStrategy.pipeline_step(...).")
        return self.loss_fn(outputs, targets)
