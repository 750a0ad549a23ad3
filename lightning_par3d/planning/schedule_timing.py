"""A pipeline schedule's timing, from the action order torch's own schedule class gives.

Each pipeline rank's actions come from :func:`lightning_par3d.pipeline.actions.pipeline_actions` (torch's own
schedule, the order the memory estimator walks too); :func:`simulate` gives that order durations and dependencies:

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

from collections.abc import Callable
from dataclasses import dataclass

from lightning_par3d.pipeline.actions import Action, pipeline_actions


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
    hops: dict[tuple[int, int], float] = {}  # each pair's transfer, once (a large pipeline asks millions of times)

    def hop(source: int, target: int) -> float:
        if (source, target) not in hops:
            hops[(source, target)] = 0.0 if owner[source] == owner[target] else transfer(source, target)
        return hops[(source, target)]

    needs = {a: _needs(a, owner) for acts in actions.values() for a in acts}
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
                ready = _ready_time(needs[action], done, hop)
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


Need = tuple[tuple[str, int, int], tuple[int, int] | None]
"""What an action waits for: another action's end (its key), and the stages an activation or gradient travels
between to reach it (None: nothing travels)."""


def _needs(action: Action, owner: dict[int, int]) -> tuple[Need, ...]:
    """What ``action`` waits for (see the module docstring)."""
    s, k = action.stage, action.microbatch
    if action.kind == "F":
        return ((("F", s - 1, k), (s - 1, s)),) if s > 0 else ()
    if action.kind in ("B", "I"):
        after_forward: Need = (("F", s, k), None)
        return (after_forward, (("G", s + 1, k), (s + 1, s))) if s + 1 in owner else (after_forward,)
    return ((("G", s, k), None),)  # W


def _ready_time(
    needs: tuple[Need, ...], done: dict[tuple[str, int, int], float], hop: Callable[[int, int], float]
) -> float | None:
    """When an action's inputs are all there (None while one is missing)."""
    ready = 0.0
    for key, between in needs:
        end = done.get(key)
        if end is None:
            return None
        ready = max(ready, end + (hop(*between) if between is not None else 0.0))
    return ready


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
    from lightning_par3d.config.schedules import stages_per_rank

    per_rank = stages_per_rank(schedule, virtual_stages)
    actions = pipeline_actions(schedule, pp, virtual_stages, microbatches)
    f, b = forward / per_rank, backward / per_rank
    times = {"F": f, "B": b, "I": b * input_grad_share, "W": b * (1 - input_grad_share)}
    timeline = simulate(actions, lambda a: times[a.kind])
    return min(timeline.bubble(r) for r in actions) / timeline.makespan
