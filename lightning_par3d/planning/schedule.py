"""A pipeline schedule's timing, from the action order torch's own schedule class gives.

:func:`pipeline_actions` builds the torch schedule that a run builds (:func:`lightning_par3d.pipeline.runner.
torch_schedule`) over placeholder stages in a fake process group, and reads its ``pipeline_order``: per pipeline
rank, the forward (``F``), full backward (``B``), input-gradient (``I``) and weight-gradient (``W``) actions in the
order the rank runs them. The memory estimator walks the same order to count microbatches in flight
(:func:`schedule_peak` repeats its rule); :func:`simulate` gives the same order durations and dependencies:

* ``F(s, k)`` starts after ``F(s−1, k)`` has ended and its output has reached stage ``s``;
* ``B(s, k)`` and ``I(s, k)`` start after ``F(s, k)`` and after the input gradient of ``(s+1, k)`` (from its ``B``
  or ``I``) has arrived;
* ``W(s, k)`` starts after ``I(s, k)``;
* each rank runs its actions one at a time, in torch's order.

A rank's step ends with its last action; the step's pipeline time is the latest end (the makespan). The bubble of a
rank is the makespan minus its busy time; with equal stages, ``F`` and ``B`` costs ``f`` and ``b`` and no transfer
time, 1F1B and GPipe give the textbook ``(p−1)/(m+p−1)`` of the makespan (:func:`schedule_bubble`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_par3d.config import Par3DConfig, resolve_layout
from lightning_par3d.memory.estimate import flatten_actions
from lightning_par3d.planning.fakeworld import fake_world

COMPUTE_KINDS = ("F", "B", "I", "W")
"""The action kinds that compute; torch's other kinds (gradient reduction, sends, unshard) are left out."""


@dataclass(frozen=True)
class Action:
    """One computation of a pipeline rank: ``kind`` (F, B, I or W) of ``microbatch`` on global stage ``stage``."""

    stage: int
    kind: str
    microbatch: int


@functools.cache
def pipeline_actions(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """Per pipeline rank, the compute actions of torch's schedule, in its order.

    Overlapped pairs (DualPipeV's ``OVERLAP_F_B``) are taken apart in their order. torch 2.13's ``Schedule1F1B``
    numbers the last rank's forwards 1…m instead of 0…m−1 in its ``pipeline_order`` (its step runs them right); a
    stage whose forwards (or input-gradient passes) do not number 0…m−1 is renumbered in its order, which is what
    its step runs.
    """
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from lightning_par3d.pipeline.runner import torch_schedule

    config = Par3DConfig(
        pp=pp, pipeline_schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches, dp_shard=1
    )
    layout = resolve_layout(config, pp)
    assert layout is not None
    import torch

    with fake_world(pp):
        stages = [
            PipelineStage(nn.Identity(), i, layout.n_stages, torch.device("cpu")) for i in layout.stage_indices(0)
        ]
        order = torch_schedule(layout, stages, _no_loss).pipeline_order
    if order is None:
        raise RuntimeError(f"torch's schedule for {schedule!r} gives no pipeline_order to time.")
    return {rank: tuple(_renumbered(list(_compute_actions(actions)), microbatches)) for rank, actions in order.items()}


def _no_loss(outputs: Any, targets: Any) -> Any:
    return outputs


def _compute_actions(actions: Sequence[object]) -> Iterator[Action]:
    for action in flatten_actions(actions):
        kind = str(action.computation_type.value)
        if kind in COMPUTE_KINDS:
            yield Action(int(action.stage_index), kind, int(action.microbatch_index))


def _renumbered(actions: list[Action], microbatches: int) -> list[Action]:
    """Renumbers, per stage, the forwards (and the input-gradient passes, ``B`` and ``I`` together) in their order
    where their numbers are not 0…m−1."""
    families = {"F": "F", "B": "G", "I": "G"}
    by_family: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, action in enumerate(actions):
        if action.kind in families:
            by_family[(action.stage, families[action.kind])].append(i)
    fixed = list(actions)
    for positions in by_family.values():
        numbers = sorted(actions[i].microbatch for i in positions)
        if numbers != list(range(microbatches)):
            for k, i in enumerate(positions):
                fixed[i] = Action(actions[i].stage, actions[i].kind, k)
    return fixed


def schedule_peak(actions: Sequence[Action], per_microbatch: dict[int, int]) -> tuple[int, int]:
    """The estimator's walk over one rank's actions: a forward adds its stage's bytes, a full backward (or, in the
    zero-bubble schedules, the weight-gradient pass) releases them. Returns (peak bytes, peak count in flight)."""
    live = peak = count = peak_count = 0
    for action in actions:
        if action.kind == "F":
            live, count = live + per_microbatch[action.stage], count + 1
        elif action.kind in ("B", "W"):
            live, count = live - per_microbatch[action.stage], count - 1
        peak, peak_count = max(peak, live), max(peak_count, count)
    return peak, peak_count


@dataclass(frozen=True)
class PipelineTimeline:
    """What :func:`simulate` found: per pipeline rank, when its last action ends and how long it computed."""

    end: dict[int, float]
    busy: dict[int, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values())

    def bubble(self, rank: int) -> float:
        """The time rank ``rank`` waits within the makespan."""
        return self.makespan - self.busy[rank]


def simulate(
    actions: dict[int, tuple[Action, ...]],
    duration: Callable[[Action], float],
    transfer: Callable[[int, int], float] = lambda a, b: 0.0,
) -> PipelineTimeline:
    """Times the schedule: ``duration(action)`` is an action's own time on its rank; ``transfer(s, t)`` the time
    an activation (or its gradient) takes from stage ``s``'s rank to stage ``t``'s (0 on the same rank). See the
    module docstring for the dependencies."""
    owner = {a.stage: rank for rank, acts in actions.items() for a in acts}
    done: dict[tuple[str, int, int], float] = {}
    position = dict.fromkeys(actions, 0)
    free = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    left = sum(len(acts) for acts in actions.values())
    while left:
        progressed = False
        for rank, acts in actions.items():
            while position[rank] < len(acts):
                action = acts[position[rank]]
                ready = _ready_time(action, done, owner, transfer)
                if ready is None:
                    break
                took = duration(action)
                end = max(free[rank], ready) + took
                done[_key(action)] = end
                free[rank], busy[rank] = end, busy[rank] + took
                position[rank] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[position[r]] for r, acts in actions.items() if position[r] < len(acts)}
            raise RuntimeError(f"The pipeline order cannot proceed (waiting actions: {stuck}).")
    return PipelineTimeline(end=free, busy=busy)


def _key(action: Action) -> tuple[str, int, int]:
    kind = "G" if action.kind in ("B", "I") else action.kind  # G: the input gradient is ready
    return (kind, action.stage, action.microbatch)


def _ready_time(
    action: Action,
    done: dict[tuple[str, int, int], float],
    owner: dict[int, int],
    transfer: Callable[[int, int], float],
) -> float | None:
    """When ``action``'s inputs are all there (None while one is missing)."""
    s, k = action.stage, action.microbatch
    needs: list[tuple[tuple[str, int, int], float]] = []
    if action.kind == "F":
        if s > 0:
            needs.append((("F", s - 1, k), _hop(s - 1, s, owner, transfer)))
    elif action.kind in ("B", "I"):
        needs.append((("F", s, k), 0.0))
        if s + 1 in owner:
            needs.append((("G", s + 1, k), _hop(s + 1, s, owner, transfer)))
    else:  # W
        needs.append((("G", s, k), 0.0))
    ready = 0.0
    for key, hop in needs:
        if key not in done:
            return None
        ready = max(ready, done[key] + hop)
    return ready


def _hop(source: int, target: int, owner: dict[int, int], transfer: Callable[[int, int], float]) -> float:
    return 0.0 if owner[source] == owner[target] else transfer(source, target)


def schedule_bubble(
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    forward: float = 1.0,
    backward: float = 2.0,
    input_grad_share: float = 0.5,
) -> float:
    """The idle share of the busiest pipeline rank's step, for equal stages (each ``forward`` and ``backward`` long
    per microbatch, split into input and weight gradients by ``input_grad_share``) and free transfers. For 1F1B and
    GPipe this is ``(p−1)/(m+p−1)``."""
    from lightning_par3d.pipeline.schedules import stages_per_rank

    per_rank = stages_per_rank(schedule, virtual_stages)
    actions = pipeline_actions(schedule, pp, virtual_stages, microbatches)
    f, b = forward / per_rank, backward / per_rank
    times = {"F": f, "B": b, "I": b * input_grad_share, "W": b * (1 - input_grad_share)}
    timeline = simulate(actions, lambda a: times[a.kind])
    return min(timeline.bubble(r) for r in actions) / timeline.makespan
