"""Recording a run's steps with ``torch.profiler``: the profiler's start and stop, a range per step and per phase,
and, under pipelining, a range around each stage's forward and backward call."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from lightning_par3d.callbacks.bottleneck.analysis import STAGE_PREFIX

QUIET_KINETO = "6"
"""Kineto's log level above all of its levels: none of its lines (torch 2.13 prints its start and stop lines at
level 5)."""


class StepSampler:
    """The profiler over the sampled steps, and the ``record_function`` ranges that mark them.

    Started once ``skip_first - 1`` steps have passed (:meth:`step_ended`), so that the next batch's data fetch is
    recorded as the start of the first sampled step's cycle; stopped at the start of the batch after the last
    sampled one (stopping takes a while, and no sampled step's time may include it)."""

    def __init__(self, skip_first: int, steps: int) -> None:
        self.skip_first, self.steps = skip_first, steps
        self.profiler: Any = None
        self._ranges: list[Any] = []
        self._done = self._stopped = False
        self._seen = self._sampled = 0

    @property
    def sampling(self) -> bool:
        return self.profiler is not None and not self._done

    @property
    def marking(self) -> bool:
        """Inside a sampled step's ranges."""
        return self.sampling and bool(self._ranges)

    def open(self, name: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # CPU ranges then bound the device work they launched
        marker = torch.profiler.record_function(name)
        marker.__enter__()
        self._ranges.append(marker)

    def close(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._ranges.pop().__exit__(None, None, None)

    def close_all(self) -> None:
        while self._ranges:
            self.close()

    def step_ended(self) -> None:
        """At each training batch's end: closes a sampled step, and starts the profiler when its time has come."""
        if self.marking:
            self.close_all()
            self._sampled += 1
            # The first marked step only opens the window (see analyze_steps).
            self._done = self._sampled == self.steps + 1
        self._seen += 1
        if self.profiler is None and self._seen == self.skip_first - 1:
            self._start()

    def stop_if_done(self) -> None:
        if self._done and not self._stopped:
            self.profiler.stop()
            self._stopped = True

    def finish(self, trace: Path) -> int:
        """Ends sampling (training may have ended inside the window), exports this rank's Chrome trace to
        ``trace``, and returns how many steps were sampled."""
        self.close_all()
        self._done = True
        self.stop_if_done()
        self.profiler.export_chrome_trace(str(trace))
        return self._sampled

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # Kineto (torch.profiler's back end) prints "profiler_start"/"profiler_stop" and stage lines from every
        # rank at each start and stop; the report is what the callback says. Read at the profiler's first start;
        # a KINETO_LOG_LEVEL the user set is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)
        self.profiler = profile(activities=activities)
        self.profiler.start()


def mark_stage_calls(stage: Any) -> None:
    """Wraps a pipeline stage's compute calls in ``record_function`` ranges named by kind, stage and microbatch."""
    if getattr(stage, "_par3d_marked", False):
        return
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    @functools.wraps(forward)
    def marked_forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"{STAGE_PREFIX}F s{stage.stage_index} mb{chunk}"):
            return forward(chunk, *args, **kwargs)

    @functools.wraps(backward)
    def marked_backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        with torch.profiler.record_function(f"{STAGE_PREFIX}{'B' if full else 'I'} s{stage.stage_index} mb{chunk}"):
            return backward(chunk, *args, **kwargs)

    @functools.wraps(weight)
    def marked_weight(chunk: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"{STAGE_PREFIX}W s{stage.stage_index} mb{chunk}"):
            return weight(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = marked_forward, marked_backward
    stage.backward_weight_one_chunk = marked_weight
    stage._par3d_marked = True
