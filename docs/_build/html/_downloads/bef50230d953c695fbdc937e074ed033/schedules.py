"""The pipeline schedules par3d offers, and where each stage lives.

Plain names and arithmetic only, so that the configuration can validate a schedule before anything is built.
"""

from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""One stage per pipeline rank."""
LOOP_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
"""``virtual_stages`` stages per rank, placed round-robin: rank ``r`` holds ``r, r + pp, …``."""
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
"""Two stages per rank in a V: rank ``r`` holds ``r`` and ``2·pp − 1 − r``."""
SCHEDULE_NAMES = SINGLE_STAGE_SCHEDULES + LOOP_SCHEDULES + V_SCHEDULES

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""par3d's schedule name → the class in ``torch.distributed.pipelining.schedules``."""
assert set(TORCH_SCHEDULES) == set(SCHEDULE_NAMES)


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """How many stages each pipeline rank holds: 2 for the V schedules, else ``virtual_stages``."""
    return 2 if schedule in V_SCHEDULES else virtual_stages


def stage_indices(schedule: str, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The global stage indices that pipeline rank ``pp_rank`` holds: ``r, r + pp, …`` for looped schedules, and
    ``r, 2·pp − 1 − r`` for V-shaped ones (the last stage returns to rank 0)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_owner(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank that holds global stage ``stage``."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def microbatch_problem(schedule: str, microbatches: int, pp: int, virtual_stages: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` microbatches over ``pp`` pipeline ranks holding
    ``virtual_stages`` stages each (a sentence that names the fix), or None if it can."""
    stages = pp * stages_per_rank(schedule, virtual_stages)
    if schedule in ("1f1b", *V_SCHEDULES) and microbatches < stages:
        return (
            f"microbatches={microbatches} is fewer than the {stages} pipeline stages that {schedule!r} needs at "
            f"least. Raise microbatches to {stages} or more (more microbatches also shrink the bubble)."
        )
    interleaved = ("interleaved_1f1b", "interleaved_zero_bubble")
    if schedule in interleaved and microbatches >= pp and microbatches % (microbatches // pp):
        return (
            f"microbatches={microbatches}: {schedule!r} runs microbatches in rounds of pp={pp}, so microbatches must "
            f"be a multiple of {microbatches // pp}. Use a multiple of pp, e.g. {pp * max(1, microbatches // pp)}."
        )
    return None


def microbatches_for(batch: int, schedule: str, microbatches: int, pp: int, virtual_stages: int) -> int | None:
    """How many equal microbatches a batch of ``batch`` samples runs as: ``microbatches`` when it divides the batch,
    else the divisor of ``batch`` nearest below it that the schedule can run (a partial last batch: 15 samples with
    ``microbatches=4`` run as 3 microbatches of 5), else the nearest above it (13 samples: 13 microbatches of 1),
    else None (fewer samples than the schedule has stages). Equal microbatches keep the batch's mean loss the mean of
    the microbatches' means, as one process computes it."""
    if batch % microbatches == 0:
        return microbatches
    below = range(min(microbatches, batch), 0, -1)
    above = range(microbatches + 1, batch + 1)
    for count in (*below, *above):
        if batch % count == 0 and microbatch_problem(schedule, count, pp, virtual_stages) is None:
            return count
    return None
