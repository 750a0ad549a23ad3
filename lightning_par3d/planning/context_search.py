"""When a plan searches context-parallel layouts, and at which degrees.

Context parallelism (``cp``) splits every row's tokens over ``cp`` ranks: activations per rank fall by ``cp``, every
block all-gathers its keys and values, and the parameters are sharded over ``dp_shard × cp``. Against data parallelism
over the same ranks it computes as much per rank and only adds communication, so it wins only where the sequence makes
activations dominate a rank's memory below one row: where the plan without it fits nothing, or where its fastest layout
takes one row per microbatch and still splits the model (pp, tp), recomputes or accumulates while holding more
activations than model state (:func:`context_may_pay`); above one row, more data-parallel ranks, microbatches or
accumulation cut activations without cp's gathers. There the plan searches again with ``cp > 1``
(``SearchSpace(context_parallel=None)``, the default), and both searches' rows share one table, ranked by the cost model
and the memory check as every other layout. The table's notes say which way it went, and why.

``cp > 1`` is searched only at degrees whose ``2·cp`` divides the sequence (load-balanced chunks), and only for a
model par3d can split (:func:`~lightning_par3d.parallel.context_parallel.context_problem`: a trunk whose attention
is torch's SDPA without a sliding window, whose ``forward`` takes ``position_ids``) under the base configuration's
token mean.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_par3d.config import Par3DConfig
from lightning_par3d.planning.candidates import divisors
from lightning_par3d.planning.table import PlanRow, rank_key


def context_degrees(world_size: int, seq_len: int) -> tuple[int, ...]:
    """The degrees ``cp > 1`` that divide the world and whose ``2·cp`` divides ``seq_len``."""
    return tuple(c for c in divisors(world_size) if c > 1 and seq_len % (2 * c) == 0)


def context_refusal(root: nn.Module, base: Par3DConfig) -> str | None:
    """Why no context-parallel layout of ``root`` (a built model) can run with the base configuration, or None."""
    from lightning_par3d.parallel.context_parallel import context_problem

    if base.loss_mean != "tokens":
        return f"loss_mean={base.loss_mean!r}: cp > 1 weighs its ranks' token slices by the token mean only"
    return context_problem(root)


def context_may_pay(rows: Sequence[PlanRow]) -> tuple[str | None, str]:
    """``(why cp may pay, "")`` or ``(None, why not)``, from the plan's rows without context parallelism. Where a
    rank holds more than one row per microbatch, more data-parallel ranks, microbatches or accumulated batches cut
    its activations as cp would, without cp's gathers; cp is the only cut below one row. So it may pay where nothing
    fits, or where the fastest layout takes one row per microbatch and still splits the model (pp, tp), recomputes
    or accumulates to fit, holding more activations than model state on its fullest rank."""
    fitting = sorted((row for row in rows if row.fits), key=rank_key)
    if not fitting:
        return "no layout without it fits", ""
    best = fitting[0]
    assert best.memory is not None and best.layout is not None and best.rank_batch is not None
    name = f"the fastest layout without it, {best.describe()},"
    if (best.layout.pp, best.layout.tp, best.accumulate, best.config.activation_checkpointing) == (1, 1, 1, "none"):
        return None, f"{name} splits only the batch, and cp over the same ranks would compute as much and add gathers"
    per_microbatch = best.rank_batch // (best.layout.microbatches if best.layout.pp > 1 else 1)
    if per_microbatch > 1:
        return None, (
            f"{name} holds {per_microbatch} rows per microbatch: more data-parallel ranks, microbatches or "
            "accumulated batches cut its activations without cp's gathers"
        )
    worst = max(best.memory.rows, key=lambda row: row.total)
    activations, state = worst.activations + worst.recompute, worst.state.total
    amounts = f"({_size(activations)} of activations against {_size(state)} of model state per rank)"
    if activations <= state:
        return None, f"{name} is mostly model state {amounts}, which cp splits no further than FSDP2 does"
    return (
        f"{name} takes one row per microbatch and splits the model or recomputes to fit; its activations "
        f"dominate {amounts}",
        "",
    )


def _size(size: float) -> str:
    from lightning_par3d.planning.machine import format_bytes

    return format_bytes(int(size))
