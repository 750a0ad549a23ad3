"""The pieces ZeRO stages 1 and 2 move: each parameter's rows, and buckets that move many parameters per collective.

A parameter's local tensor (its tensor-parallel piece, if any) is cut along dim 0 into ``N = dp_shard`` chunks of
``ceil(rows / N)`` rows, ``torch.chunk``'s sizes, so rank ``d`` owns rows ``[d·chunk, (d+1)·chunk)`` (fewer, or
none, on the last ranks). Its storage is padded to ``N · chunk`` rows when the rows do not divide, so that chunk
``d`` of the storage is always ``chunk`` rows long.

Collectives go by bucket, as DDP's do: parameters are grouped, in the reverse of their registration order (roughly
the order backward produces their gradients), into buckets of about 25 MiB of one dtype. A bucket's gradients are
averaged in one asynchronous collective as soon as the last of them is ready, and its result is taken when the next
bucket starts or backward ends (one bucket in flight overlaps backward's compute):

* stage 1: the whole gradients, concatenated, are all-reduced over the data-parallel group, and copied back;
* stage 2: the gradients are laid out rank-major, ``[N, Σ chunk·rest]`` (row ``d`` holds every parameter's chunk
  ``d``), reduce-scattered over ``dp_shard`` (then averaged over ``dp_replicate``), and the whole gradients freed;
  each parameter's owned rows then view the bucket's output, which is all of the gradient a rank keeps.

After the optimizer step each bucket all-gathers the owned chunks into every rank's storage in one collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par3d.parallel.tensor_parallel import local_tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

BUCKET_CAP_BYTES = 25 * 2**20
"""Bytes of gradient per bucket (DDP's default ``bucket_cap_mb``)."""


def shard_rows(rows: int, n: int, index: int) -> tuple[int, int, int]:
    """``(start, stop, chunk)``: the rows that shard ``index`` of ``n`` owns, ``torch.chunk``'s (and DTensor's
    ``Shard(0)``) sizes: ``chunk = ceil(rows / n)`` rows per shard, fewer (or none) on the last."""
    chunk = math.ceil(rows / n)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows), chunk


@dataclass
class ParamShard:
    """One parameter as ZeRO holds it on this rank."""

    param: Tensor
    storage: Tensor
    """``[n · chunk, *rest]``, the parameter's local tensor at its start, padded (or the local tensor itself)."""
    n: int
    """Pieces over dp_shard; 1 for a 0-d parameter, which is not cut: every rank steps it whole."""
    index: int
    start: int
    stop: int
    chunk: int
    tensor: Tensor
    """What the inner optimizer steps: the owned rows, a view into ``storage`` (the parameter itself when 0-d)."""
    placements: tuple[Placement, ...]
    """Of the owned rows, as a DTensor on the ``(dp_replicate, dp_shard, tp)`` mesh (for checkpoints)."""

    @property
    def rest(self) -> int:
        """Elements per row."""
        return math.prod(self.storage.shape[1:])

    @property
    def piece(self) -> int:
        """Elements of one chunk: what this parameter adds to each rank's row of a rank-major bucket."""
        return self.chunk * self.rest

    @property
    def own_chunk(self) -> Tensor:
        """This rank's chunk of the padded storage (the all-gather's input)."""
        return self.storage[self.index * self.chunk : (self.index + 1) * self.chunk]

    def owned_rows(self, whole: Tensor) -> Tensor:
        """This rank's rows of a parameter-shaped local tensor (all of it when the parameter is not cut)."""
        return whole if self.n == 1 else whole[self.start : self.stop]


@dataclass
class Bucket:
    """Parameters whose gradients move in one collective."""

    shards: list[ParamShard]
    ready: int = 0
    launched: bool = False
    offsets: list[int] = field(default_factory=list)
    """Offset of each parameter's chunk in a rank's row of the rank-major layout."""

    def __post_init__(self) -> None:
        self.offsets = [sum(s.piece for s in self.shards[:i]) for i in range(len(self.shards))]

    @property
    def row(self) -> int:
        """Elements per rank in the rank-major layout."""
        return sum(s.piece for s in self.shards)

    def reset(self) -> None:
        self.ready, self.launched = 0, False


def make_buckets(shards: Sequence[ParamShard], cap_bytes: int = BUCKET_CAP_BYTES) -> list[Bucket]:
    """Cut parameters (those that need gradients), in reverse order, grouped by dtype into buckets of about
    ``cap_bytes``."""
    buckets: list[Bucket] = []
    open_by_dtype: dict[torch.dtype, list[ParamShard]] = {}
    for shard in reversed(shards):
        current = open_by_dtype.setdefault(shard.storage.dtype, [])
        current.append(shard)
        if sum(s.storage.numel() for s in current) * shard.storage.element_size() >= cap_bytes:
            buckets.append(Bucket(current))
            open_by_dtype[shard.storage.dtype] = []
    buckets += [Bucket(members) for members in open_by_dtype.values() if members]
    return buckets


def _whole_grads(bucket: Bucket) -> list[Tensor]:
    """Each parameter's local gradient (a zero one where backward gave none, as DDP treats unused parameters)."""
    grads = []
    for shard in bucket.shards:
        if shard.param.grad is None:
            shard.param.grad = torch.zeros_like(shard.param)
        grads.append(local_tensor(shard.param.grad))
    return grads


@torch.no_grad()
def all_reduce_bucket(bucket: Bucket, group: Any) -> Callable[[], None]:
    """Stage 1: starts averaging the bucket's whole gradients over ``group`` in one all-reduce; the returned
    function waits for it and writes the averages back into the gradients."""
    grads = _whole_grads(bucket)
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        for grad, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(piece.view_as(grad))

    return finish


@torch.no_grad()
def reduce_scatter_bucket(bucket: Bucket, shard_group: Any, replicate_group: Any | None) -> Callable[[], None]:
    """Stage 2: frees the bucket's whole gradients and starts averaging them over ``dp_shard`` into each rank's
    rows; the returned function waits, averages over ``replicate_group`` too, and accumulates the rows into the
    owned rows' ``.grad``."""
    grads = _whole_grads(bucket)
    n = bucket.shards[0].n
    rank_major = grads[0].new_zeros(n, bucket.row)
    for shard, grad, offset in zip(bucket.shards, grads, bucket.offsets, strict=True):
        padded = grad if grad.shape[0] == n * shard.chunk else _pad_rows(grad, n * shard.chunk)
        rank_major[:, offset : offset + shard.piece] = padded.reshape(n, shard.piece)
        shard.param.grad = None
    del grads
    out = rank_major.new_empty(bucket.row)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.12
    work = reduce_scatter(out, rank_major.view(-1), op=dist.ReduceOp.AVG, group=shard_group, async_op=True)

    def finish() -> None:
        work.wait()
        if replicate_group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.AVG, group=replicate_group)
        for shard, offset in zip(bucket.shards, bucket.offsets, strict=True):
            rows = shard.stop - shard.start
            own = out[offset : offset + rows * shard.rest].view(rows, *shard.storage.shape[1:])
            if shard.tensor.grad is None:
                shard.tensor.grad = own
            else:
                shard.tensor.grad += own

    return finish


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded


@torch.no_grad()
def all_gather_buckets(buckets: Sequence[Bucket], group: Any) -> None:
    """After the step: every rank's owned chunks, bucket by bucket, into every rank's storage."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    pending = []
    for bucket in buckets:
        mine = torch.cat([s.own_chunk.reshape(-1) for s in bucket.shards])
        everyone = mine.new_empty(bucket.shards[0].n, bucket.row)
        work = all_gather(everyone.view(-1), mine, group=group, async_op=True)
        pending.append((bucket, everyone, work))
    for bucket, everyone, work in pending:
        work.wait()
        for shard, offset in zip(bucket.shards, bucket.offsets, strict=True):
            shard.storage.view(shard.n, shard.piece).copy_(everyone[:, offset : offset + shard.piece])
