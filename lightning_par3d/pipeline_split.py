"""Splitting a model's trunk into pipeline stages, without renaming anything.

The trunk is the module the LightningModule names in ``pipeline_trunk``. Its repeated blocks live in one
``nn.ModuleDict`` (keys ``"0"``, ``"1"``, … as torchtitan's models do), so that deleting the blocks a stage does not
own leaves every other name as it was. The modules registered before the block container (on the path from the
trunk to it) are the *head of the pipe* (embeddings) and belong to the first stage; those after it are the *tail*
(final norm, LM head) and belong to the last stage. A stage is a deep copy of the (meta) trunk with everything it
does not own deleted (blocks) or set to ``None`` (head and tail modules), so the trunk's ``forward`` must skip
``None`` modules, as in ``examples/gpt.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from lightning_par3d.patterns import repeated_members

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
LOOP_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
SCHEDULE_NAMES = SINGLE_STAGE_SCHEDULES + LOOP_SCHEDULES + V_SCHEDULES


@dataclass(frozen=True)
class TrunkParts:
    """Where the blocks are, and which modules come before and after them (full names within the trunk)."""

    container: str
    blocks: tuple[str, ...]
    head: tuple[str, ...]
    tail: tuple[str, ...]


def find_trunk_parts(trunk: nn.Module) -> TrunkParts:
    """Finds the one ``nn.ModuleDict`` of same-typed blocks in ``trunk`` and the modules around it."""
    candidates = [name for name, sub in trunk.named_modules() if repeated_members(sub)]
    if len(candidates) != 1:
        raise TypeError(
            f"Pipeline parallelism needs exactly one container of repeated blocks in the trunk "
            f"{type(trunk).__name__}; found {len(candidates)}: {candidates}. Keep the blocks in one nn.ModuleDict."
        )
    container = candidates[0]
    blocks_module = trunk.get_submodule(container)
    if not isinstance(blocks_module, nn.ModuleDict):
        raise TypeError(
            f"Under pp > 1 the repeated blocks must live in an nn.ModuleDict (keys '0', '1', …) so that each stage "
            f"keeps its original parameter names; {type(trunk).__name__}.{container} is an "
            f"{type(blocks_module).__name__}. Build it as nn.ModuleDict({{str(i): Block() for i in range(n)}})."
        )
    head: list[str] = []
    tail: list[str] = []
    parent: nn.Module = trunk
    prefix = ""
    for atom in container.split("."):
        names = [n for n, _ in parent.named_children()]
        where = names.index(atom)
        head += [prefix + n for n in names[:where]]
        tail = [prefix + n for n in names[where + 1 :]] + tail
        parent = getattr(parent, atom)
        prefix += atom + "."
    blocks = tuple(f"{container}.{key}" for key in blocks_module)
    return TrunkParts(container=container, blocks=blocks, head=tuple(head), tail=tuple(tail))


def stage_indices(schedule: str, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The global stage indices that pipeline rank ``pp_rank`` holds: ``r, r + pp, …`` for looped schedules, and
    ``r, 2·pp − 1 − r`` for V-shaped ones (the last stage returns to rank 0)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def _param_count(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def balanced_split(trunk: nn.Module, parts: TrunkParts, n_stages: int) -> list[list[str]]:
    """Contiguous runs of blocks, one per stage, that minimize the largest stage's parameter count, counting the
    head modules on the first stage and the tail modules on the last."""
    n = len(parts.blocks)
    cost = [_param_count(trunk.get_submodule(b)) for b in parts.blocks]
    head = sum(_param_count(trunk.get_submodule(m)) for m in parts.head)
    tail = sum(_param_count(trunk.get_submodule(m)) for m in parts.tail)

    def stage_cost(stage: int, i: int, j: int) -> int:  # blocks i..j-1 on `stage`
        return sum(cost[i:j]) + (head if stage == 0 else 0) + (tail if stage == n_stages - 1 else 0)

    # best[s][j]: the smallest possible largest cost when stages 0..s-1 hold blocks 0..j-1 (each at least one)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][j], j))
        j = cut[s][j]
    return [list(parts.blocks[i:j]) for i, j in reversed(bounds)]


def explicit_split(parts: TrunkParts, split_points: list[str], n_stages: int) -> list[list[str]]:
    """Stages that begin at the named blocks (``split_points`` are block names, as in torchtitan)."""
    if len(split_points) != n_stages - 1:
        raise ValueError(
            f"split_points has {len(split_points)} entries but pp × virtual_stages = {n_stages} stages need "
            f"{n_stages - 1}. Give the block names where stages 2…{n_stages} begin, or leave split_points empty."
        )
    starts = []
    for point in split_points:
        matches = [i for i, b in enumerate(parts.blocks) if b == point or b.endswith("." + point)]
        if len(matches) != 1:
            raise ValueError(f"split point {point!r} names no block of the trunk. Blocks: {', '.join(parts.blocks)}.")
        starts.append(matches[0])
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(f"split_points {split_points} must name blocks in increasing order, after the first block.")
    bounds = [0, *starts, len(parts.blocks)]
    return [list(parts.blocks[bounds[k] : bounds[k + 1]]) for k in range(n_stages)]


def build_stage_module(trunk: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> nn.Module:
    """A deep copy of the (meta) ``trunk`` keeping only the blocks in ``owned``, the head modules if ``first``
    and the tail modules if ``last``. Nothing is renamed."""
    return keep_only(copy.deepcopy(trunk), parts, owned, first, last)


def keep_only(stage: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> nn.Module:
    """Deletes from ``stage``, in place, the blocks not in ``owned`` and the head (tail) modules unless ``first``
    (``last``); returns it."""
    container = stage.get_submodule(parts.container)
    assert isinstance(container, nn.ModuleDict)
    for block in parts.blocks:
        if block not in owned:
            del container[block.rsplit(".", 1)[1]]
    for name in (*(() if first else parts.head), *(() if last else parts.tail)):
        parent_name, _, attr = name.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        parent.register_module(attr, None)
    return stage


def graft(holder: nn.Module, stage: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> None:
    """Puts ``stage``'s own modules into ``holder`` at their original names (the same objects, shared), so that
    the LightningModule's parameters are this rank's stage parameters under their original names."""
    # In the trunk's own order, never a set's: every rank of a tp or dp group must list its parameters in the same
    # order, or order-dependent collectives (state-dict gathers, norm reductions) pair up different tensors.
    blocks = [b for b in parts.blocks if b in owned]
    names = [*blocks, *(parts.head if first else ()), *(parts.tail if last else ())]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = holder.get_submodule(parent_name) if parent_name else holder
        parent.register_module(attr, stage.get_submodule(name))


def empty_holder(trunk: nn.Module, parts: TrunkParts) -> nn.Module:
    """The (meta) ``trunk`` itself, emptied in place of blocks, head and tail: the skeleton :func:`graft` fills.
    Keeping the same object keeps every reference to the model (Fabric's, the user's) pointing at this rank's
    stages."""
    return keep_only(trunk, parts, owned=set(), first=False, last=False)
