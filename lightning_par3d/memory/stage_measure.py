"""One stage at a time, in a fake process group: what :func:`~lightning_par3d.estimate_memory` measures of each
pipeline stage (or of the whole model without pipelining): its parameters' local shapes and the bytes one
microbatch's forward saves for backward.

Each stage is built and parallelized by the run's own functions and run on fake tensors. The model is built once
per estimate and every stage (every copy of the model, without pipelining) is copied out of it (:class:`_OneBuild`).

**Stages are measured by their depth, not block by block.** Where a pipelined model's blocks are alike (the same
class, parameter and buffer shapes, and settings: a Qwen2 layer with a sliding window differs from one without), a
stage of ``k`` such blocks is measured as a stage of one block and of two blocks of the same role (the first stage,
a middle one, the last), and the figures extend by ``k - 1`` times what the second block added: a forward saves for
backward what each block saves, and a block's parameters are its own. The first of each role is measured, the others
reuse it. So an estimate costs a few blocks' forwards whatever the model's depth, and a plan of a 32-block model
measures what a plan of a 4-block one does. The extension is exact where the blocks are alike (the tests compare it
with the measure of the whole stage, field by field); stages whose blocks differ, ``selective`` checkpointing (every
``ac_every``-th block, by the block's index in the model) and a custom ``ac_blocks`` are measured whole, as before.

**Without pipelining, the whole model is measured by its depth too**, where it declares a pipeline trunk
(``pipeline_trunk``, as every model par3d pipelines does): a copy of the build cut to its first two and first three
blocks (:meth:`_OneBuild.copy`: a ModuleList shortened, a ModuleDict's other keys removed), parallelized by the run's
functions and run, and the figures extend by what the third block added. Two and three, not one and two: the run's
functions find a model's blocks as a container of two or more alike modules (for checkpointing and sequence
parallelism), which a model cut to one block no longer has. A model that declares no trunk, or of five blocks or fewer
(whose cuts would run as many), is measured whole.

**Checkpointed parts read their recompute from the same parts without checkpointing**: what backward recomputes at a
time is a block's own activations, metered in the unchecked part's forward (:attr:`StageMeasure.block_bytes`). The
planner tries a layout without checkpointing first, so its checkpointed variant finds that measure made
(:class:`SharedMeasures`) and runs once, not twice.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par3d import compose as build
from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.distributed.fakeworld import fake_world
from lightning_par3d.distributed.groups import fake_group
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.memory.meters import SavedTensorMeter
from lightning_par3d.parallel.activation_checkpoint import find_ac_blocks
from lightning_par3d.parallel.context_parallel import apply_context_parallel, cut_declared_loss, positions_of
from lightning_par3d.parallel.precision import autocast, built_in
from lightning_par3d.parallel.tensor_parallel import local_tensor
from lightning_par3d.pipeline.split import find_trunk_parts
from lightning_par3d.pipeline.trunk import declared_pipeline, pipeline_loss_of
from lightning_par3d.utils.torch_private import (
    deepcopy_with_fake_tensors,
    fake_mode_paused,
    fake_tensor_mode,
    fp32_grouped_mm_on_fake,
    moves_in_place_skipped,
)


@dataclass
class StageMeasure:
    param_shapes: list[tuple[int, ...]]
    activation_bytes: int
    """Saved for backward by one microbatch's forward (under checkpointing: what is held until backward)."""
    recompute_bytes: int
    """Under full or selective checkpointing: the largest checkpointed block's own activations, held again while
    backward recomputes it."""
    output: Any = None
    frozen: list[bool] = field(default_factory=list)
    """Per parameter in ``param_shapes``: frozen (``requires_grad=False``)."""
    block_bytes: int = 0
    """Without checkpointing: the largest block's own activations (what backward recomputes at a time, where the
    same part is checkpointed)."""

    def deeper(self, one_more: StageMeasure, blocks: int, measured: int = 1) -> StageMeasure:
        """This stage's measure with ``measured`` blocks (``self``) and with one more (``one_more``), extended to
        ``blocks`` alike blocks. The shapes come as a multiset (the ZeRO formulas sum over them), not in the module's
        order."""
        extra = Counter(zip(one_more.param_shapes, one_more.frozen, strict=True))
        extra.subtract(Counter(zip(self.param_shapes, self.frozen, strict=True)))
        per_block = list(extra.elements())
        more = blocks - measured
        pairs = [*zip(self.param_shapes, self.frozen, strict=True), *(per_block * more)]
        return StageMeasure(
            param_shapes=[shape for shape, _ in pairs],
            activation_bytes=self.activation_bytes + more * (one_more.activation_bytes - self.activation_bytes),
            recompute_bytes=max(self.recompute_bytes, one_more.recompute_bytes),
            output=one_more.output,
            frozen=[frozen for _, frozen in pairs],
            block_bytes=max(self.block_bytes, one_more.block_bytes),
        )


def measure_stages(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    layout: Layout,
    batch: Any,
    micro: int,
    precision: str,
    loss_fn: Callable[..., Tensor] | None,
    shared: SharedMeasures | None = None,
) -> list[StageMeasure]:
    """Each pipeline stage (or the whole model) built, parallelized and run for one microbatch on fake tensors.
    One fake process group serves every stage, as global rank 0: a stage's tensor-parallel shapes depend on the tp
    coordinate only, and dp_shard rank 0 holds the largest shards. ``shared``: the measures by depth of earlier
    estimates of this model (:class:`SharedMeasures`)."""
    fake = fake_tensor_mode() if shared is None else shared.fake
    with fake:
        inputs = _fake_batch(batch)
        microbatch = [t[: t.shape[0] // micro] if isinstance(t, Tensor) and t.dim() else t for t in inputs]
        # The input as a copy, not a view: a view is metered at the whole batch's storage, and the first stage's
        # figure is multiplied by the microbatches in flight (the run's are views of one batch, metered once). The
        # targets stay views: the last stage, one microbatch in flight, holds the whole batch's storage as the run's.
        if microbatch and isinstance(microbatch[0], Tensor):
            microbatch[0] = microbatch[0].clone()
    carried: Any = microbatch[0]
    results: list[StageMeasure] = []
    with fake_world(layout.world_size):
        # The run's mesh, over fake groups: real (CPU) mesh tensors, made outside the fake mode.
        mesh = Par3DMesh.build(layout, "cpu", fake_group)
        built = _OneBuild(module, precision) if shared is None else shared.build(module, precision)
        by_depth = {} if shared is None else shared.of(config, layout, microbatch, precision, loss_fn)
        # Under checkpointing, the blocks' own activations come from the same parts without it: an estimate without
        # checkpointing measures exactly those (the planner's, of the layout tried first), and shares them.
        plain = dataclasses.replace(config, activation_checkpointing="none")
        plain_by_depth = {} if shared is None else shared.of(plain, layout, microbatch, precision, loss_fn)
        structures = {} if shared is None else shared.structures
        for stage in range(layout.n_stages):
            part = _Part(built, config, mesh, stage, precision, fake, structures)
            result = part.measure_by_depth(carried, microbatch, loss_fn, by_depth, plain_by_depth)
            carried = result.output
            results.append(result)
    return results


def _build(module: nn.Module | Callable[[], nn.Module], precision: str) -> nn.Module:
    """A fresh copy of the model, built under the fake mode by ``configure_model`` (or the factory), in the dtype of
    a ``*-true`` precision (:func:`~lightning_par3d.parallel.precision.built_in`, as Lightning's precision plugin
    builds it), else in the default dtype. A ``.to()`` in the build that changes nothing (``peft`` moves each adapter
    it makes to its base layer's device) leaves the module as it is
    (:func:`~lightning_par3d.utils.torch_private.moves_in_place_skipped`)."""
    with built_in(precision), torch.device("cpu"), moves_in_place_skipped():
        if isinstance(module, nn.Module):
            with fake_mode_paused():  # a plain copy of the (unconfigured) module and whatever it holds
                built = copy.deepcopy(module)
            configure = getattr(built, "configure_model", None)
            if callable(configure):
                configure()
            return built
        return module()


@dataclass
class _OneBuild:
    """The model built once per estimate (once per plan: :meth:`SharedMeasures.build`), never parallelized itself:
    :func:`~lightning_par3d.compose.build_stage` copies each pipeline stage out of it and parallelizes the copy (as a
    run's rank builds its stages from one model); without pipelining the run's functions parallelize the model itself,
    so each use takes a copy (:meth:`copy`, cut to its first blocks where it is measured by depth). ``alike`` says
    whether the model's blocks are alike (see the module docstring), once."""

    module: nn.Module | Callable[[], nn.Module]
    precision: str
    _root: nn.Module | None = None
    _alike: bool | None = None
    _copy_refused: bool = False

    def root(self) -> nn.Module:
        """The one build, never parallelized."""
        if self._root is None:
            self._root = _build(self.module, self.precision)
        return self._root

    def copy(self, first_blocks: list[str] | None = None) -> nn.Module:
        """A copy of the one build, to parallelize, cut to ``first_blocks`` of its trunk's blocks (in order) where
        given: a deep copy that never copies the other blocks (a model cut to 3 of its 80 blocks costs 3 blocks, not
        a build of 80), under the caller's fake mode (:func:`~lightning_par3d.utils.torch_private.
        deepcopy_with_fake_tensors`). A model that cannot be deep-copied (it holds something that refuses) is built
        anew."""
        root = self.root()
        trunk_name = declared_pipeline(root).trunk if first_blocks is not None else ""
        parts = find_trunk_parts(getattr(root, trunk_name)) if first_blocks is not None else None
        if not self._copy_refused:
            memo: dict[int, Any] = {}
            if parts is not None:
                container = getattr(root, trunk_name).get_submodule(parts.container)
                for block in parts.blocks[len(first_blocks or ()) :]:
                    memo[id(container.get_submodule(block.rsplit(".", 1)[1]))] = None  # None in the copy: removed
            try:
                copied = deepcopy_with_fake_tensors(root, memo)
            except (RuntimeError, TypeError):
                self._copy_refused = True
        if self._copy_refused:
            copied = _build(self.module, self.precision)
        if parts is not None:
            assert first_blocks is not None and list(parts.blocks[: len(first_blocks)]) == first_blocks
            cut = getattr(copied, trunk_name).get_submodule(parts.container)
            if parts.keep_indices:  # a ModuleList shortened (its blocks keep their indices) ...
                del cut[len(first_blocks) :]
            else:  # ... a ModuleDict without the other keys
                for block in parts.blocks[len(first_blocks) :]:
                    delattr(cut, block.rsplit(".", 1)[1])
        return copied

    def alike(self, trunk: nn.Module, blocks: list[str]) -> bool:
        if self._alike is None:
            signatures = {block_signature(trunk.get_submodule(name)) for name in blocks}
            self._alike = len(signatures) == 1
        return self._alike


_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
"""A block's own index (transformers' attention keeps ``layer_idx`` for its KV cache): not part of what it saves."""


def block_signature(block: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks save and hold the same: classes, tensors' shapes, dtypes and trainability, and every
    plain setting of every submodule but its index."""
    modules = tuple((name, type(sub).__qualname__) for name, sub in block.named_modules())
    tensors = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers())
    settings = tuple(
        (name, key, value)
        for name, sub in block.named_modules()
        for key, value in sorted(vars(sub).items())
        if not key.startswith("_")
        and key != "training"
        and key not in _INDEX_ATTRIBUTES
        and isinstance(value, (bool, int, float, str, type(None)))
    )
    return modules, tensors, buffers, settings


class SharedMeasures:
    """Measures by depth (a role's stage of one and two blocks) shared between the estimates of one model, batch
    and precision: the planner's many layouts. A measure depends on the tensor-parallel plan and degree, the
    experts' split, sequence parallelism, checkpointing, the data-parallel engine, the precision and the
    microbatch, not on how many stages there are or how the data-parallel ranks are split, so layouts that differ
    only there measure a role's blocks once. (Keying on whether FSDP2 gathers in low precision alone, as the
    planner's memory classes do, changed some rejected layouts' figures by up to 0.75 GiB of 3,979: the engine and
    resharding count.) Everything else in the configuration is part of the key; the plan's
    tests compare its memory with the estimator's own, layout by layout."""

    _EXCLUDED = frozenset({"dp_replicate", "dp_shard", "dp", "zero_stage", "pp", "pipeline_schedule", "microbatches",
                           "virtual_stages", "reshard_after_forward", "timeout_s", "seed", "layout", "plan_machine",
                           "plan_device_memory", "global_batch", "measure", "plan_batch", "elastic",
                           "async_save"})  # fmt: skip
    """Settings a stage's measure by depth does not depend on (the layout's own figures stand for the ZeRO stage,
    the data-parallel engine and resharding)."""

    def __init__(self) -> None:
        self._measures: dict[tuple[Any, ...], dict[tuple[bool, bool, int], StageMeasure]] = {}
        self.structures: dict[tuple[Any, ...], tuple[list[list[str]] | None, bool]] = {}
        """The model's stage splits (the same model for every estimate), so that an estimate whose measures are all
        known builds no model at all."""
        self.fake = fake_tensor_mode()
        """One fake mode for every estimate, which the model's one build is made in."""
        self._builds: dict[tuple[int, str], _OneBuild] = {}

    def build(self, module: nn.Module | Callable[[], nn.Module], precision: str) -> _OneBuild:
        """The model's one build in ``precision``, for every estimate: each copies its stages (or the model) out of
        it and leaves it as it was (an 8B Llama takes 0.11 s to build on fake tensors, and a plan runs hundreds of
        estimates)."""
        key = (id(module), precision)
        if key not in self._builds:
            self._builds[key] = _OneBuild(module, precision)
        return self._builds[key]

    def of(self, config: Par3DConfig, layout: Layout, microbatch: list[Any], precision: str,
           loss_fn: Any) -> dict[tuple[bool, bool, int], StageMeasure]:  # fmt: skip
        """The measures by role and depth of estimates like this one (filled as they are measured)."""
        settings = tuple((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)
                         if f.name not in self._EXCLUDED)  # fmt: skip
        shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else repr(t) for t in microbatch)
        data_parallel = (layout.data_parallel, layout.zero, layout.shard_ranks > 1, layout.dp_replicate > 1)
        sizes = (layout.pp > 1, layout.tp, layout.ep, layout.shard_ranks if layout.ep > 1 else None, layout.cp)
        key = (settings, shapes, data_parallel, sizes, layout.reshard_after_forward, precision, loss_fn)
        return self._measures.setdefault(key, {})


@dataclass
class _Part:
    """Pipeline stage ``stage`` of the model (the whole model without pipelining), as a run builds it."""

    built: _OneBuild
    config: Par3DConfig
    mesh: Par3DMesh
    stage: int
    precision: str
    fake: Any
    structures: dict[tuple[Any, ...], tuple[list[list[str]] | None, bool]]
    """The stage splits found so far (:meth:`_structure`), by pipeline size, stages per rank and split points."""

    def measure_by_depth(
        self,
        carried: Any,
        microbatch: list[Any],
        loss_fn: Callable[..., Tensor] | None,
        known: dict[tuple[bool, bool, int], StageMeasure],
        plain: dict[tuple[bool, bool, int], StageMeasure],
    ) -> StageMeasure:
        """:meth:`measure`, or, where the stage's blocks are alike, the measure of its first block and first two
        blocks (``known``: by role and depth, shared by the stages of an estimate) extended to its depth. ``plain``:
        the same measures without activation checkpointing (what a checkpointed part's recompute is read from)."""
        layout = self.mesh.layout
        if self.config.activation_checkpointing == "selective" or self.config.ac_blocks:
            return self.measure(carried, microbatch, loss_fn)
        key = (layout.pp, layout.stages_per_rank, tuple(self.config.split_points))
        if key not in self.structures:
            self.structures[key] = self._structure()
        stage_blocks, alike = self.structures[key]
        if stage_blocks is None or not alike:  # no blocks declared, or unlike ones: the stage is measured whole
            return self.measure(carried, microbatch, loss_fn)
        own = stage_blocks[self.stage]
        role = (self.stage == 0, self.stage == layout.n_stages - 1)
        # Without a pipeline the model itself is cut, and the run's functions find its blocks as a container of
        # two or more alike ones (checkpointing, sequence parallelism): it is measured at two and three blocks.
        # Measured whole where that runs fewer blocks: a stage of up to 2 (a model of up to 5, whose cuts run 5).
        base = 1 if layout.pp > 1 else 2
        if layout.pp == 1 and len(own) <= 2 * base + 1:
            return self.measure(carried, microbatch, loss_fn)
        for depth in (base, base + 1) if len(own) > base + 1 else (len(own),):
            if (*role, depth) not in known:
                known[(*role, depth)] = self.measure(carried, microbatch, loss_fn, own[:depth], plain, (*role, depth))
        if len(own) <= base + 1:
            return known[(*role, len(own))]
        return known[(*role, base)].deeper(known[(*role, base + 1)], len(own), base)

    def _structure(self) -> tuple[list[list[str]] | None, bool]:
        """The blocks of each stage (of the whole model without pipelining; None where it declares none) and
        whether they are alike: the stage split of the model's one build, the same for every estimate of a pipeline
        size, stages per rank and split points (kept in :attr:`structures`)."""
        layout = self.mesh.layout
        with self.fake:  # the model is built under the fake mode, never for real
            root = self.built.root()
            if layout.pp == 1:
                blocks = _declared_blocks(root)
                if blocks is None:
                    return None, False
                stage_blocks = [blocks]
            else:
                spec = declared_pipeline(root)
                stage_blocks = build.plan_pipeline(root, spec, self.config, layout).blocks
            trunk = getattr(root, declared_pipeline(root).trunk)
            return stage_blocks, self.built.alike(trunk, [name for names in stage_blocks for name in names])

    def measure(
        self,
        carried: Any,
        microbatch: list[Any],
        loss_fn: Callable[..., Tensor] | None,
        own: list[str] | None = None,
        plain: dict[tuple[bool, bool, int], StageMeasure] | None = None,
        key: tuple[bool, bool, int] | None = None,
    ) -> StageMeasure:
        """The part's model-state shapes, and the bytes one microbatch's forward saves for backward (``own``: the
        stage cut to these of its blocks). Under full or selective checkpointing, the same part without
        checkpointing gives each block's own activations (what backward recomputes at a time): ``plain[key]``
        where an earlier estimate measured it (kept there where it was not)."""
        if self.config.activation_checkpointing not in ("full", "selective"):
            return self._measure(self.config, carried, microbatch, loss_fn, own)
        without = plain.get(key) if plain is not None and key is not None else None
        if without is None:
            unchecked = dataclasses.replace(self.config, activation_checkpointing="none")
            without = self._measure(unchecked, carried, microbatch, loss_fn, own)
            if plain is not None and key is not None:
                plain[key] = without
        measured = self._measure(self.config, carried, microbatch, loss_fn, own)
        return dataclasses.replace(measured, recompute_bytes=without.block_bytes)

    def _measure(
        self,
        config: Par3DConfig,
        carried: Any,
        microbatch: list[Any],
        loss_fn: Callable[..., Tensor] | None,
        own: list[str] | None,
    ) -> StageMeasure:
        """One build of the part under ``config``, parallelized and run; without checkpointing, each block's own
        activations are metered too (:attr:`StageMeasure.block_bytes`)."""
        meter = SavedTensorMeter()
        sizes: list[int] = []
        with self.fake:
            part, blocks, run = self._parallelized(config, carried, microbatch, loss_fn, own)
            hooks = _block_meters(blocks, meter, sizes) if config.activation_checkpointing == "none" else []
            shapes = _tp_local_shapes(part)
            frozen = [not p.requires_grad for p in part.parameters()]
            with autocast(self.precision), meter, fp32_grouped_mm_on_fake():
                output = run()
            for hook in hooks:
                hook.remove()
        detached = output.detach() if isinstance(output, Tensor) else None
        return StageMeasure(shapes, meter.peak, 0, detached, frozen, max(sizes, default=0))

    def _parallelized(
        self,
        config: Par3DConfig,
        carried: Any,
        microbatch: list[Any],
        loss_fn: Callable[..., Tensor] | None,
        own_blocks: list[str] | None = None,
    ) -> tuple[nn.Module, list[nn.Module], Callable[[], Any]]:
        """A fresh build of the part, parallelized by the run's own functions; its checkpointing blocks (found
        before FSDP2 renames their classes); and its forward on one microbatch (with the loss, on the last
        stage).

        :func:`~lightning_par3d.compose.parallelize_part` runs with the fake mode paused: FSDP2 builds
        a ``DeviceMesh`` for a parameter that is already a tp DTensor, and a mesh computes its coordinates with
        ``nonzero()``, which the fake mode refuses (its output shape depends on data). The model's tensors stay
        fake all the same: every op on them dispatches to their own fake mode."""
        layout = self.mesh.layout
        # Without pipelining, a copy of the model (cut to its first blocks where measured by depth) is parallelized.
        root = self.built.copy(own_blocks) if layout.pp == 1 else self.built.root()
        fqn_styles = build.checked_plan(root, config, layout.tp)  # the run's checks, messages and plan
        experts = build.find_experts(root, layout.ep) if layout.ep > 1 else None
        if layout.pp == 1:
            blocks = find_ac_blocks(root, config.ac_blocks)
            if layout.cp > 1:  # rank 0's slice of each row, attending to the gathered keys and values, as the run
                context = apply_context_parallel(root, build.find_blocks(root, config.fsdp_blocks), self.mesh.cp_group,
                                                 0, layout.cp, config.ignore_index)  # fmt: skip
                cut_declared_loss(root, None)
                loss_fn = context.cut_loss(loss_fn) if loss_fn is not None else None
            with fake_mode_paused():
                blocks_ = build.fsdp_blocks(root, config, layout)
                build.parallelize_part(root, self.mesh, config, self.precision, fqn_styles, blocks_, experts=experts)
            return root, blocks, _whole_step(root, microbatch, loss_fn)
        spec = declared_pipeline(root)
        plan = build.plan_pipeline(root, spec, config, layout)
        if own_blocks is not None:  # the stage cut to its first blocks (measured by depth)
            plan = dataclasses.replace(
                plan, blocks=[*plan.blocks[: self.stage], own_blocks, *plan.blocks[self.stage + 1 :]]
            )
        shards = build.sequence_shards(config, layout)
        part = build.build_stage(getattr(root, spec.trunk), plan, self.stage, layout.n_stages, shards)
        own = [part.get_submodule(name) for name in plan.blocks[self.stage]]  # as the run checkpoints them
        blocks = own if config.ac_blocks is None else find_ac_blocks(part, config.ac_blocks)
        with fake_mode_paused():
            build.parallelize_stage(
                part, plan, self.stage, self.mesh, config, self.precision, fqn_styles, spec.trunk, experts
            )
        # (a shape, not a view of another stage's output: a measure shared between estimates carries a fake tensor
        # of another estimate's fake mode)
        inputs = (
            carried
            if self.stage == 0
            else torch.empty(carried.shape, dtype=carried.dtype, device=carried.device, requires_grad=True)
        )
        last = self.stage == layout.n_stages - 1
        targets, kwargs = list(microbatch[1:]), {}
        if layout.cp > 1:  # rank 0's positions of the ids and targets, whole-row positions to every stage (the run's)
            rows, length = microbatch[0].shape[:2]
            positions = positions_of(0, layout.cp, length, microbatch[0].device)
            inputs = inputs[:, positions] if self.stage == 0 else inputs
            targets = [t[:, positions] if _along(t, length) else t for t in targets]
            kwargs = {"position_ids": torch.arange(length, device=positions.device).expand(rows, length)}

        def run() -> Any:
            output = part(inputs, **kwargs)
            if last:
                pipeline_loss_of(root, spec)(output, *targets)
            return output

        return part, blocks, run


def _along(t: Any, length: int) -> bool:
    """Whether ``t`` is a tensor along a sequence of ``length`` tokens (batch first)."""
    return isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == length


def _declared_blocks(root: nn.Module) -> list[str] | None:
    """The blocks of the pipeline trunk ``root`` declares (names within the trunk), or None where it declares none
    or its trunk has no one container of blocks: what a model without pipelining is measured by depth over."""
    try:
        trunk = getattr(root, declared_pipeline(root).trunk)
        return list(find_trunk_parts(trunk).blocks)
    except TypeError:
        return None


def _whole_step(module: nn.Module, microbatch: list[Any], loss_fn: Callable[..., Tensor] | None) -> Callable[[], Any]:
    """One forward of the whole model with its loss: the LightningModule's ``training_step``, or ``loss_fn``."""
    if loss_fn is not None:
        return lambda: loss_fn(module(microbatch[0]), *microbatch[1:])
    step = getattr(module, "training_step", None)
    if not callable(step):
        raise TypeError("estimate_memory needs loss_fn(outputs, *targets) for a module without training_step.")
    return lambda: step(tuple(microbatch), 0)


def _block_meters(blocks: list[nn.Module], meter: SavedTensorMeter, sizes: list[int]) -> list[Any]:
    """Hooks that record, per block, the bytes its forward saves for backward."""
    hooks = []
    for block in blocks:
        start: list[int] = []
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, start=start: start.append(meter.live)))
        hooks.append(block.register_forward_hook(lambda _m, _a, _o, start=start: sizes.append(meter.live - start[-1])))
    return hooks


def _tp_local_shapes(module: nn.Module) -> list[tuple[int, ...]]:
    """Each parameter's shape on tp rank 0 before data parallelism cuts it: what the ZeRO formulas take. A
    parameter FSDP2 has sharded is redistributed to its tensor-parallel placements only (a fake all-gather over its
    data-parallel mesh dimensions); the ZeRO formulas then cut it as FSDP2 does.

    An expert's weight under ep keeps its ep split too (this rank's experts), and FSDP2 shards it over the
    ``dp_shard / ep`` ranks holding the same experts along another dimension ``d``: its shape is given as
    ``(local[d] · ep, the other dims)``, whose chunks over the ``dp_shard`` ranks the formulas take are FSDP2's
    chunks of ``local[d]`` over ``dp_shard / ep`` ranks, padding included."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shapes = []
    with torch.no_grad():
        for param in module.parameters():
            local: Tensor = param
            shape: tuple[int, ...] | None = None
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                split = ("tp", "ep")
                kept = [p if name in split else Replicate() for name, p in zip(names, param.placements, strict=True)]
                if tuple(kept) != tuple(param.placements):
                    local = param.redistribute(param.device_mesh, kept)
                if "ep" in names and "expert_shard" in names:
                    ep = param.device_mesh.size(names.index("ep"))
                    fsdp = param.placements[names.index("expert_shard")]
                    d = fsdp.dim if isinstance(fsdp, Shard) else 0
                    dims = tuple(local_tensor(local).shape)
                    shape = (dims[d] * ep, *(n for i, n in enumerate(dims) if i != d))
            shapes.append(shape if shape is not None else tuple(local_tensor(local).shape))
    return shapes


def _fake_batch(batch: Any) -> list[Any]:
    """``batch`` as a list of (fake) tensors: tensors are copied as empty ones of the same shape and dtype; a shape
    ``(B, T)`` becomes integer tokens used as both inputs and targets."""
    if isinstance(batch, tuple) and all(isinstance(x, int) for x in batch):
        tokens = torch.zeros(batch, dtype=torch.long)
        return [tokens, tokens]
    items = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    return [torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, Tensor) else x for x in items]
