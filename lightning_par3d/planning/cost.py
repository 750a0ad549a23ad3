"""The cost model: a layout's predicted step time, split into compute, tensor-parallel communication,
data-parallel communication and the pipeline bubble.

Notation: ``b`` samples per microbatch (the per-rank batch over ``m`` microbatches; ``m = 1`` without pipelining), ``t =
tp``, ``c = cp``, ``N = dp_shard × cp`` (the ranks FSDP2 shards over), ``R = dp_replicate``, ``F`` the machine's matmul
FLOP/s for the precision, ``o`` its time per aten op, and per link ``α`` (latency per ring step) and ``β`` (bytes/s per
device, each way).

**Collectives** (ring algorithms over ``n`` ranks; ``S`` bytes is the whole tensor: the reduced tensor, the gathered
output, the scattered input)::

    all_reduce(S, n)     = 2(n−1)·α + 2(n−1)/n · S/β
    all_gather(S, n)     =  (n−1)·α +  (n−1)/n · S/β
    reduce_scatter(S, n) = ρ · all_gather(S, n)
    send(S)              =        α +            S/β

``ρ`` is 1 for NCCL (its reduce-scatter runs as its all-gather does); a calibration measures it: gloo's
reduce-scatter on CPU cores costs several all-gathers, which is what makes ZeRO-2 and FSDP2 slower there than the
ring formulas say.

A group uses the link *across* nodes when any of its groups holds ranks of two nodes (the mesh is row-major,
``tp`` innermost, ``devices_per_node`` ranks per node), else the link within a node.

**Compute**, per stage and microbatch, from the probe (:mod:`lightning_par3d.planning.probe`): with ``φ`` the stage's
FLOPs per sample and ``k`` its aten ops per microbatch, ``time(φ, k) = φ·b/(t·c) / F + k·o`` (on a GPU, where the CPU's
work per op overlaps the kernels: ``max(φ·b/(t·c) / F, k·o)``). Under context parallelism each rank holds ``1/c`` of
every row's tokens and attends its queries to all keys, so every FLOP count divides by ``c``. Forward and backward each
so. Activation checkpointing adds, in backward, each checkpointed block's forward (``full``: every block; ``selective``:
every ``ac_every``-th; ``op``: only the block's ops without FLOPs, as op-level checkpointing keeps matmul outputs) and,
for ``full`` and ``selective``, the block's forward tensor-parallel collectives again.

**Tensor parallelism**, per microbatch: for each module of the plan, the collectives its style issues
(:data:`~lightning_par3d.planning.probe.STYLE_COLLECTIVES`), each over the ``tp`` group, sized by the module's input
or output at ``b`` samples and the run's activation dtype (2 bytes under bf16/fp16 compute, else 4); all part of the
forward or backward it belongs to (not overlapped). Each module's DTensor work counts as compute (where a profile of
the run finds it: between the collectives): the machine's measured ``tp_module_s`` (forward, backward) per module,
what a colwise and a rowwise ``Linear`` cost beyond the same layers plain (timed alone on the 2-core development
machine, 10× and 18× a DTensor op's ``d``, since the layer's own ops run on DTensors and the wrapping runs autograd
functions); on a profile, ``DTENSOR_OPS_PER_TP_MODULE`` DTensor ops in each, ``d`` seconds each.

**Context parallelism**, per microbatch: each block all-gathers its attention's keys and values over the ``cp``
group (two collectives; ``κ`` bytes per sample, the whole sequence's, from the probe, at the run's activation dtype):
``2 · all_gather(κ·b/2, c)`` in forward, ``2 · reduce_scatter(κ·b/2, c)`` in backward (the gathers' gradients), and
the gathers again in backward for a block that ``full`` or ``selective`` checkpointing recomputes. They are
collectives inside the layers, on the critical path as tensor parallelism's are, and share its bucket (``tp_comm``:
the bottleneck report measures torch's functional collectives there too).

**Expert parallelism**, per microbatch: each block whose experts ``ep`` ranks split sends its token rows (``ρ_e``
bytes per sample: one row per token and choice, from the probe) to the ranks holding their experts and back:
``2 · all_to_all(ρ_e·b, e) + (e−1)·α`` in forward (the rows there and back, after the counts per expert), the two
all-to-alls again in backward (the gradients), and the forward's again where checkpointing recomputes the block
(``all_to_all(S, n)``: an all-gather's time for a buffer of ``S`` bytes, times the link's calibrated factor). Routing
is taken as balanced, so each rank computes as much expert work as without ep. These share the ``tp_comm`` bucket
too. In the FSDP2 formulas below, a unit's experts are their own unit: ``1/e`` of their elements on the rank, sharded
over the ``N/e`` ranks that hold the same experts (``expert_shard``).

**Issuing a collective** costs its rank ``COLLECTIVE_CPU_OPS`` ops of CPU time (the call, copies into and out of the
communication buffer, the wait), ``COLLECTIVE_CPU_OPS · o``, which nothing overlaps; every tensor- and data-parallel
collective pays it, in its own bucket (a pipeline send, in the transfer time).

**Data parallelism**, per step, on each rank's parameters (``P`` elements after pp and tp; ``p``, ``g`` the
parameter and gradient element sizes; buckets of 25 MiB as par3d's DDP and ZeRO buckets):

* DDP: ``Σ_buckets all_reduce(bucket of P·g, R)``;
* ZeRO-1 (ZeRO-1/2 without cp only): ``Σ all_reduce(P·g, R·N)`` + ``Σ all_gather(P·p, N)`` (the parameters after
  the sharded step);
* ZeRO-2: ``Σ reduce_scatter(P·g, N)`` + ``Σ all_reduce(P·g/N, R)`` + ``Σ all_gather(P·p, N)``;
* FSDP2 (ZeRO-3), per unit ``u`` (each block, then the root) of ``P_u`` elements: ``a_u · all_gather(P_u·p', N)``
  + ``reduce_scatter(P_u·g', N)`` + ``all_reduce(P_u·g'/N, R)``, where ``p'`` is the gathering dtype (2 bytes under
  ``-mixed``), ``g'`` the reduction dtype (fp32 under ``-mixed``), and ``a_u`` the gathers per step: 2 (forward,
  and backward after resharding) for a block without pp, 1 for the root and for every unit under pp (parameters
  stay gathered across the microbatches), ``2·m`` under pp with ``reshard_after_forward=True``;
* replication under tp or pp (FSDP2 with a shard of 1): ``all_reduce(P·g, R)``.

A frozen parameter (``requires_grad=False``: a LoRA fine-tune's base) has no gradient: the reductions above move the
trained elements only (``P_u`` of a unit's reduce-scatter counts its trained elements), FSDP2 still gathers it, and
DDP and ZeRO-1/2, which handle the optimizer's parameters only, neither reduce nor gather it.

Where the machine overlaps communication with compute (NCCL's streams), only ``max(comm − compute, longest single
collective)`` is exposed; otherwise (gloo on CPU cores) all of it.

**Pipeline**: every rank runs torch's own action order (:mod:`lightning_par3d.planning.schedule_timing`) with each
``F`` its stage's forward (compute + tp), each ``B`` its backward, ``I`` and ``W`` half a backward each, the ``I``
plus the split's own work (``k_b · σ``: the stage's backward ops at the machine's measured ``split_backward_op_s``,
torch walking the autograd graph to split it; CPU work, so on a GPU only what outlasts the kernels), every action
plus the machine's measured ``pipeline_action_s`` (the schedule's own bookkeeping), and each hop between ranks
``send(stage output at b samples)``. The simulation gives when each rank's last action ends.

**Optimizer**: ``E`` trained elements stepped on the rank (``P``, or ``P/N`` under ZeRO ≥ 1) read and written once:
``E·(2p + g + 2·s·K)/memory_bandwidth + 10·tensors·o`` (``K`` state tensors per element, Adam's 2 of ``s`` = 4 bytes),
with ``d`` instead of ``o`` where the parameters are DTensors (FSDP2's shards, tensor parallelism).

**Step** of pipeline rank ``r``: ``end_r + dp_r + optimizer_r`` (+ per-step tp reductions); the step is the largest.
Its buckets are those of that rank: compute (forward, backward, recompute, optimizer), tp communication,
data-parallel communication, and the bubble: what remains, the rank's waiting inside the pipeline.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.distributed.locality import spans_nodes
from lightning_par3d.parallel.precision import element_bytes
from lightning_par3d.planning.machine import Link, Machine
from lightning_par3d.planning.probe import StageParams, StageWork

BUCKET_BYTES = 25 * 2**20
"""par3d's (and DDP's) gradient bucket."""
OPTIMIZER_OPS_PER_TENSOR = 10
"""Aten ops an element-wise optimizer (AdamW) runs per parameter tensor on the per-tensor path."""
COLLECTIVE_CPU_OPS = 4
"""CPU work of issuing one collective, in ops: the call, the copies into and out of its buffer, the wait."""
DTENSOR_OPS_PER_TP_MODULE = 2
"""DTensor ops a tensor-parallel module runs around its computation, in forward (and again in backward): the input
wrapped (or redistributed), the output redistributed (or unwrapped)."""
INPUT_GRAD_SHARE = 0.5
"""Share of a backward that computes the input gradient (``I``) in the zero-bubble schedules; the weight
gradient (``W``) is the rest (a linear layer's two gradient matmuls cost the same)."""
OPTIMIZER_STATE_TENSORS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}


BUCKETS = ("compute", "tp_comm", "dp_comm", "bubble")
"""A predicted step's buckets, in :class:`StepTime`'s order."""


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds, split into buckets that add up to :attr:`total`."""

    compute: float
    tp_comm: float
    dp_comm: float
    bubble: float
    critical_pp_rank: int = 0
    """The pipeline rank whose step is the longest (the buckets are its own)."""
    pp_ranks: tuple[tuple[float, float, float, float], ...] = ()
    """Every pipeline rank's (compute, tp_comm, dp_comm, bubble), in pipeline order."""
    actions: tuple[int, ...] = ()
    """Every pipeline rank's compute actions per step in torch's schedule order (F, B, I, W; none without pp)."""
    split: tuple[float, ...] = ()
    """Every pipeline rank's share of its compute that splits backwards into ``I`` and ``W`` (zero-bubble
    schedules; none otherwise): Python walking the autograd graph, which the bottleneck report's advice keeps apart
    from the corrections it learns for the ops."""

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.dp_comm + self.bubble


# ---------------------------------------------------------------- collectives


def all_reduce(size: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``size`` bytes over ``n`` ranks."""
    if n <= 1 or size <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * size / link.bandwidth


def all_gather(size: float, n: int, link: Link) -> float:
    """Ring all-gather of ``size`` bytes in all (the gathered output) over ``n`` ranks."""
    if n <= 1 or size <= 0:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * size / link.bandwidth


def reduce_scatter(size: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of a ``size``-byte input over ``n`` ranks: an all-gather's time, times the link's
    measured :attr:`~lightning_par3d.planning.machine.Link.reduce_scatter_factor` (1 on NCCL's profiles)."""
    return link.reduce_scatter_factor * all_gather(size, n, link)


def all_to_all(size: float, n: int, link: Link) -> float:
    """An all-to-all of a ``size``-byte buffer per rank over ``n`` ranks (``(n−1)/n`` of it leaves each rank): an
    all-gather's time, times the link's measured :attr:`~lightning_par3d.planning.machine.Link.all_to_all_factor`."""
    return link.all_to_all_factor * all_gather(size, n, link)


def send(size: float, link: Link) -> float:
    """A point-to-point transfer of ``size`` bytes."""
    return link.latency_s + size / link.bandwidth if size > 0 else 0.0


COLLECTIVES = {
    "all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_to_all": all_to_all,
}  # fmt: skip


def buckets(size: float, cap: float = BUCKET_BYTES) -> list[float]:
    """``size`` bytes in buckets of at most ``cap``."""
    if size <= 0:
        return []
    full, rest = divmod(size, cap)
    return [cap] * int(full) + ([rest] if rest else [])


def bucketed(kind: str, size: float, n: int, link: Link) -> list[float]:
    """The time of each bucket's collective."""
    return [COLLECTIVES[kind](part, n, link) for part in buckets(size)] if n > 1 else []


# ---------------------------------------------------------------- which link a group uses


def group_link(layout: Layout, group: str, machine: Machine, devices_per_node: int) -> Link:
    """The link ``group``'s collectives run over."""
    crossing = spans_nodes(layout.shape, group, devices_per_node, layout.cp, layout.ep)
    return machine.inter_node if crossing else machine.intra_node


# ---------------------------------------------------------------- compute and tensor parallelism per stage


@dataclass(frozen=True)
class StageCost:
    """One stage's time per microbatch: compute and tp communication, forward and backward (recompute included)."""

    forward_compute: float
    forward_tp: float
    backward_compute: float
    backward_tp: float
    step_tp: float
    """Per-step tensor-parallel reductions (``replicated_with_grad_allreduce`` gradients)."""
    split_backward: float = 0.0
    """What splitting the backward into ``I`` and ``W`` adds (torch's zero-bubble schedules), on the ``I``."""

    @property
    def forward(self) -> float:
        return self.forward_compute + self.forward_tp

    @property
    def backward(self) -> float:
        return self.backward_compute + self.backward_tp


def _compute(flops: float, ops: int, machine: Machine, throughput: float, cpu_s: float = 0.0) -> float:
    """``flops`` of arithmetic and ``ops`` aten ops (plus ``cpu_s`` of other CPU work): see the module docstring."""
    arithmetic, overhead = flops / throughput, ops * machine.op_overhead_s + cpu_s
    return max(arithmetic, overhead) if machine.async_kernels else arithmetic + overhead


def recomputed_blocks(config: Par3DConfig, blocks: int, first_block: int = 0) -> list[int]:
    """The blocks activation checkpointing recomputes in backward (indices among the stage's ``blocks``, the first
    of which is the model's ``first_block``-th: ``selective`` takes every ``ac_every``-th of the whole model's)."""
    if config.activation_checkpointing in ("full", "op"):
        return list(range(blocks))
    if config.activation_checkpointing == "selective":
        return [b for b in range(blocks) if (b + first_block) % config.ac_every == 0]
    return []


def stage_cost(
    work: StageWork,
    config: Par3DConfig,
    layout: Layout,
    samples: float,
    machine: Machine,
    precision: str,
    tp_link: Link,
    cp_link: Link | None = None,
    ep_link: Link | None = None,
) -> StageCost:
    """The stage's forward and backward for one microbatch of ``samples`` (see the module docstring)."""
    throughput, t = machine.flops_for(precision), layout.tp * layout.cp  # FLOPs split over tp and over cp
    scale = element_bytes(precision).compute / work.activation_element_bytes
    forward = _compute(work.forward_flops * samples / t, work.forward_ops, machine, throughput)
    backward = _compute(work.backward_flops * samples / t, work.backward_ops, machine, throughput)
    redo = recomputed_blocks(config, len(work.block_forward_flops), work.first_block)
    op_level = config.activation_checkpointing == "op"
    for b in redo:
        if op_level:
            backward += _compute(0.0, work.block_cheap_ops[b], machine, throughput)
        else:
            backward += _compute(
                work.block_forward_flops[b] * samples / t, work.block_forward_ops[b], machine, throughput
            )
    launch = COLLECTIVE_CPU_OPS * machine.op_overhead_s
    cp_fwd = cp_bwd = 0.0
    if layout.cp > 1:
        assert cp_link is not None
        cp_fwd, cp_bwd = _context_collectives(work, layout.cp, samples * scale, [] if op_level else redo, cp_link,
                                              launch)  # fmt: skip
    if layout.ep > 1:
        assert ep_link is not None
        ep_fwd, ep_bwd = _expert_collectives(work, layout.ep, samples * scale, [] if op_level else redo, ep_link,
                                             launch)  # fmt: skip
        cp_fwd, cp_bwd = cp_fwd + ep_fwd, cp_bwd + ep_bwd
    fwd_tp = bwd_tp = step_tp = 0.0
    if layout.tp > 1:
        modules = len({c.module for c in work.tp})
        if any(machine.tp_module_s):  # measured by the calibration
            glue = (modules * machine.tp_module_s[0], modules * machine.tp_module_s[1])
        else:
            glue = (DTENSOR_OPS_PER_TP_MODULE * modules * machine.dtensor_op_overhead_s,) * 2
        forward, backward = forward + glue[0], backward + glue[1]  # compute, as the profiler sees it
        fwd_tp, bwd_tp, step_tp = _tensor_collectives(work, layout.tp, samples * scale, [] if op_level else redo,
                                                      tp_link, launch)  # fmt: skip
    split = 0.0
    if machine.split_backward_op_s:  # the I's share of the backward is then the rest, with the same CPU work added
        splitting = work.backward_ops * machine.split_backward_op_s
        flops = work.backward_flops * samples / t
        split = _compute(flops, work.backward_ops, machine, throughput, splitting) - _compute(
            flops, work.backward_ops, machine, throughput
        )
    return StageCost(forward, fwd_tp + cp_fwd, backward, bwd_tp + cp_bwd, step_tp, split)


def _expert_collectives(
    work: StageWork, ep: int, samples: float, recomputed: list[int], link: Link, launch: float
) -> tuple[float, float]:
    """Forward and backward time of the blocks' token all-to-alls over ``ep`` ranks, for ``samples`` (at the run's
    activation dtype): see the module docstring."""
    forward = backward = 0.0
    for b, routed in enumerate(work.block_routed_bytes):
        if routed <= 0:
            continue
        counts = (ep - 1) * link.latency_s + launch  # the counts per expert first: latency alone
        exchange = 2 * (all_to_all(routed * samples, ep, link) + launch) + counts
        forward += exchange
        backward += exchange - counts  # the gradients go back the same way, by the counts already known
        if b in recomputed:
            backward += exchange
    return forward, backward


def _tensor_collectives(
    work: StageWork, tp: int, samples: float, recomputed: list[int], link: Link, launch: float
) -> tuple[float, float, float]:
    """Forward, backward and per-step time of the plan's collectives over ``tp`` ranks, for ``samples`` (at the run's
    activation dtype): see the module docstring."""
    forward = backward = step = 0.0
    for c in work.tp:
        if c.phase == "step":
            step += COLLECTIVES[c.kind](c.bytes_per_sample, tp, link) + launch
            continue
        took = COLLECTIVES[c.kind](c.bytes_per_sample * samples, tp, link) + launch
        if c.phase == "forward":
            forward += took
            if c.block is not None and c.block in recomputed:
                backward += took  # the recomputed forward issues it again
        else:
            backward += took
    return forward, backward, step


def _context_collectives(
    work: StageWork, cp: int, samples: float, recomputed: list[int], link: Link, launch: float
) -> tuple[float, float]:
    """Forward and backward time of the blocks' key and value all-gathers over ``cp`` ranks, for ``samples`` (at the
    run's activation dtype): see the module docstring."""
    forward = backward = 0.0
    for b, kv in enumerate(work.block_kv_bytes):
        if kv <= 0:
            continue
        gather = 2 * (all_gather(kv * samples / 2, cp, link) + launch)
        forward += gather
        backward += 2 * (reduce_scatter(kv * samples / 2, cp, link) + launch)
        if b in recomputed:
            backward += gather
    return forward, backward


# ---------------------------------------------------------------- data parallelism and the optimizer per rank


def _elements(params: Iterable[StageParams]) -> tuple[int, list[int], int]:
    ps = list(params)
    return sum(p.elements for p in ps), [u for p in ps for u in p.units], sum(p.tensors for p in ps)


def _trained(params: Iterable[StageParams]) -> tuple[int, list[int], int]:
    """As :func:`_elements`, of the parameters that train (a frozen base has no gradients and no optimizer state:
    DDP and ZeRO-1/2 reduce and step only the trained ones)."""
    ps = list(params)
    units = [u for p in ps for u in p.gradient_units]
    return sum(units), units, sum(p.trained_tensors for p in ps)


def data_parallel_collectives(
    layout: Layout, params: list[StageParams], precision: str, machine: Machine, devices_per_node: int
) -> list[float]:
    """Each data-parallel collective one rank of this pipeline position runs per step (seconds each)."""
    if layout.dp_cp == 1:
        return []
    trained = _trained(params)[0]
    p = g = element_bytes(precision).param
    N, R = layout.shard_ranks, layout.dp_replicate
    link = functools.partial(group_link, layout, machine=machine, devices_per_node=devices_per_node)
    engine = layout.data_parallel
    if engine == "ddp":
        return bucketed("all_reduce", trained * g, R, link("dp_replicate"))
    if engine == "zero":
        gather = bucketed("all_gather", trained * p, N, link("dp_shard"))
        if layout.zero == 1:
            return bucketed("all_reduce", trained * g, R * N, link("dp")) + gather
        scatter = bucketed("reduce_scatter", trained * g, N, link("dp_shard"))
        return scatter + bucketed("all_reduce", trained * g / N, R, link("dp_replicate")) + gather
    return _fsdp_collectives(layout, params, precision, link)


def _fsdp_collectives(layout: Layout, params: list[StageParams], precision: str, link: Any) -> list[float]:
    """FSDP2's collectives per step (see the module docstring); ``link(group)`` is the group's link."""
    from lightning_par3d.parallel.precision import fsdp_mixed_precision

    _, units, _ = _elements(params)
    trained, trained_units, _ = _trained(params)
    p = g = element_bytes(precision).param
    N, R, m = layout.shard_ranks, layout.dp_replicate, layout.microbatches if layout.pp > 1 else 1
    mixed = fsdp_mixed_precision(precision) is not None
    gather_b, reduce_b = (2 if mixed else p), (4 if mixed else g)
    if N == 1:
        return [all_reduce(trained * reduce_b, R, link("dp_replicate"))]
    experts = [e for p in params for e in (p.expert_units or ((0, 0),) * len(p.units))]
    times = []
    for i, (unit, unit_trained) in enumerate(zip(units, trained_units, strict=True)):
        root = i == len(units) - 1
        if layout.pp == 1:
            gathers = 1 if root or not layout.reshard_after_forward else 2
        else:
            gathers = 2 * m if layout.reshard_after_forward and not root else 1
        shards: list[tuple[float, float, int, str]] = [(unit, unit_trained, N, "dp_shard")]
        if layout.ep > 1:  # the experts: 1/ep of them on the rank, their own FSDP2 unit over dp_shard / ep ranks
            expert, expert_trained = experts[i]
            shards = [(unit - expert, unit_trained - expert_trained, N, "dp_shard"),
                      (expert / layout.ep, expert_trained / layout.ep, N // layout.ep, "expert_shard")]  # fmt: skip
        for elements, trained_elements, n, group in shards:
            times += [all_gather(elements * gather_b, n, link(group))] * gathers
            times.append(reduce_scatter(trained_elements * reduce_b, n, link(group)))
            if R > 1:
                times.append(all_reduce(trained_elements * reduce_b / n, R, link("dp_replicate")))
    return [t for t in times if t > 0]


def optimizer_time(
    layout: Layout, params: list[StageParams], precision: str, machine: Machine, optimizer: str
) -> float:
    """One optimizer step on the rank's trained parameters (or its ZeRO rows)."""
    elements, _, tensors = _trained(params)
    if layout.zero >= 1 and layout.shard_ranks > 1:
        elements = math.ceil(elements / layout.shard_ranks)
    p = g = element_bytes(precision).param
    state = OPTIMIZER_STATE_TENSORS.get(optimizer, 2) * 4
    streamed = elements * (2 * p + g + 2 * state) / machine.memory_bandwidth
    dtensors = layout.data_parallel == "fsdp" or layout.tp > 1
    per_op = machine.dtensor_op_overhead_s if dtensors else machine.op_overhead_s
    overhead = OPTIMIZER_OPS_PER_TENSOR * tensors * per_op
    return max(streamed, overhead) if machine.async_kernels else streamed + overhead


# ---------------------------------------------------------------- the step


def predict_step(
    config: Par3DConfig,
    layout: Layout,
    works: list[StageWork],
    params: list[StageParams],
    rank_batch: int,
    machine: Machine,
    devices_per_node: int,
    precision: str = "32-true",
    optimizer: str = "adamw",
) -> StepTime:
    """The predicted step of ``layout`` (see the module docstring for every formula)."""
    from lightning_par3d.pipeline.actions import pipeline_actions
    from lightning_par3d.planning.schedule_timing import simulate

    m = layout.microbatches if layout.pp > 1 else 1
    samples = rank_batch / m
    tp_link = group_link(layout, "tp", machine, devices_per_node)
    cp_link = group_link(layout, "cp", machine, devices_per_node) if layout.cp > 1 else None
    ep_link = group_link(layout, "ep", machine, devices_per_node) if layout.ep > 1 else None
    costs = [stage_cost(w, config, layout, samples, machine, precision, tp_link, cp_link, ep_link) for w in works]
    counts, splits = {0: 0}, {0: 0.0}
    if layout.pp == 1:
        ends = {0: costs[0].forward + costs[0].backward}
        parts = {0: (costs[0].forward_compute + costs[0].backward_compute, costs[0].forward_tp + costs[0].backward_tp)}
    else:
        actions = pipeline_actions(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches)
        shares = {"F": (1.0, 0.0), "B": (0.0, 1.0), "I": (0.0, INPUT_GRAD_SHARE), "W": (0.0, 1 - INPUT_GRAD_SHARE)}

        def duration(action: object) -> float:
            c, (f, b) = costs[action.stage], shares[action.kind]  # type: ignore[attr-defined]
            split = c.split_backward if action.kind == "I" else 0.0  # type: ignore[attr-defined]
            return f * c.forward + b * c.backward + split + machine.pipeline_action_s

        owner = {a.stage: r for r, acts in actions.items() for a in acts}

        def transfer(source: int, target: int) -> float:
            size = works[min(source, target)].output_bytes_per_sample * samples / layout.cp  # a cp rank's slice
            size *= element_bytes(precision).compute / works[min(source, target)].activation_element_bytes
            link = _pp_link(layout, owner[source], owner[target], machine, devices_per_node)
            return send(size, link) + COLLECTIVE_CPU_OPS * machine.op_overhead_s

        ends = simulate(actions, duration, transfer).end
        counts = {rank: len(acts) for rank, acts in actions.items()}
        parts, splits = {}, {}
        for rank, acts in actions.items():
            compute = tp = 0.0
            splits[rank] = sum(costs[a.stage].split_backward for a in acts if a.kind == "I")
            for a in acts:
                c, (f, b) = costs[a.stage], shares[a.kind]
                compute += f * c.forward_compute + b * c.backward_compute
                tp += f * c.forward_tp + b * c.backward_tp
            parts[rank] = (compute + splits[rank], tp)
    steps: list[StepTime] = []
    for rank, end in sorted(ends.items()):
        mine = [params[s] for s in layout.stage_indices(rank)]
        comm = data_parallel_collectives(layout, mine, precision, machine, devices_per_node)
        compute, tp = parts[rank]
        dp = sum(comm)
        if machine.overlap_communication and comm:
            dp = max(dp - compute, max(comm))
        dp += len(comm) * COLLECTIVE_CPU_OPS * machine.op_overhead_s
        step_tp = sum(costs[s].step_tp for s in layout.stage_indices(rank))
        opt = optimizer_time(layout, mine, precision, machine, optimizer)
        steps.append(StepTime(compute + opt, tp + step_tp, dp, max(end - compute - tp, 0.0), rank))
    best = max(steps, key=lambda step: step.total)
    every = tuple((s.compute, s.tp_comm, s.dp_comm, s.bubble) for s in steps)
    ranks = sorted(ends)
    return StepTime(
        best.compute, best.tp_comm, best.dp_comm, best.bubble, best.critical_pp_rank, every,
        tuple(counts[rank] for rank in ranks), tuple(splits[rank] for rank in ranks),
    )  # fmt: skip


def _pp_link(layout: Layout, a: int, b: int, machine: Machine, devices_per_node: int) -> Link:
    """The link between pipeline ranks ``a`` and ``b`` (their first ranks; the others are alike)."""
    stride = layout.dp * layout.tp
    same = (a * stride) // devices_per_node == (b * stride) // devices_per_node
    return machine.intra_node if same else machine.inter_node
