"""Where a rank's step time went, from the events ``torch.profiler`` recorded: plain functions, no Lightning.

The :class:`~lightning_par3d.callbacks.BottleneckReport` callback marks each sampled step with ``record_function``
ranges (``par3d/step``; ``par3d/forward``, ``par3d/backward``, ``par3d/optimizer`` between Lightning's hooks; and,
under pipelining, ``par3d/pp/F``, ``par3d/pp/B``, ``par3d/pp/I``, ``par3d/pp/W`` around each pipeline stage's
compute call). From those and from the profiler's own events, each step's time is split into buckets that never
overlap:

``dataloader``  the DataLoader's ``__next__`` calls before the step (torch's DataLoader records them);
``loop``        the rest of the time between the previous step's end and this one's start: Lightning's loop and the
                callbacks' per-step work (logging, checkpointing, progress bar);
``tp_comm``     tensor-parallel collectives: DTensor's functional collectives during forward and backward;
``dp_comm``     data-parallel collectives: FSDP2's all-gathers and reduce-scatters, DDP's and ZeRO's all-reduces,
                and the optimizer phase's norm reductions;
``pipeline``    under pp, the schedule's time that is neither stage compute nor tp/dp communication: waiting for
                and sending activations and gradients to the neighbours, the loss broadcast, and the bubble;
``observer``    par3d's own measuring (``MemoryStats`` marks its work), so that its cost shows and blames nothing;
``forward``, ``backward``, ``optimizer``  what is left of each phase: the rank computing.

A collective counts where it is *exposed*: while the rank's main thread waits for it rather than computing. A
blocking wait on the main thread (DTensor's ``wait_tensor``) counts whole. A collective that runs asynchronously
(gloo's operations, including point-to-point sends and receives, which the profiler shows for their whole
lifetime; NCCL kernels on the device) counts only for the part that no compute op on the main thread (or compute
kernel on the device) covers. Each is tied to the call that issued it, by kind and order, and takes that call's
category. Where categories overlap in time, the main thread's own wait wins, and then ``pipeline``, ``tp_comm``,
``dp_comm``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_par3d.callbacks.intervals import Span, intersect, length, merge, subtract

BUCKETS = ("forward", "backward", "optimizer", "tp_comm", "dp_comm", "pipeline", "dataloader", "loop", "observer")
"""Every bucket, in the report's order."""

COMPUTE_BUCKETS = ("forward", "backward")
"""Useful work: never a bottleneck to remove."""

STEP, FORWARD, BACKWARD, OPTIMIZER = "par3d/step", "par3d/forward", "par3d/backward", "par3d/optimizer"
OBSERVER = "par3d/observe"
"""par3d's own measuring (``MemoryStats``) marks its work with this range: its time is its own bucket."""
STAGE_PREFIX = "par3d/pp/"
DATALOADER_MARK = "DataLoader"

_KIND_OF_ISSUER = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
    "c10d::send": "send",
    "c10d::recv_": "recv",
    "c10d::alltoall_base_": "all_to_all",
}
_BLOCKING_ON_MAIN = ("_c10d_functional::wait_tensor", "c10d::wait", "c10d::barrier")


@dataclass(frozen=True)
class Event:
    """One profiler event: absolute times in microseconds, and the thread (or device stream) it ran on."""

    name: str
    start: float
    end: float
    thread: int
    device: bool = False
    """A device (GPU) event: a kernel, not a CPU op."""

    @property
    def span(self) -> Span:
        return (self.start, self.end)


@dataclass
class StepTimes:
    """One step of one rank: the measured cycle time and its buckets (microseconds)."""

    cycle_us: float
    """From the end of the previous step to the end of this one, as measured (independently of the buckets)."""
    buckets: dict[str, float] = field(default_factory=dict)
    comm_kinds: dict[str, float] = field(default_factory=dict)
    """Exposed collective time by kind (all_reduce, all_gather, reduce_scatter, send, …)."""

    @property
    def accounted_us(self) -> float:
        return sum(self.buckets.values())


def _spans(events: Iterable[Event]) -> list[Span]:
    return [e.span for e in events]


def _kind_of_worker(name: str) -> str:
    """``gloo:all_reduce`` → ``all_reduce``; NCCL kernels (``ncclDevKernel_AllReduce_…``) by their collective."""
    if ":" in name:
        return name.split(":", 1)[1]
    lowered = name.lower()
    for needle, kind in (
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("sendrecv", "send"),
        ("send", "send"),
        ("recv", "recv"),
    ):
        if needle in lowered:
            return kind
    return "other"


def is_async_comm(event: Event) -> bool:
    """A collective's lifetime as the backend runs it: a gloo operation (on a worker thread, or a point-to-point one
    on the calling thread) or an NCCL kernel on the device."""
    if event.device:
        return event.name.lower().startswith("nccl")
    return event.name.startswith(("gloo:", "nccl:"))


def _is_compute(event: Event, main: int) -> bool:
    if event.device:
        return not event.name.lower().startswith("nccl")
    # Not "Optimizer.step#…": under Lightning the whole closure (forward and backward) runs inside optimizer.step.
    return event.thread == main and event.name.startswith(("aten::", "autograd::engine::evaluate_function"))


def _category(issuer: Event, main_events: Sequence[Event], phases: dict[str, list[Span]], pp: bool) -> str:
    if any(s <= issuer.start < e for s, e in phases.get(OBSERVER, [])):
        return "observer"
    kind = _KIND_OF_ISSUER.get(issuer.name, "other")
    if kind in ("send", "recv"):
        return "pipeline"
    if kind == "broadcast":
        return "pipeline" if pp else "dp_comm"
    functional = any(
        e.start <= issuer.start and issuer.end <= e.end and e.name.startswith("_c10d_functional::") for e in main_events
    )
    in_optimizer = any(s <= issuer.start < e for s, e in phases.get(OPTIMIZER, []))
    return "tp_comm" if functional and not in_optimizer else "dp_comm"


@dataclass
class _Comm:
    """Collective time spans by category: what the main thread blocked on, what ran on workers or the device."""

    blocking: dict[str, list[Span]] = field(default_factory=dict)
    worker: dict[str, list[Span]] = field(default_factory=dict)
    kinds: dict[str, list[Span]] = field(default_factory=dict)

    def add(self, where: dict[str, list[Span]], category: str, kind: str, span: Span) -> None:
        where.setdefault(category, []).append(span)
        self.kinds.setdefault(kind, []).append(span)


def _comm_spans(events: Sequence[Event], main: int, phases: dict[str, list[Span]], pp: bool) -> _Comm:
    """Every collective's time span by category: main-thread waits and blocking calls, and worker/device
    collectives tied to the main-thread call that issued them."""
    main_events = [e for e in events if e.thread == main and not e.device]
    comm = _Comm()
    issuers = sorted((e for e in main_events if e.name in _KIND_OF_ISSUER), key=lambda e: e.start)
    used = [False] * len(issuers)
    for event in sorted((e for e in events if is_async_comm(e)), key=lambda e: e.start):
        kind = _kind_of_worker(event.name)
        match = next(
            (
                i
                for i, issuer in enumerate(issuers)
                if not used[i] and issuer.start <= event.start and _KIND_OF_ISSUER[issuer.name] == kind
            ),
            None,
        )
        category = "dp_comm"
        if match is not None:
            used[match] = True
            category = _category(issuers[match], main_events, phases, pp)
        comm.add(comm.worker, category, kind, event.span)
    for event in main_events:
        if event.name in _BLOCKING_ON_MAIN:
            in_optimizer = any(s <= event.start < e for s, e in phases.get(OPTIMIZER, []))
            comm.blocking.setdefault("dp_comm" if in_optimizer else "tp_comm", []).append(event.span)
    return comm


def analyze_steps(events: Sequence[Event], pp: bool) -> list[StepTimes]:
    """Splits each marked step of one rank, after the first, into the buckets of :data:`BUCKETS`: a step's cycle
    runs from the end of the step before it, so the first marked step only opens the window."""
    steps = sorted((e for e in events if e.name == STEP and not e.device), key=lambda e: e.start)
    if not steps:
        return []
    main = steps[0].thread
    results = []
    for previous, step in itertools.pairwise(steps):  # the first marked step only gives the second its start
        window = [step.span]
        inside = [e for e in events if e.start >= step.start and e.end <= step.end]
        results.append(_analyze_step(events, inside, main, window, previous.end, step, pp))
    return results


def _phase_spans(inside: Sequence[Event], main: int) -> dict[str, list[Span]]:
    phases: dict[str, list[Span]] = {FORWARD: [], BACKWARD: [], OPTIMIZER: [], OBSERVER: []}
    for event in inside:
        if event.thread == main and event.name in phases:
            phases[event.name].append(event.span)
    return phases


def _analyze_step(
    events: Sequence[Event],
    inside: Sequence[Event],
    main: int,
    window: list[Span],
    previous_end: float,
    step: Event,
    pp: bool,
) -> StepTimes:
    phases = _phase_spans(inside, main)
    comm = _comm_spans(inside, main, phases, pp)
    blocking = [span for spans in comm.blocking.values() for span in spans]
    observer = merge(phases[OBSERVER])
    busy = subtract(_spans(e for e in inside if _is_compute(e, main)), [*blocking, *observer])
    claimed: list[Span] = list(observer)
    exposed: dict[str, list[Span]] = {"pipeline": [], "tp_comm": [], "dp_comm": []}
    for source in (comm.blocking, comm.worker):  # the main thread's own waits first
        for category in exposed:
            spans = subtract(intersect(subtract(source.get(category, []), busy), window), claimed)
            exposed[category] += spans
            claimed = merge([*claimed, *spans])
    buckets = dict.fromkeys(BUCKETS, 0.0)
    buckets["tp_comm"] = length(exposed["tp_comm"])
    buckets["dp_comm"] = length(exposed["dp_comm"])
    loaders = [e for e in events if DATALOADER_MARK in e.name and previous_end <= e.start < step.start]
    buckets["dataloader"] = length(_spans(loaders))
    buckets["loop"] = length(subtract([(previous_end, step.start)], _spans(loaders)))
    buckets["observer"] = length(observer)
    if pp:
        stage_f = _spans(e for e in inside if e.name.startswith(STAGE_PREFIX + "F"))
        stage_b = _spans(e for e in inside if e.name.startswith(tuple(STAGE_PREFIX + k for k in "BIW")))
        buckets["forward"] = length(subtract(stage_f, claimed))
        buckets["backward"] = length(subtract(stage_b, claimed)) + length(subtract(phases[BACKWARD], claimed))
        schedule = subtract(phases[FORWARD], [*stage_f, *stage_b, *observer])
        buckets["pipeline"] = length(subtract(schedule, [*exposed["tp_comm"], *exposed["dp_comm"]]))
    else:
        buckets["forward"] = length(subtract(phases[FORWARD], claimed))
        buckets["backward"] = length(subtract(phases[BACKWARD], claimed))
        buckets["pipeline"] = length(exposed["pipeline"])
    buckets["optimizer"] = length(subtract(phases[OPTIMIZER], claimed))
    kinds = {kind: length(subtract(intersect(spans, window), [*busy, *observer])) for kind, spans in comm.kinds.items()}
    return StepTimes(cycle_us=step.end - previous_end, buckets=buckets, comm_kinds=kinds)


def mean_step(steps: Sequence[StepTimes]) -> StepTimes:
    """The average of several steps, bucket by bucket."""
    n = max(len(steps), 1)
    buckets = {b: sum(s.buckets.get(b, 0.0) for s in steps) / n for b in BUCKETS}
    kinds: dict[str, float] = {}
    for s in steps:
        for k, v in s.comm_kinds.items():
            kinds[k] = kinds.get(k, 0.0) + v / n
    return StepTimes(cycle_us=sum(s.cycle_us for s in steps) / n, buckets=buckets, comm_kinds=kinds)
