"""What the cost model reads from the model itself, measured once per pipeline split and tensor-parallel degree.

Two probes, both on copies of the model that hold no storage:

* :func:`stage_work` runs each pipeline stage (the whole model without pipelining), unparallelized on the meta
  device, through one forward and backward of a small batch, and counts with ``torch.utils.flop_counter.
  FlopCounterMode`` the FLOPs of forward and backward (per sample: they grow linearly with the batch), with a
  dispatch mode the aten ops each runs (per microbatch: they do not grow with it), per checkpointable block the
  forward's FLOPs and ops (what activation checkpointing recomputes) and the bytes of the keys and values its
  attention reads (what context parallelism gathers: each head once, as
  :func:`~lightning_par3d.parallel.context_parallel.unrepeated` gives them), and, for every module the
  tensor-parallel plan names, the bytes of its input and output (which size its collectives:
  :data:`STYLE_COLLECTIVES`);
* :func:`stage_params` splits the model as a run does and applies the run's tensor-parallel plan
  (:func:`~lightning_par3d.compose.parallelize_part`, the function a run and the memory estimator
  call) over torch's fake process group, and reads each parameter's shape on tensor-parallel rank 0 (what the ZeRO
  formulas and the data-parallel collectives take), grouped into FSDP2's units (each block, then the rest).

Problems that belong to the model (a tp that does not divide the heads, more stages than blocks) raise the
``ValueError`` that par3d's own checks raise, with their message.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.config.tp_vocabulary import canonical
from lightning_par3d.parallel.context_parallel import kv_ratio_of
from lightning_par3d.utils.patterns import find_transformers_model
from lightning_par3d.utils.torch_private import fp32_grouped_mm_on_fake

PROBE_BATCH = 2
"""Samples per probe run; FLOPs and bytes are divided by it (per sample)."""

STYLE_COLLECTIVES: dict[str, tuple[tuple[str, str, str], ...]] = {
    # style: ((phase, collective, which activation sizes it), ...)
    "colwise": (("backward", "all_reduce", "input"),),
    "packed_colwise": (("backward", "all_reduce", "input"),),
    "rowwise": (("forward", "all_reduce", "output"),),
    "packed_rowwise": (("forward", "all_reduce", "output"),),
    "colwise_gather_output": (("forward", "all_gather", "output"), ("backward", "all_reduce", "input")),
    "rowwise_split_input": (("forward", "all_reduce", "output"), ("backward", "all_gather", "input")),
    "embedding_rowwise": (("forward", "all_reduce", "output"),),
    "embedding_colwise": (("forward", "all_gather", "output"),),
    "all_reduce": (("forward", "all_reduce", "output"),),
    "rowwise_seq": (("forward", "reduce_scatter", "output"), ("backward", "all_gather", "output")),
    "colwise_seq": (("forward", "all_gather", "input"), ("backward", "reduce_scatter", "input")),
    "colwise_seq_gather_output": (
        ("forward", "all_gather", "input"),
        ("forward", "all_gather", "output"),
        ("backward", "reduce_scatter", "input"),
    ),
    "gather_sequence": (("forward", "all_gather", "input"), ("backward", "reduce_scatter", "input")),
    "sequence_shard": (("backward", "all_gather", "input"),),
    "replicated_with_grad_allreduce": (("step", "all_reduce", "params"),),
    "sequence_parallel": (),
    "local_params": (),
    "moe_tp_experts": (("forward", "all_reduce", "output"), ("backward", "all_reduce", "input")),
    "replicate": (),
}
"""The tensor-parallel collectives each style issues per microbatch, from the semantics of torch's styles:

* ``colwise`` (``ColwiseParallel``): the input is replicated, so its gradient comes back as partial sums on each
  rank: one all-reduce of the input's bytes in backward; the output stays sharded (no forward collective);
* ``rowwise`` (``RowwiseParallel``; on an embedding, vocabulary-sharded): each rank's output is a partial sum: one
  all-reduce of the output's bytes in forward; the input gradient stays sharded;
* ``colwise_gather_output``: colwise, then an all-gather of the output (the gathered output's bytes) in forward;
* ``rowwise_split_input``: rowwise, and the input gradient all-gathered back to replicated in backward;
* ``embedding_colwise``: an all-gather of the output in forward;
* ``rowwise_seq`` / ``colwise_seq``: a reduce-scatter into (an all-gather out of) sequence shards in forward, and the
  opposite in backward;
* ``gather_sequence``: as ``colwise_seq``'s input side; ``colwise_seq_gather_output``: that, and the output
  all-gathered as ``colwise_gather_output``'s; ``sequence_shard``: no forward collective, the gradient all-gathered;
* ``replicated_with_grad_allreduce``: one all-reduce of the module's parameter gradients per step;
* ``moe_tp_experts``: the experts' partial outputs all-reduced in forward, the tokens' gradient in backward (the
  routing weights' too, ``top_k`` values a token, left out);
* ``sequence_parallel``, ``local_params``, ``replicate``: none of their own.

A style not listed costs one all-reduce of its output in forward and one of its input in backward."""
_UNKNOWN_STYLE = (("forward", "all_reduce", "output"), ("backward", "all_reduce", "input"))


@dataclass(frozen=True)
class TPCollective:
    """One tensor-parallel collective a planned module issues per microbatch (``phase`` ``"step"``: per step)."""

    module: str
    style: str
    phase: str
    kind: str
    bytes_per_sample: float
    """Bytes of the activation it moves, per sample, at the element size of the model's activations as built
    (scaled to the run's compute dtype by the cost model); for ``phase == "step"``, the parameter bytes."""
    block: int | None
    """The index (in :attr:`StageWork.block_forward_flops`) of the checkpointable block that holds the module."""


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage's work (the whole model without pipelining), unparallelized."""

    index: int
    forward_flops: float
    """Per sample."""
    backward_flops: float
    """Per sample."""
    forward_ops: int
    """Aten ops of one microbatch's forward (any size)."""
    backward_ops: int
    block_forward_flops: tuple[float, ...]
    """Per checkpointable block, per sample (what full checkpointing recomputes)."""
    block_forward_ops: tuple[int, ...]
    block_cheap_ops: tuple[int, ...]
    """Per block, the forward's ops without FLOPs (what op-level checkpointing recomputes: it keeps matmul outputs)."""
    tp: tuple[TPCollective, ...]
    output_bytes_per_sample: float
    """What the stage sends to the next one per sample (its output), at the element size as built."""
    activation_element_bytes: int
    """The element size of the activations as built (the cost model rescales to the run's compute dtype)."""
    first_block: int = 0
    """The position of the stage's first block among the whole model's (``selective`` counts from the model's
    first block, at every number of stages)."""
    block_kv_bytes: tuple[float, ...] = ()
    """Per block, per sample: the keys and values its attention reads over the whole sequence, at the element size
    as built (under ``cp > 1``, what each block's all-gathers return)."""
    block_routed_bytes: tuple[float, ...] = ()
    """Per block, per sample: the token rows its experts receive, one per (token, choice) pair, at the element size
    as built (under ``ep > 1``, what each all-to-all of the dispatch, and of the combine, sends)."""


@dataclass(frozen=True)
class StageParams:
    """One stage's parameters on tensor-parallel rank 0, before data parallelism cuts them."""

    index: int
    shapes: tuple[tuple[int, ...], ...]
    units: tuple[int, ...]
    """Elements per FSDP2 unit: each block FSDP2 would wrap, then the stage's root (everything else)."""
    tensors: int
    frozen: tuple[bool, ...] = ()
    """Per shape: a frozen parameter (``requires_grad=False``: no gradient, no optimizer state); empty: none."""
    trained_units: tuple[int, ...] | None = None
    """The trained elements of each unit (what its gradient collectives move); None: every element."""
    expert_units: tuple[tuple[int, int], ...] = ()
    """Per unit, its elements that are experts (a mixture-of-experts model's, which ``ep > 1`` splits) and those of
    them that train; empty: none."""

    @property
    def elements(self) -> int:
        return sum(self.units)

    @property
    def gradient_units(self) -> tuple[int, ...]:
        """Elements per unit that have gradients."""
        return self.units if self.trained_units is None else self.trained_units

    @property
    def trained_tensors(self) -> int:
        return self.tensors - sum(self.frozen)


# ---------------------------------------------------------------- building copies


def build_meta(module: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A fresh copy of the model on the meta device: a LightningModule deep-copied (before ``configure_model``)
    and configured, or the factory called."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(module, nn.Module):
            built = copy.deepcopy(module)
            configure = getattr(built, "configure_model", None)
            with torch.device("meta"):
                if callable(configure):
                    configure()
            return built.to("meta")
        with torch.device("meta"):
            return module()


def probe_layout(pp: int, stages_per_rank: int, tp: int = 1, schedule: str | None = None) -> Layout:
    """A layout with these pipeline and tensor-parallel sizes and no data parallelism (what a stage's shapes and
    work depend on)."""
    from lightning_par3d.config.schedules import LOOP_SCHEDULES, SINGLE_STAGE_SCHEDULES

    if schedule is None:
        schedule = SINGLE_STAGE_SCHEDULES[1] if stages_per_rank == 1 else LOOP_SCHEDULES[0]
    return Layout(pp=pp, dp_replicate=1, dp_shard=1, tp=tp, schedule=schedule, virtual_stages=stages_per_rank)


@dataclass
class _Parts:
    """The model split as a run splits it: the root, and per stage the module and its forward."""

    root: nn.Module
    stages: list[nn.Module]
    trunk_attr: str | None
    blocks: list[list[nn.Module]]
    """Per stage, the modules FSDP2 wraps one by one (the stage's blocks)."""


def split(module: nn.Module | Callable[[], nn.Module], config: Par3DConfig, layout: Layout) -> _Parts:
    """The model on meta, split into ``layout``'s stages by the run's own functions (the whole model for pp=1)."""
    from lightning_par3d import compose as build
    from lightning_par3d.parallel.data_parallel import find_blocks
    from lightning_par3d.pipeline.trunk import declared_pipeline

    root = build_meta(module)
    if layout.pp == 1:
        return _Parts(root, [root], None, [find_blocks(root, config.fsdp_blocks)])
    spec = declared_pipeline(root)
    plan = build.plan_pipeline(root, spec, config, layout)
    trunk = getattr(root, spec.trunk)
    stages = [build.build_stage(trunk, plan, s, layout.n_stages) for s in range(layout.n_stages)]
    blocks = [[stage.get_submodule(name) for name in plan.blocks[s]] for s, stage in enumerate(stages)]
    return _Parts(root, stages, spec.trunk, blocks)


def _split_plan(module: nn.Module | Callable[[], nn.Module], config: Par3DConfig, layout: Layout) -> Any:
    """The model on meta and ``layout``'s stage split (pp > 1), no stage built: (root, trunk, plan)."""
    from lightning_par3d import compose as build
    from lightning_par3d.pipeline.trunk import declared_pipeline

    root = build_meta(module)
    spec = declared_pipeline(root)
    return root, spec.trunk, build.plan_pipeline(root, spec, config, layout)


def plan_styles(root: nn.Module, config: Par3DConfig) -> dict[str, str]:
    """The tensor-parallel plan over the whole model (full module names → style), without the divisibility check
    (what each style costs does not depend on tp)."""
    from lightning_par3d.parallel.sequence_parallel import sequence_parallel_plan
    from lightning_par3d.parallel.tensor_parallel import expand_plan, find_plan, plan_tied_weights

    plan = find_plan(root, config.tp_plan)
    styles = plan_tied_weights(root, expand_plan(root, plan)) if plan else {}
    return sequence_parallel_plan(root, styles) if styles and config.sequence_parallel else styles


# ---------------------------------------------------------------- counting work


class _OpCounter(TorchDispatchMode):
    """Counts aten ops, and those without FLOPs (as ``FlopCounterMode`` counts none for them)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.flop_ops = set(flop_registry)
        self.ops = 0
        self.cheap = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if func._overloadpacket not in self.flop_ops:
            self.cheap += 1
        return func(*args, **(kwargs or {}))


class _AttentionBytes(TorchFunctionMode):
    """Adds up the keys and values each ``scaled_dot_product_attention`` call reads (each key/value head once)."""

    def __init__(self, kv_ratio: int) -> None:
        super().__init__()
        self.kv_ratio, self.bytes = kv_ratio, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            from lightning_par3d.parallel.context_parallel import unrepeated

            query, key, value = (*args, None, None, None)[:3]
            key, value = kwargs.get("key", key), kwargs.get("value", value)
            query = kwargs.get("query", query)
            if all(isinstance(t, Tensor) for t in (query, key, value)):
                self.bytes += sum(_bytes(t) for t in unrepeated(query, key, value, self.kv_ratio))
        return func(*args, **kwargs)


class _RoutedBytes:
    """Adds up the token rows the modules of experts receive: ``forward(hidden_states, top_k_index, ...)``."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.bytes = 0
        self._hooks = [m.register_forward_pre_hook(self._count) for m in modules]

    def _count(self, _m: nn.Module, args: Any) -> None:
        hidden, index = (*args, None, None)[:2]
        if isinstance(hidden, Tensor) and isinstance(index, Tensor):
            rows = hidden.reshape(-1, hidden.shape[-1])
            self.bytes += rows.shape[0] * index.shape[-1] * rows.shape[1] * rows.element_size()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _expert_modules(root: nn.Module, part: nn.Module) -> list[nn.Module]:
    """The modules of experts in ``part`` (a stage of ``root``), as expert parallelism finds them; none for a model
    without an expert-parallel plan."""
    from lightning_par3d.parallel.expert_parallel import DISPATCH_STYLE, expert_plan, find_experts

    if DISPATCH_STYLE not in expert_plan(root).values():
        return []
    try:
        return find_experts(root, 1).modules_in(part)
    except ValueError:
        return []


def count_ops(run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()``'s result and the aten ops it dispatched."""
    counter = _OpCounter()
    with counter:
        result = run()
    return result, counter.ops


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        yield


ProbedByDepth = dict[tuple[bool, bool, int], tuple["StageWork", list[str], Any]]
"""A pipelined model's stages measured by role (first, last) and depth (one block, two): the work, the stage's block
names and its output (what the next stage takes), shared by the probes of every pipeline split of one model, sequence
length and configuration (the planner keeps one per plan)."""


def stage_work(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    layout: Layout,
    seq_len: int,
    loss_fn: Callable[..., Tensor] | None = None,
    by_depth: ProbedByDepth | None = None,
) -> list[StageWork]:
    """Each stage's FLOPs, ops, per-block recompute and tensor-parallel collectives; see the module docstring.

    ``by_depth`` (the planner's, one per model): where the pipelined model's blocks are alike, a stage of ``k``
    blocks is probed as the stage of its role (the first, a middle one, the last) with one and with two blocks,
    kept in ``by_depth`` for every split, and extended to ``k`` blocks (:func:`_deeper`): a block's work is its own,
    as the memory estimator's stages are measured by depth. The tests compare it with the whole stage's probe."""
    from lightning_par3d.parallel.activation_checkpoint import find_ac_blocks

    if by_depth is not None and layout.pp > 1 and config.ac_blocks is None:
        root, trunk_attr, plan = _split_plan(module, config, layout)
        if _alike_blocks(getattr(root, trunk_attr), [name for names in plan.blocks for name in names]):
            return _stage_work_by_depth(root, trunk_attr, plan, config, seq_len, loss_fn, by_depth)

    parts = split(module, config, layout)
    styles = plan_styles(parts.root, config)
    tokens = torch.zeros(PROBE_BATCH, seq_len, dtype=torch.long, device="meta")
    carried: Any = tokens
    works = []
    for s, part in enumerate(parts.stages):
        # A stage's own blocks, as the run checkpoints them (a single one included); the whole model's are found
        own = config.ac_blocks is None and parts.trunk_attr is not None
        blocks = parts.blocks[s] if own else find_ac_blocks(part, config.ac_blocks)
        first_block = sum(len(b) for b in parts.blocks[:s]) if own else 0
        work, output = _probe_stage(parts, s, part, blocks, styles, carried, tokens, loss_fn, first_block)
        works.append(work)
        carried = output.detach() if isinstance(output, Tensor) else carried
    return works


def _alike_blocks(trunk: nn.Module, names: list[str]) -> bool:
    from lightning_par3d.memory.stage_measure import block_signature

    return len({block_signature(trunk.get_submodule(name)) for name in names}) == 1


def _stage_work_by_depth(
    root: nn.Module,
    trunk_attr: str,
    plan: Any,
    config: Par3DConfig,
    seq_len: int,
    loss_fn: Callable[..., Tensor] | None,
    by_depth: ProbedByDepth,
) -> list[StageWork]:
    """:func:`stage_work` of a pipelined model of alike blocks, each stage from its role's probes at one and two
    blocks (``by_depth``, probed where missing)."""
    from lightning_par3d import compose as build

    styles = plan_styles(root, config)
    tokens = torch.zeros(PROBE_BATCH, seq_len, dtype=torch.long, device="meta")
    trunk, n_stages = getattr(root, trunk_attr), len(plan.blocks)
    carried: Any = tokens
    works = []
    for s, names in enumerate(plan.blocks):
        role = (s == 0, s == n_stages - 1)
        for depth in (1, 2) if len(names) > 1 else (1,):
            if (*role, depth) not in by_depth:
                cut = dataclasses.replace(plan, blocks=[*plan.blocks[:s], names[:depth], *plan.blocks[s + 1 :]])
                part = build.build_stage(trunk, cut, s, n_stages)
                parts = _Parts(root, [part] * n_stages, trunk_attr, [[]] * n_stages)
                blocks = [part.get_submodule(name) for name in names[:depth]]
                work, output = _probe_stage(parts, s, part, blocks, styles, carried, tokens, loss_fn, 0)
                by_depth[(*role, depth)] = (
                    work,
                    names[:depth],
                    output.detach() if isinstance(output, Tensor) else None,
                )
        first_block = sum(len(b) for b in plan.blocks[:s])
        one, one_names, _ = by_depth[(*role, 1)]
        if len(names) == 1:
            work = _deeper(one, one, one_names, names)
        else:
            two, two_names, _ = by_depth[(*role, 2)]
            work = _deeper(one, two, two_names, names)
        works.append(dataclasses.replace(work, index=s, first_block=first_block))
        output = by_depth[(*role, min(len(names), 2))][2]
        carried = output if output is not None else carried
    return works


def _deeper(one: StageWork, two: StageWork, two_names: list[str], names: list[str]) -> StageWork:
    """The work of a stage of ``names`` (alike blocks) from its role's work with one block (``one``) and with two
    (``two``, whose blocks are ``two_names``; ``one`` itself where the stage has one block): totals grow by what the
    second block added, per-block figures repeat the second block's, and the second block's tensor-parallel
    collectives repeat under each later block's name, where they stand in the probe's order."""
    more = len(names) - 1 if two is not one else 0

    def grown(a: Any, b: Any) -> Any:
        return a + more * (b - a)

    def repeated(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        return (*a, *(b[-1:] * more)) if more else b

    def renamed(c: TPCollective, block: int) -> TPCollective:
        old = two_names[c.block] if c.block is not None else ""
        return dataclasses.replace(c, module=names[block] + c.module[len(old) :], block=block)

    tp: list[TPCollective] = []
    entries = list(two.tp)
    for i, c in enumerate(entries):
        if c.block is None:
            tp.append(c)
            continue
        tp.append(renamed(c, c.block))
        last_of_run = i + 1 == len(entries) or entries[i + 1].block != c.block
        if c.block == len(two_names) - 1 and last_of_run and more:
            run = _run_ending_at(entries, i)
            tp += [renamed(e, block) for block in range(len(two_names), len(names)) for e in run]
    base = one if two is not one else two
    return StageWork(
        index=two.index,
        forward_flops=grown(base.forward_flops, two.forward_flops),
        backward_flops=grown(base.backward_flops, two.backward_flops),
        forward_ops=grown(base.forward_ops, two.forward_ops),
        backward_ops=grown(base.backward_ops, two.backward_ops),
        block_forward_flops=repeated(base.block_forward_flops, two.block_forward_flops),
        block_forward_ops=repeated(base.block_forward_ops, two.block_forward_ops),
        block_cheap_ops=repeated(base.block_cheap_ops, two.block_cheap_ops),
        tp=tuple(tp),
        output_bytes_per_sample=two.output_bytes_per_sample,
        activation_element_bytes=two.activation_element_bytes,
        first_block=two.first_block,
        block_kv_bytes=repeated(base.block_kv_bytes, two.block_kv_bytes),
        block_routed_bytes=repeated(base.block_routed_bytes, two.block_routed_bytes),
    )


def _run_ending_at(entries: list[TPCollective], i: int) -> list[TPCollective]:
    """The consecutive entries of one block that end at ``entries[i]``."""
    start = i
    while start > 0 and entries[start - 1].block == entries[i].block:
        start -= 1
    return entries[start : i + 1]


def _probe_stage(
    parts: _Parts,
    s: int,
    part: nn.Module,
    blocks: list[nn.Module],
    styles: dict[str, str],
    carried: Any,
    tokens: Tensor,
    loss_fn: Callable[..., Tensor] | None,
    first_block: int,
) -> tuple[StageWork, Any]:
    """Stage ``s`` (``part``, whose checkpointable blocks are ``blocks``) run forward and backward on ``carried``
    (the previous stage's output, or the tokens): its work, and its output."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_par3d.compose import stage_styles

    names = styles if parts.trunk_attr is None else stage_styles(styles, part, parts.trunk_attr)
    inputs = carried if s == 0 else torch.empty_like(carried, requires_grad=True)
    run = _stage_forward(parts, s, part, inputs, tokens, loss_fn)
    sizes: dict[str, tuple[int, int]] = {}
    per_block: list[tuple[float, int, int, int, int]] = []
    forward = FlopCounterMode(display=False)
    counter = _OpCounter()
    attention = _AttentionBytes(kv_ratio_of(found[1]) if (found := find_transformers_model(parts.root)) else 1)
    routed = _RoutedBytes(_expert_modules(parts.root, part))
    hooks = _size_hooks(part, names, sizes) + _block_hooks(blocks, per_block, forward, counter, attention, routed)
    with _quiet(), forward, counter, attention, fp32_grouped_mm_on_fake():
        output, loss = run()
    for hook in hooks:
        hook.remove()
    routed.remove()
    backward = FlopCounterMode(display=False)
    back_counter = _OpCounter()
    with _quiet(), backward, back_counter, fp32_grouped_mm_on_fake():
        (loss if loss is not None else output).backward(None if loss is not None else torch.ones_like(output))
    element = output.element_size() if isinstance(output, Tensor) else 4
    work = StageWork(
        index=s,
        forward_flops=forward.get_total_flops() / PROBE_BATCH,
        backward_flops=backward.get_total_flops() / PROBE_BATCH,
        forward_ops=counter.ops,
        backward_ops=back_counter.ops,
        block_forward_flops=tuple(b[0] / PROBE_BATCH for b in per_block),
        block_forward_ops=tuple(b[1] for b in per_block),
        block_cheap_ops=tuple(b[2] for b in per_block),
        block_kv_bytes=tuple(b[3] / PROBE_BATCH for b in per_block),
        block_routed_bytes=tuple(b[4] / PROBE_BATCH for b in per_block),
        tp=_tp_collectives(part, names, sizes, blocks),
        output_bytes_per_sample=output.numel() * element / PROBE_BATCH if isinstance(output, Tensor) else 0,
        activation_element_bytes=element,
        first_block=first_block,
    )
    return work, output


def _stage_forward(
    parts: _Parts,
    s: int,
    part: nn.Module,
    inputs: Any,
    tokens: Tensor,
    loss_fn: Callable[..., Tensor] | None,
) -> Callable[[], tuple[Any, Tensor | None]]:
    """Stage ``s``'s forward on ``inputs``, with the loss on the last stage: (output, loss or None)."""
    last = s == len(parts.stages) - 1
    if parts.trunk_attr is None:
        if loss_fn is not None:

            def whole_with_loss_fn() -> tuple[Any, Tensor | None]:
                output = part(inputs)
                return output, loss_fn(output, tokens)

            return whole_with_loss_fn
        step = getattr(part, "training_step", None)
        if not callable(step):
            raise TypeError("The planner needs loss_fn(outputs, *targets) for a module without training_step.")
        return lambda: (None, step((inputs, tokens), 0))

    from lightning_par3d.pipeline.trunk import declared_pipeline, pipeline_loss_of

    loss = pipeline_loss_of(parts.root, declared_pipeline(parts.root))

    def stage() -> tuple[Any, Tensor | None]:
        output = part(inputs)
        return output, loss(output, tokens) if last else None

    return stage


def _size_hooks(part: nn.Module, names: dict[str, str], sizes: dict[str, tuple[int, int]]) -> list[Any]:
    """Hooks recording each planned module's (input bytes, output bytes)."""
    hooks = []
    for name in names:
        try:
            sub = part.get_submodule(name)
        except AttributeError:
            continue

        def record(_m: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            first = args[0] if args else kwargs.get("hidden_states")  # transformers attention: hidden_states=
            sizes[name] = (_bytes(first), _bytes(output))

        hooks.append(sub.register_forward_hook(record, with_kwargs=True))
    return hooks


def _block_hooks(
    blocks: list[nn.Module],
    per_block: list[tuple[float, int, int, int, int]],
    flops: Any,
    counter: _OpCounter,
    attention: _AttentionBytes,
    routed: _RoutedBytes,
) -> list[Any]:
    """Hooks recording each block's forward FLOPs, ops, ops without FLOPs, attention's key and value bytes and the
    token rows routed to its experts, read from the running counters."""
    hooks = []
    started: list[tuple[float, int, int, int, int]] = []  # a stack: blocks may nest

    def totals() -> tuple[float, int, int, int, int]:
        return float(flops.get_total_flops()), counter.ops, counter.cheap, attention.bytes, routed.bytes

    def before(_m: nn.Module, _a: Any) -> None:
        started.append(totals())

    def after(_m: nn.Module, _a: Any, _o: Any) -> None:
        start, end = started.pop(), totals()
        f, o, c, kv, r = (b - a for a, b in zip(start, end, strict=True))
        per_block.append((float(f), int(o), int(c), int(kv), int(r)))

    for block in blocks:
        hooks += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    return hooks


def _bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return _bytes(value[0])
    return 0


def _tp_collectives(
    part: nn.Module, names: dict[str, str], sizes: dict[str, tuple[int, int]], blocks: list[nn.Module]
) -> tuple[TPCollective, ...]:
    owner = {id(sub): b for b, block in enumerate(blocks) for sub in block.modules()}
    found = []
    for name, style in names.items():
        try:
            sub = part.get_submodule(name)
        except AttributeError:
            continue
        style = canonical(style)
        in_bytes, out_bytes = sizes.get(name, (0, 0))
        params = sum(p.numel() * p.element_size() for p in sub.parameters())
        for phase, kind, what in STYLE_COLLECTIVES.get(style, _UNKNOWN_STYLE):
            size = {"input": in_bytes / PROBE_BATCH, "output": out_bytes / PROBE_BATCH, "params": params}[what]
            found.append(TPCollective(name, style, phase, kind, float(size), owner.get(id(sub))))
    return tuple(found)


# ---------------------------------------------------------------- parameter shapes


def stage_params(
    module: nn.Module | Callable[[], nn.Module], config: Par3DConfig, layout: Layout, precision: str
) -> list[StageParams]:
    """Each stage's parameter shapes on tensor-parallel rank 0 and its FSDP2 units (see the module docstring)."""
    from lightning_par3d import compose as build
    from lightning_par3d.distributed.fakeworld import fake_world
    from lightning_par3d.distributed.groups import fake_group
    from lightning_par3d.distributed.mesh import Par3DMesh
    from lightning_par3d.parallel.tensor_parallel import local_tensor

    plain = dataclasses.replace(config, activation_checkpointing="none")
    parts = split(module, plain, layout)
    if layout.tp > 1:
        fqn_styles = build.checked_plan(parts.root, plain, layout.tp)
        tp_layout = Layout(pp=1, dp_replicate=1, dp_shard=1, tp=layout.tp)
        with fake_world(layout.tp), _quiet():
            mesh = Par3DMesh.build(tp_layout, "cpu", fake_group)
            for part in parts.stages:
                styles = (
                    fqn_styles if parts.trunk_attr is None else build.stage_styles(fqn_styles, part, parts.trunk_attr)
                )
                build.parallelize_part(part, mesh, plain, precision, styles, [])
    result = []
    for s, part in enumerate(parts.stages):
        params = list(part.parameters())
        shapes = tuple(tuple(local_tensor(p).shape) for p in params)
        frozen = tuple(not p.requires_grad for p in params)
        experts = {id(p) for m in _expert_modules(parts.root, part) for p in m.parameters()}
        seen: set[int] = set()
        units, trained, expert_units = [], [], []
        for group in [*(block.parameters() for block in parts.blocks[s]), iter(params)]:
            members = [p for p in group if id(p) not in seen]
            expert_units.append(_elements(iter(p for p in members if id(p) in experts), set()))
            elements, with_grads = _elements(iter(members), seen)
            units.append(elements)
            trained.append(with_grads)
        trained_units = tuple(trained) if any(frozen) else None
        found = tuple(expert_units) if any(e for e, _ in expert_units) else ()
        result.append(StageParams(s, shapes, tuple(units), len(params), frozen, trained_units, found))
    return result


def _elements(params: Iterator[Tensor], seen: set[int]) -> tuple[int, int]:
    """The elements of the parameters not seen yet, and those of them that train."""
    from lightning_par3d.parallel.tensor_parallel import local_tensor

    total = trained = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += local_tensor(p).numel()
            trained += local_tensor(p).numel() if p.requires_grad else 0
    return total, trained
