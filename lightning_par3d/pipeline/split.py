"""Splitting a model's trunk into pipeline stages, without renaming anything.

The trunk is the module the model names in ``pipeline_trunk``. Its repeated blocks live in one container:

* an ``nn.ModuleDict`` (keys ``"0"``, ``"1"``, … as torchtitan's models do): a stage deletes the blocks it does not
  own, and the modules around them it does not own become ``None``, so the trunk's ``forward`` skips ``None``
  modules, as in ``examples/gpt.py``;
* an ``nn.ModuleList`` (a Hugging Face decoder's ``layers``): a stage replaces what it does not own by a
  parameterless :class:`NotOnThisStage` placeholder, so the list keeps its length and indices, and
  :mod:`lightning_par3d.pipeline.transformers_stages` runs the stage.

Either way every other name stays as it was. The modules registered before the container (on the path from the
trunk to it) are the *head of the pipe* (embeddings) and belong to the first stage; those after it are the *tail*
(final norm, LM head) and belong to the last stage. Modules with no parameters and no persistent buffers (rotary
position tables, dropout) are *shared*: every stage uses the trunk's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_par3d.utils.patterns import repeated_members
from lightning_par3d.utils.torch_private import deepcopy_with_fake_tensors


class NotOnThisStage(nn.Module):
    """Stands in a stage for a module another stage holds: no parameters, and passes its first input through."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()), None)


@dataclass(frozen=True)
class TrunkParts:
    """Where the blocks are, and which modules come before and after them (full names within the trunk)."""

    container: str
    blocks: tuple[str, ...]
    head: tuple[str, ...]
    tail: tuple[str, ...]
    shared: tuple[str, ...] = ()
    """Head and tail modules without parameters or persistent buffers: every stage uses the trunk's own."""
    keep_indices: bool = False
    """The blocks live in an ``nn.ModuleList``: what a stage does not own is replaced, never deleted."""


def find_trunk_parts(trunk: nn.Module) -> TrunkParts:
    """Finds the one container of same-typed blocks in ``trunk`` and the modules around it."""
    candidates = [name for name, sub in trunk.named_modules() if repeated_members(sub)]
    if len(candidates) != 1:
        raise TypeError(
            f"Pipeline parallelism needs exactly one container of repeated blocks in the trunk "
            f"{type(trunk).__name__}; found {len(candidates)}: {candidates}. Keep the blocks in one nn.ModuleDict "
            "(or nn.ModuleList)."
        )
    container = candidates[0]
    blocks_module = trunk.get_submodule(container)
    if isinstance(blocks_module, nn.ModuleList) and not _list_trunk_supported(trunk):
        raise TypeError(
            f"Under pp > 1 the repeated blocks must live in an nn.ModuleDict (keys '0', '1', …) so that each stage "
            f"keeps its original parameter names; {type(trunk).__name__}.{container} is an "
            f"{type(blocks_module).__name__}. Build it as nn.ModuleDict({{str(i): Block() for i in range(n)}}) "
            "(Hugging Face transformers decoders, whose layers are a ModuleList, are pipelined as they are)."
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
    keys = (
        list(blocks_module.keys())
        if isinstance(blocks_module, nn.ModuleDict)
        else [str(i) for i, _ in enumerate(blocks_module.children())]
    )
    blocks = tuple(f"{container}.{key}" for key in keys)
    shared = tuple(n for n in (*head, *tail) if _stateless(trunk.get_submodule(n)))
    return TrunkParts(
        container=container,
        blocks=blocks,
        head=tuple(n for n in head if n not in shared),
        tail=tuple(n for n in tail if n not in shared),
        shared=shared,
        keep_indices=isinstance(blocks_module, nn.ModuleList),
    )


def _stateless(module: nn.Module) -> bool:
    """No parameters and no persistent buffers: nothing to own, shard or save."""
    if any(True for _ in module.parameters()):
        return False
    for sub in module.modules():
        if any(name not in sub._non_persistent_buffers_set for name in sub._buffers):
            return False
    return True


def _list_trunk_supported(trunk: nn.Module) -> bool:
    from lightning_par3d.pipeline.transformers_stages import decoder_layout

    return decoder_layout(trunk) is not None


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


def plan_stages(trunk: nn.Module, pp: int, per_rank: int, split_points: list[str], where: str = "trunk") -> StagePlan:
    """The trunk's parts and the blocks of each of the ``pp × per_rank`` stages: at ``split_points`` if given, else
    balanced (:func:`balanced_split`). ``where`` names the trunk in errors."""
    parts = find_trunk_parts(trunk)
    n_stages = pp * per_rank
    if len(parts.blocks) < n_stages:
        raise ValueError(
            f"Number of stages ({n_stages} = pp {pp} × {per_rank} per rank) cannot be greater than the number of "
            f"blocks ({len(parts.blocks)} in {where}.{parts.container}). Reduce pp or virtual_stages, or use a "
            "deeper model."
        )
    split = explicit_split(parts, split_points, n_stages) if split_points else balanced_split(trunk, parts, n_stages)
    return StagePlan(parts, split)


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage owns; stage 0 also owns the head modules, the last stage the tail modules."""

    parts: TrunkParts
    blocks: list[list[str]]

    def build(self, trunk: nn.Module, stage: int) -> nn.Module:
        """Stage ``stage`` as a deep copy of the (meta) ``trunk`` keeping only what it owns."""
        last = len(self.blocks) - 1
        return build_stage_module(trunk, self.parts, set(self.blocks[stage]), stage == 0, stage == last)

    def graft(self, holder: nn.Module, stage_module: nn.Module, stage: int) -> None:
        """Puts stage ``stage``'s modules into ``holder`` at their original names (see :func:`graft`)."""
        last = len(self.blocks) - 1
        graft(holder, stage_module, self.parts, set(self.blocks[stage]), stage == 0, stage == last)


def build_stage_module(trunk: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> nn.Module:
    """A deep copy of the (meta) ``trunk`` keeping only the blocks in ``owned``, the head modules if ``first``
    and the tail modules if ``last``; the shared modules are the trunk's own objects. Nothing is renamed.

    Only what the stage keeps is copied: the modules it leaves out enter the copy's memo as placeholders (which
    :func:`keep_only` then deletes or keeps), so a stage costs its share of the model, not the whole model: the
    planner builds hundreds of stages of a real-sized model."""
    left_out = [block for block in parts.blocks if block not in owned]
    left_out += [*(() if first else parts.head), *(() if last else parts.tail)]
    memo: dict[int, Any] = {id(trunk.get_submodule(name)): NotOnThisStage() for name in left_out}
    memo.update({id(trunk.get_submodule(name)): trunk.get_submodule(name) for name in parts.shared})
    stage = keep_only(deepcopy_with_fake_tensors(trunk, memo), parts, owned, first, last)
    for name in parts.shared:
        _put(stage, name, trunk.get_submodule(name))
    return stage


def keep_only(stage: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> nn.Module:
    """Removes from ``stage``, in place, the blocks not in ``owned`` and the head (tail) modules unless ``first``
    (``last``): deleted or ``None`` in a ModuleDict trunk, placeholders in a ModuleList one; returns it."""
    container = stage.get_submodule(parts.container)
    for block in parts.blocks:
        if block not in owned:
            key = block.rsplit(".", 1)[1]
            if parts.keep_indices:
                container.register_module(key, NotOnThisStage())
            else:
                delattr(container, key)
    for name in (*(() if first else parts.head), *(() if last else parts.tail)):
        _put(stage, name, NotOnThisStage() if parts.keep_indices else None)
    return stage


def _put(root: nn.Module, name: str, module: nn.Module | None) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent.register_module(attr, module)


def graft(holder: nn.Module, stage: nn.Module, parts: TrunkParts, owned: set[str], first: bool, last: bool) -> None:
    """Puts ``stage``'s own modules into ``holder`` at their original names (the same objects, shared), so that
    the LightningModule's parameters are this rank's stage parameters under their original names."""
    # In the trunk's own order, never a set's: every rank of a tp or dp group must list its parameters in the same
    # order, or order-dependent collectives (state-dict gathers, norm reductions) pair up different tensors.
    blocks = [b for b in parts.blocks if b in owned]
    names = [*blocks, *(parts.head if first else ()), *(parts.tail if last else ())]
    for name in names:
        _put(holder, name, stage.get_submodule(name))


def empty_holder(trunk: nn.Module, parts: TrunkParts) -> nn.Module:
    """The (meta) ``trunk`` itself, emptied in place of blocks, head and tail: the skeleton :func:`graft` fills.
    Keeping the same object keeps every reference to the model (Fabric's, the user's) pointing at this rank's
    stages."""
    return keep_only(trunk, parts, owned=set(), first=False, last=False)
