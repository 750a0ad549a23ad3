"""The layouts a plan considers, and the checks that need neither the model nor its memory.

Every factorization ``world_size = pp × dp_replicate × dp_shard × cp × tp`` is a candidate (``cp > 1`` where
:class:`SearchSpace` tries context parallelism: for a model whose attention it can split, at degrees ``2·cp`` divides
the sequence by), and for each: the expert-parallel degrees that divide ``dp_shard × cp`` (where :class:`SearchSpace`
tries them: for a mixture-of-experts model), the ZeRO stages (over ``dp_shard > 1``; ``dp_shard = 1`` is replication,
stage 0; under ``cp > 1`` or ``ep > 1`` FSDP2, stage 3, alone), under ``pp > 1`` each pipeline schedule with its stages
per rank and microbatch counts, and each activation checkpointing mode, as :class:`SearchSpace` lists them. ``fixed``
pins any of these to one value (``{"tp": 2}``, ``{"pipeline_schedule": "1f1b"}``) and is checked first, with a message
that names the value and the fix. :func:`rejection` then says why a candidate cannot run:
:func:`~lightning_par3d.config.resolve_layout`'s own message, a tensor-parallel group across nodes, a batch that does
not split, a sequence that ``2·cp`` does not divide."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_par3d.config import AC_MODES, Layout, Par3DConfig, resolve_layout
from lightning_par3d.config.schedules import LOOP_SCHEDULES, SCHEDULE_NAMES, V_SCHEDULES
from lightning_par3d.distributed.locality import tp_across_nodes

SIZE_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FIXED_KEYS = (*SIZE_KEYS, "dp", "ep", "zero_stage", "pipeline_schedule", "virtual_stages", "microbatches",
              "activation_checkpointing")  # fmt: skip
"""What ``fixed`` may pin."""


@dataclass(frozen=True)
class SearchSpace:
    """The settings a plan tries for each factorization of the world size. ``fixed`` narrows any of them to one
    value."""

    zero_stages: tuple[int, ...] = (1, 2, 3)
    """ZeRO stages tried where ``dp_shard > 1``."""
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    """Pipeline schedules tried under ``pp > 1``."""
    virtual_stages: tuple[int, ...] = (2,)
    """Stages per rank tried for the looped schedules (the V schedules hold 2; GPipe and 1F1B 1)."""
    microbatch_multiples: tuple[int, ...] = (1, 2)
    """Microbatches tried under ``pp > 1``, as multiples of the pipeline stages (``pp ×`` stages per rank)."""
    activation_checkpointing: tuple[str, ...] = ("none", "full")
    """Activation checkpointing modes tried (of ``"none"``, ``"full"``, ``"selective"``, ``"op"``)."""
    context_parallel: tuple[int, ...] | None = None
    """Context-parallel degrees tried (1 included where it is wanted). ``None``: every degree whose ``2·cp`` divides
    the sequence, for a model whose attention par3d can split over cp ranks (torch's SDPA in repeated blocks, no
    sliding window), else 1 alone. Activations per rank fall with ``cp`` while the keys and values each block
    gathers cost communication, so the cost model and the memory check choose: cp wins where the sequence makes
    activations dominate."""
    expert_parallel: tuple[int, ...] | None = None
    """Expert-parallel degrees tried, each where it divides ``dp_shard × cp`` (1 included where it is wanted). ``None``:
    for a mixture-of-experts model, 1 and every degree that divides its experts per layer; else 1 alone. The experts'
    all-to-alls against FSDP2 gathering them whole: the cost model and the memory check choose."""
    prune_checkpointing: bool = True
    """Skip (list as rejected, with the reason) a checkpointing mode for a layout that fits without checkpointing:
    checkpointing only adds recompute there, so it is never the faster choice."""

    def __post_init__(self) -> None:
        problems = []
        for name, values, allowed in (
            ("zero_stages", self.zero_stages, (1, 2, 3)),
            ("schedules", self.schedules, SCHEDULE_NAMES),
            ("activation_checkpointing", self.activation_checkpointing, AC_MODES),
        ):
            wrong = [v for v in values if v not in allowed]
            if wrong or not values:
                problems.append(f"{name}={values!r}: choose one or more of {', '.join(map(repr, allowed))}.")
        degrees = tuple(
            (name, values)
            for name, values in (("context_parallel", self.context_parallel), ("expert_parallel", self.expert_parallel))
            if values is not None
        )
        for name, values in (
            *degrees,
            ("virtual_stages", self.virtual_stages),
            ("microbatch_multiples", self.microbatch_multiples),
        ):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                problems.append(f"{name}={values!r}: give one or more positive integers.")
        if problems:
            raise ValueError("Invalid search space:\n" + "\n".join(f"  - {p}" for p in problems))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fixed(fixed: Mapping[str, Any], world_size: int) -> None:
    """Raises ``ValueError`` for a ``fixed`` entry that is unknown or that no layout of ``world_size`` can have."""
    problems = [p for key, value in fixed.items() if (p := _fixed_problem(key, value, world_size)) is not None]
    product = 1
    for key in SIZE_KEYS:
        if _positive(fixed.get(key)):
            product *= fixed[key]
    if not problems and world_size % product:
        pinned = " × ".join(f"{k}={fixed[k]}" for k in SIZE_KEYS if k in fixed)
        problems.append(
            f"fixed {pinned} multiply to {product}, which does not divide the world size {world_size}. Pin sizes whose "
            f"product divides {world_size}."
        )
    if problems:
        raise ValueError("Cannot plan with these fixed settings:\n" + "\n".join(f"  - {p}" for p in problems))


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fixed_problem(key: str, value: Any, world_size: int) -> str | None:
    allowed = {"zero_stage": (0, 1, 2, 3), "pipeline_schedule": SCHEDULE_NAMES, "activation_checkpointing": AC_MODES}
    if key not in FIXED_KEYS:
        return f"fixed[{key!r}] is not something a plan chooses. Pin one of: {', '.join(FIXED_KEYS)}."
    if key in allowed:
        if value not in allowed[key]:
            return f"fixed {key}={value!r} is not allowed. Choose one of {', '.join(map(str, allowed[key]))}."
        return None
    if not _positive(value):
        return f"fixed[{key!r}]={value!r} must be a positive integer."
    if key in (*SIZE_KEYS, "dp", "ep") and world_size % value:
        return (
            f"fixed {key}={value} does not divide the world size {world_size}: every layout's sizes multiply to "
            f"{world_size}. Choose {key} among {divisors(world_size)}."
        )
    return None


def candidates(
    world_size: int, space: SearchSpace, fixed: Mapping[str, Any], base: Par3DConfig
) -> Iterator[Par3DConfig]:
    """Every configuration of the search space that agrees with ``fixed``, built on ``base`` (its other settings:
    plan, split points, blocks). Checkpointing modes come ``"none"`` first for each layout."""

    def options(key: str, values: Any) -> list[Any]:
        return [fixed[key]] if key in fixed else list(values)

    modes = sorted(options("activation_checkpointing", space.activation_checkpointing), key=lambda m: m != "none")
    for sizes in _sizes(world_size, space, fixed, options):
        for pipeline in _pipelines(sizes["pp"], space, fixed, options):
            for ac in modes:
                yield dataclasses.replace(base, **sizes, **pipeline, activation_checkpointing=ac)


def _sizes(world_size: int, space: SearchSpace, fixed: Mapping[str, Any], options: Any) -> Iterator[dict[str, Any]]:
    """The mesh sizes and ZeRO stages: every ``pp × tp × cp × dp_replicate × dp_shard = world_size``."""
    for pp in options("pp", divisors(world_size)):
        for tp in options("tp", divisors(world_size // pp)):
            for cp in options("cp", divisors(world_size // (pp * tp)) if space.context_parallel is None
                              else space.context_parallel):  # fmt: skip
                dp = world_size // (pp * tp * cp)
                if world_size % (pp * tp * cp) or fixed.get("dp", dp) != dp:
                    continue
                for dp_replicate in options("dp_replicate", divisors(dp)):
                    dp_shard = dp // dp_replicate
                    if dp % dp_replicate or fixed.get("dp_shard", dp_shard) != dp_shard:
                        continue
                    for ep in options("ep", space.expert_parallel or (1,)):
                        if (dp_shard * cp) % ep:  # the experts split over the ranks of dp_shard × cp
                            continue
                        for stage in _zero_stages(dp_shard, max(cp, ep), space, options):
                            yield dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep, tp=tp,
                                       dp=None, zero_stage=stage)  # fmt: skip


def _zero_stages(dp_shard: int, split: int, space: SearchSpace, options: Any) -> list[int | None]:
    """ZeRO stages over ``dp_shard > 1``; none for replication; FSDP2's alone (``None``: the default) under cp or
    ep (``split > 1``)."""
    if split > 1:
        return [None] if 3 in options("zero_stage", (3,)) else []
    return [zero if dp_shard > 1 or zero != 0 else None
            for zero in options("zero_stage", space.zero_stages if dp_shard > 1 else (0,))]  # fmt: skip


def _pipelines(pp: int, space: SearchSpace, fixed: Mapping[str, Any], options: Any) -> Iterator[dict[str, Any]]:
    if pp == 1:
        yield {}
        return
    for schedule in options("pipeline_schedule", space.schedules):
        if schedule in V_SCHEDULES:
            per_rank = [2]
        elif schedule in LOOP_SCHEDULES:
            per_rank = list(space.virtual_stages)
        else:
            per_rank = [1]
        for v in options("virtual_stages", per_rank):
            stages = pp * (2 if schedule in V_SCHEDULES else v)
            multiples = sorted({stages * k for k in space.microbatch_multiples})
            for m in options("microbatches", multiples):
                yield dict(pipeline_schedule=schedule, virtual_stages=v, microbatches=m)


def rejection(
    config: Par3DConfig,
    world_size: int,
    devices_per_node: int,
    global_batch: int | None,
    rank_batch: int | None = None,
    seq_len: int | None = None,
) -> tuple[Layout | None, str | None]:
    """The resolved layout, or why this configuration cannot run (before looking at the model). The batch is
    ``global_batch`` over every data-parallel rank, or ``rank_batch`` on each; ``seq_len`` tokens per row."""
    try:
        layout = resolve_layout(config, world_size)
    except ValueError as error:
        return None, _one_line(str(error))
    assert layout is not None
    across = tp_across_nodes(layout, devices_per_node)
    if across is not None:
        return layout, across
    if seq_len is not None and layout.cp > 1 and seq_len % (2 * layout.cp):
        return layout, (
            f"cp={layout.cp} cuts each row into 2·cp = {2 * layout.cp} chunks, which seq_len={seq_len} does not "
            f"divide. Use a cp whose 2·cp divides {seq_len}, or pad the rows."
        )
    if rank_batch is None:
        assert global_batch is not None
        if global_batch % layout.dp:
            return layout, (
                f"the global batch of {global_batch} does not split over dp={layout.dp} data-parallel ranks. Use a "
                f"dp that divides {global_batch}, or a batch that is a multiple of {layout.dp}."
            )
        rank_batch = global_batch // layout.dp
    if layout.pp > 1 and rank_batch % layout.microbatches:
        return layout, (
            f"the per-rank batch of {rank_batch} samples does not split into microbatches={layout.microbatches}. "
            "Use a microbatch count that divides it, or a larger batch."
        )
    return layout, None


def _one_line(message: str) -> str:
    """par3d's configuration errors list their problems on lines of their own; a table wants one line."""
    lines = [line.strip().removeprefix("- ") for line in message.splitlines() if line.strip()]
    if lines and lines[0].endswith(":") and len(lines) > 1:
        lines = lines[1:]
    return " ".join(lines)
