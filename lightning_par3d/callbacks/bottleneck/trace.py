"""What a rank's Chrome trace holds, read back after the run: its events, the blocks of its last sampled step for
the timeline, and every rank's figures gathered on rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_par3d.callbacks.bottleneck.analysis import BACKWARD, FORWARD, OPTIMIZER, STAGE_PREFIX, STEP, Event
from lightning_par3d.callbacks.bottleneck.timeline import Block

_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})


def read_events(trace: Path) -> list[Event]:
    """The profiled events, read back from the rank's exported Chrome trace, with absolute times (µs since the
    epoch, comparable across ranks on one clock) and the OS thread (or device stream) each ran on.

    Reading the trace that kineto has just written (C++) is an order of magnitude cheaper than the profiler's own
    ``events()``, which builds a Python object per op: for an 8-rank 3D run's sampled steps that took several seconds
    of each rank's CPU at the end of ``fit``."""
    data = json.loads(trace.read_text())
    base = data.get("baseTimeNanoseconds", 0) / 1e3  # recent kineto writes ``ts`` relative to it
    out = []
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") == "Trace" or "dur" not in e:
            continue
        start = base + float(e["ts"])
        device = e.get("cat") in _DEVICE_CATEGORIES
        tid = e.get("tid", 0)  # an OS thread id, or a device stream's number (a string in some kineto versions)
        thread = tid if isinstance(tid, int) else hash(str(tid))
        out.append(Event(e["name"], start, start + float(e["dur"]), thread, device))
    return out


def last_step_blocks(events: list[Event], pp: bool) -> list[Block]:
    """The blocks of the last sampled step for the timeline: stage compute calls under pp, phases otherwise, and
    the exposed collectives and dataloader calls around them."""
    steps = sorted((e for e in events if e.name == STEP), key=lambda e: e.start)
    if not steps:
        return []
    step = steps[-1]
    inside = [e for e in events if e.start >= step.start and e.end <= step.end and not e.device]
    blocks = []
    for e in inside:
        if e.name.startswith(STAGE_PREFIX):
            kind, _, mb = e.name[len(STAGE_PREFIX) :].split(" ")
            blocks.append(Block(kind, f"{kind}{mb.removeprefix('mb')}", e.start, e.end))
        elif not pp and e.name in (FORWARD, BACKWARD, OPTIMIZER):
            blocks.append(Block(e.name.split("/")[1], "", e.start, e.end))
        elif e.name == OPTIMIZER:
            blocks.append(Block("optimizer", "", e.start, e.end))
    return blocks


def gather_on_rank_zero(mine: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's figures on rank 0, by rank (None elsewhere)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    return sorted(everyone, key=lambda r: r["rank"]) if dist.get_rank() == 0 else None
