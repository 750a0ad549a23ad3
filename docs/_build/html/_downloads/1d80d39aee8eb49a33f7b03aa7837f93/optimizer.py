"""ZeRO stages 1 and 2 (Rajbhandari et al., 2019): an optimizer wrapper over the ``dp_shard`` group.

Parameters stay whole on every rank (plain tensors, or DTensors over ``tp``). Each parameter's local tensor is cut
into ``N = dp_shard`` chunks of rows along dim 0, with ``torch.chunk``'s sizes (``ceil(rows / N)`` per rank, the last
ranks taking what is left): the same cut FSDP2 makes. Rank ``d`` of the group owns chunk ``d``: the wrapped
optimizer is rebuilt over those chunks only, so its state is ``1/N`` of a whole optimizer's. Per training step:

* **stage 1** (``P_os``): gradients are all-reduced (averaged) over the data-parallel group during backward, a
  bucket at a time, so every rank holds the whole gradient, as under DDP; the optimizer steps the owned rows (their
  gradient is a view of the whole gradient, no copy); then every parameter is all-gathered from its owners over
  ``dp_shard``.
* **stage 2** (``P_os+g``): during backward each bucket of gradients is reduce-scattered over ``dp_shard`` (then
  averaged over ``dp_replicate``) as soon as it is complete; the owned rows are kept and the whole gradients freed.
  Between backward and step a rank holds ``1/N`` of the gradients.

The bucketing and collectives are in :mod:`lightning_par3d.zero.buckets`, the state dicts (sharded, gathered, by
parameter name) in :mod:`lightning_par3d.zero.state`.

The owned rows are views into the parameter's own storage, so the optimizer writes the parameter in place and no
master copy exists. A parameter whose rows do not divide by ``N`` gets a storage padded to ``N · ceil(rows / N)``
rows (at most ``N − 1`` rows of padding), so that the all-gather writes every chunk in place. 0-d parameters are
not cut: every rank steps them whole.

Only element-wise optimizers give the same update on a chunk as on the whole tensor (SGD, Adam, AdamW, …); others
are refused. The wrapper shares the wrapped optimizer's ``param_groups`` dicts, so learning-rate schedulers bound
to it keep working; the hyper-parameters are copied to the inner optimizer before every step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_par3d.parallel.tensor_parallel import local_tensor, match_param_layout
from lightning_par3d.utils.torch_private import queue_end_of_backward, strided_shard
from lightning_par3d.zero.buckets import (
    Bucket,
    ParamShard,
    all_gather_buckets,
    all_reduce_bucket,
    make_buckets,
    reduce_scatter_bucket,
    shard_rows,
)
from lightning_par3d.zero.state import ZeroStateDicts

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from lightning_par3d.distributed.mesh import Par3DMesh

ELEMENTWISE_OPTIMIZERS: set[type[Optimizer]] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
}
"""Optimizers whose update of one element depends only on that element's gradient and state, so that stepping a
chunk of rows equals stepping the whole tensor. Add a class of your own here if that holds for it."""


class ZeroOptimizer(ZeroStateDicts, Optimizer):
    """ZeRO stage 1 or 2 over ``optimizer``: see the module docstring.

    Build it after the model's parameters are final (after tensor parallelism and materialization) and instead of
    stepping ``optimizer`` itself. ``optimizer`` must not have taken a step yet.
    """

    def __init__(self, optimizer: Optimizer, stage: int, mesh: Par3DMesh) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer serves zero_stage 1 and 2; got {stage}. Stage 3 is FSDP2.")
        _check_elementwise(optimizer)
        if any(optimizer.state.values()):
            raise RuntimeError(
                f"{type(optimizer).__name__} already holds state; ZeroOptimizer must wrap it before its first step."
            )
        # The same group dicts as ``optimizer``: a scheduler that sets group["lr"] on it is seen here.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.stage = stage
        self.wrapped = optimizer
        self.require_backward_grad_sync = True
        self._mesh = mesh
        self._state_mesh = mesh.device_mesh["dp_replicate", "dp_shard", "tp"]
        self._shards: dict[Tensor, ParamShard] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param in self._shards:
                    raise ValueError("A parameter appears twice in the optimizer's parameter groups.")
                self._shards[param] = self._shard(param)
        self.inner = _rebuild(optimizer, [[self._shards[p].tensor for p in g["params"]] for g in self.param_groups])
        trained = [s for s in self._shards.values() if s.param.requires_grad]
        self._buckets = make_buckets([s for s in trained if s.n > 1])
        self._bucket_of = {s.param: b for b in self._buckets for s in b.shards}
        self._whole = [s for s in trained if s.n == 1]
        self._end_of_backward_queued = False
        self._pending: list[Callable[[], None]] = []
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._shards if p.requires_grad
        ]

    # ---------------------------------------------------------------- layout
    def _shard(self, param: Tensor) -> ParamShard:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        whole = local_tensor(param).dim() > 0
        n = self._mesh.layout.dp_shard if whole else 1
        index = self._mesh["dp_shard"].get_local_rank() if n > 1 else 0
        rows = local_tensor(param).shape[0] if whole else 1
        start, stop, chunk = shard_rows(rows, n, index)
        storage = _padded_storage(param, n * chunk) if whole else local_tensor(param).detach().view(1)
        tp_placement = param.placements[0] if isinstance(param, DTensor) else Replicate()
        if n == 1:
            dp_placement: Placement = Replicate()
        elif isinstance(tp_placement, Shard) and tp_placement.dim == 0:
            # tp cuts dim 0 first, then dp_shard cuts each tp piece: FSDP2's right-to-left 2D layout.
            dp_placement = strided_shard()(0, split_factor=self._mesh.layout.tp)
        else:
            dp_placement = Shard(0)
        return ParamShard(
            param=param,
            storage=storage,
            n=n,
            index=index,
            start=start,
            stop=stop,
            chunk=chunk,
            tensor=storage[start:stop] if whole else local_tensor(param).detach(),
            placements=(Replicate(), dp_placement, tp_placement),
        )

    # ---------------------------------------------------------------- gradients
    def _on_grad_ready(self, param: Tensor) -> None:
        """Runs as each parameter's gradient is accumulated in a backward pass: a bucket whose gradients are all
        ready is reduced at once; the rest are reduced when backward ends."""
        match_param_layout(param)
        if self.stage == 1 and not self.require_backward_grad_sync:
            return
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            queue_end_of_backward(self._end_of_backward)
        bucket = self._bucket_of.get(param)
        if bucket is None:  # a 0-d parameter, not cut: reduced on its own
            self._reduce_whole(self._shards[param])
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.shards):
            self._reduce(bucket)

    def _end_of_backward(self) -> None:
        """Reduces the buckets some of whose parameters got no gradient (they count as zeros), in bucket order,
        and waits for every reduction."""
        self._end_of_backward_queued = False
        for bucket in self._buckets:
            if bucket.ready and not bucket.launched:
                self._reduce(bucket)
            bucket.reset()
        self._finish_pending()

    def _reduce(self, bucket: Bucket) -> None:
        """Starts the bucket's reduction, after taking the result of the one before (one bucket in flight)."""
        self._finish_pending()
        bucket.launched = True
        if self.stage == 1:
            self._pending.append(all_reduce_bucket(bucket, self._mesh["dp"].get_group()))
        else:
            replicas = self._mesh["dp_replicate"].get_group() if self._mesh.layout.dp_replicate > 1 else None
            self._pending.append(reduce_scatter_bucket(bucket, self._mesh["dp_shard"].get_group(), replicas))

    def _finish_pending(self) -> None:
        while self._pending:
            self._pending.pop(0)()

    @torch.no_grad()
    def _reduce_whole(self, shard: ParamShard) -> None:
        """A parameter that is not cut: its gradient averaged over the data-parallel group (stage 2 moves it into
        the stepped tensor's ``.grad``, as for the cut ones)."""
        grad = shard.param.grad
        if grad is None:
            return
        dist.all_reduce(local_tensor(grad), op=dist.ReduceOp.AVG, group=self._mesh["dp"].get_group())
        if self.stage == 2:
            piece = local_tensor(grad)
            shard.tensor.grad = piece if shard.tensor.grad is None else shard.tensor.grad + piece
            shard.param.grad = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: backward passes inside keep their gradients local (accumulation), like DDP's ``no_sync``. Stage
        2 reduce-scatters every backward pass regardless, so that no rank ever holds whole gradients for long."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def reduce_gradients(self) -> None:
        """Stage 1: averages every gradient over the data-parallel group now, bucket by bucket. Used after a
        pipeline schedule, whose backward passes run with the reduction switched off."""
        for param in self._shards:
            match_param_layout(param)
        for bucket in self._buckets:
            self._reduce(bucket)
            bucket.reset()
        self._finish_pending()
        for shard in self._whole:
            self._reduce_whole(shard)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs ``closure`` (forward and backward, under Lightning), steps the owned rows, then all-gathers every
        parameter from its owners."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._opt_called = True  # what an LR scheduler checks to tell the step ran
        if self.stage == 1:
            for shard in self._shards.values():
                grad = shard.param.grad
                shard.tensor.grad = None if grad is None else shard.owned_rows(local_tensor(grad))
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        if self.stage == 1:
            for shard in self._shards.values():
                shard.tensor.grad = None  # views into the gradients, which must not outlive them
        all_gather_buckets(self._buckets, self._mesh["dp_shard"].get_group())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients and the owned rows' gradients."""
        for shard in self._shards.values():
            if set_to_none:
                shard.param.grad = None
            elif shard.param.grad is not None:
                shard.param.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "inner"):
            raise RuntimeError("ZeroOptimizer cannot take parameter groups after construction; add them before.")
        super().add_param_group(param_group)

    # ---------------------------------------------------------------- clipping
    def shard_grads(self) -> list[Tensor]:
        """Stage 2: each owned rows' gradient as a DTensor over ``(dp_replicate, dp_shard, tp)``, whose norm
        DTensor reduces over every rank that holds a piece (``lightning_par3d.distributed.gradients`` takes it from
        there)."""
        return [
            self._as_dtensor(shard, shard.tensor.grad)
            for shard in self._shards.values()
            if shard.tensor.grad is not None
        ]

    def close(self) -> None:
        """Removes the gradient hooks (the parameters keep their padded storage)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _check_elementwise(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS)):
        raise TypeError(
            f"zero_stage 1 and 2 step each rank's rows of every parameter, which equals the whole update only for "
            f"element-wise optimizers; {type(optimizer).__name__} is not known to be one (known: "
            f"{', '.join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))}). Use zero_stage=0 or 3, or, if it is "
            "element-wise, add it to lightning_par3d.zero.optimizer.ELEMENTWISE_OPTIMIZERS."
        )


def _padded_storage(param: Tensor, padded_rows: int) -> Tensor:
    """The parameter's local tensor in a storage of ``padded_rows`` rows. The parameter moves into it (``.data``)
    when padding is needed, so that it stays the same object for the model, the hooks and the user."""
    local = local_tensor(param)
    if local.shape[0] == padded_rows:
        return local.detach()
    storage = local.new_zeros((padded_rows, *local.shape[1:]))
    storage[: local.shape[0]] = local
    local.data = storage[: local.shape[0]]
    return storage


def _rebuild(optimizer: Optimizer, groups_params: list[list[Tensor]]) -> Optimizer:
    """A new optimizer of ``optimizer``'s class over other tensors, with the same hyper-parameters per group."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": params}
        for group, params in zip(optimizer.param_groups, groups_params, strict=True)
    ]
    return type(optimizer)(groups, **kwargs)


def wrap_optimizers(optimizers: list[Optimizer], schedulers: Iterable[Any], stage: int, mesh: Par3DMesh) -> list[Any]:
    """Wraps each optimizer for ZeRO ``stage`` (1 or 2) and points the schedulers bound to it at the wrapper."""
    wrapped = [ZeroOptimizer(opt, stage, mesh) for opt in optimizers]
    by_id = {id(w.wrapped): w for w in wrapped}
    for scheduler in schedulers:
        if id(getattr(scheduler, "optimizer", None)) in by_id:
            scheduler.optimizer = by_id[id(scheduler.optimizer)]
            _mark_step_tracked(scheduler.optimizer)
    return wrapped


def _mark_step_tracked(zero: ZeroOptimizer) -> None:
    """Tells torch's LR schedulers that ``zero.step`` records its calls (it sets ``_opt_called``, as the wrapper a
    scheduler puts on its optimizer's ``step`` does), so that they do not warn that ``step`` was replaced."""
    step = zero.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    zero.step = tracked  # type: ignore[method-assign]


def zero_optimizers(optimizers: Iterable[Any]) -> list[ZeroOptimizer]:
    """The :class:`ZeroOptimizer` among ``optimizers`` (unwrapping Lightning's and Fabric's optimizer wrappers)."""
    found = []
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        if isinstance(inner, ZeroOptimizer):
            found.append(inner)
    return found


def optimizer_grads(optimizer: Any) -> list[Tensor]:
    """The gradients ``optimizer`` will step with: its parameters' ``.grad``, or, under ZeRO stage 2 (where each
    rank holds only its rows of the gradients), those rows as DTensors."""
    zero = zero_optimizers([optimizer])
    if zero and zero[0].stage == 2:
        return zero[0].shard_grads()
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
