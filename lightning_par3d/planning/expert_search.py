"""Which expert-parallel degrees a plan searches.

Expert parallelism (``ep``) splits a mixture-of-experts model's experts whole over ``ep`` ranks of ``dp_shard``: each
rank holds ``1/ep`` of them, FSDP2 shards those over the ``dp_shard / ep`` ranks that hold the same ones, and every
block's tokens go to their experts' ranks and back by all-to-all. Against FSDP2 gathering every expert on every rank,
it moves tokens instead of weights, so which wins depends on the tokens per step, the experts' size and the links:
the plan searches every degree (``SearchSpace(expert_parallel=None)``, the default) for a model with experts, and
the cost model and the memory check rank them with the other layouts.
"""

from __future__ import annotations

from torch import nn

from lightning_par3d.planning.candidates import divisors


def expert_degrees(root: nn.Module, world_size: int) -> tuple[tuple[int, ...], str | None]:
    """The degrees to search for ``root`` (a built model) on ``world_size`` ranks, and the table's note on them
    (None for a model without experts): 1, and every degree > 1 that divides its experts per layer and the world."""
    from lightning_par3d.parallel.expert_parallel import DISPATCH_STYLE, expert_plan, find_experts

    if DISPATCH_STYLE not in expert_plan(root).values():
        return (1,), None
    try:
        experts = find_experts(root, 1).num_experts
    except ValueError as error:
        return (1,), f"(ep > 1 not searched: {error})"
    degrees = tuple(d for d in divisors(experts) if d > 1 and world_size % d == 0)
    if not degrees:
        return (1,), f"(ep > 1 not searched: no degree divides both the {experts} experts and {world_size} ranks.)"
    listed = ", ".join(map(str, degrees))
    return (1, *degrees), f"(ep = {listed} searched too: {type(root).__name__} has {experts} experts per layer.)"
