"""``BottleneckReport``: where each rank's step time goes, measured with ``torch.profiler`` over a few steps.

::

    trainer = L.Trainer(strategy="par3d", callbacks=[BottleneckReport(skip_first=5, steps=3)])

After ``skip_first`` training steps the profiler records ``steps`` steps on every rank. The callback marks each step
and its phases (and, under pipelining, every stage's forward and backward call), and
:mod:`~lightning_par3d.callbacks.bottleneck_analysis` splits each step into dataloader wait, forward, backward,
optimizer, tensor-parallel and data-parallel collectives, and pipeline send/recv and idle time. At the end of fit,
rank 0 gathers every rank's figures and writes to ``dirpath`` (default: the logger's directory, else
``trainer.default_root_dir``):

* ``bottleneck_report.md``: findings ranked by severity, each with a suggestion; tokens/s and MFU; every rank's
  buckets;
* ``trace_rank0.json``: rank 0's Chrome trace (open it in Perfetto or ``chrome://tracing``; about 10 MB for the
  demo's 3 steps); ``traces="all"`` keeps every rank's ``trace_rank{r}.json``, ``traces="none"`` none;
* ``pipeline_timeline.png``: the last sampled step, one row per rank, every block as measured;

and prints a short version. Writing happens after training, so it does not slow the run down.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par3d.callbacks.bottleneck_analysis import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    STAGE_PREFIX,
    STEP,
    Event,
    analyze_steps,
    mean_step,
)
from lightning_par3d.callbacks.bottleneck_findings import (
    RankSummary,
    ReportContext,
    diagnose,
    render_markdown,
    short_summary,
    with_advice,
)
from lightning_par3d.callbacks.run_context import output_directory, par3d_engine, pp_rank, unconfigured_copy
from lightning_par3d.callbacks.timeline import Block, plot_timeline
from lightning_par3d.utils.torch_private import schedule_stages

TRACES = ("rank0", "all", "none")
"""Which ranks' Chrome traces :class:`BottleneckReport` keeps."""
QUIET_KINETO = "6"
"""Kineto's log level above all of its levels: none of its lines (torch 2.13 prints its start and stop lines at
level 5)."""


class BottleneckReport(L.Callback):
    """Measures, never models, where each rank's step time goes, and says what to change.

    Args:
        skip_first: training steps to let pass before sampling (warm-up: first-step costs, caches). The last of
            them is recorded too, as the start of the first sampled step's cycle.
        steps: steps to record with ``torch.profiler``.
        dirpath: where to write the report, traces and timeline; default: the logger's directory, else
            ``trainer.default_root_dir``.
        verbose: print the short report at the end of fit (rank 0).
        advise: predict what each change the report weighs would do to the step
            (:mod:`lightning_par3d.planning.advice`), and suggest only those predicted to help: every rank measures
            the machine (about 2 s) and rank 0 predicts in a fresh interpreter (10–20 s), at the end of fit.
        traces: which ranks' Chrome traces to keep in ``dirpath``: ``"rank0"`` (default), ``"all"`` or
            ``"none"``. Every rank records one to measure its step; the others are deleted once read.
    """

    def __init__(
        self,
        skip_first: int = 5,
        steps: int = 3,
        dirpath: str | Path | None = None,
        verbose: bool = True,
        advise: bool = True,
        traces: str = "rank0",
    ):
        if traces not in TRACES:
            raise ValueError(f"BottleneckReport(traces={traces!r}): choose one of {', '.join(map(repr, TRACES))}.")
        if skip_first < 2 or steps < 1:
            raise ValueError(
                f"BottleneckReport needs skip_first >= 2 (the profiler starts two steps before the first sample, whose "
                f"cycle starts where the step before it ends) and steps >= 1; got skip_first={skip_first}, "
                f"steps={steps}."
            )
        self.skip_first = skip_first
        self.steps = steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.verbose = verbose
        self.advise = advise
        self.traces = traces
        self.trace_path: Path | None = None
        """Rank 0's kept Chrome trace (None when traces="none")."""
        self.summaries: list[RankSummary] = []
        self.findings: list[Any] = []
        self.advice: list[Any] = []
        """Every change the report weighed, with its predicted step, suggested ones first
        (:class:`~lightning_par3d.planning.advice.Advice`)."""
        self.advice_error: str | None = None
        self.measured: Any = None
        """The measured step as the advice read it (:class:`~lightning_par3d.planning.advice.Measured`)."""
        self.report_path: Path | None = None
        self.timeline_path: Path | None = None
        self._profiler: Any = None
        self._ranges: list[Any] = []
        self._unconfigured: Any = None
        self._context_extra: dict[str, Any] = {}
        self._done = False
        self._stopped = False
        self._seen = 0
        self._sampled = 0

    # ---------------------------------------------------------------- sampling
    @property
    def _sampling(self) -> bool:
        return self._profiler is not None and not self._done

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            # For measure_flops: a copy before configure_model (and before par3d shards it), to build on meta.
            try:
                self._unconfigured = unconfigured_copy(pl_module)
            except Exception:  # the FLOPs figure is optional; a module that cannot be copied just lacks it
                self._unconfigured = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = par3d_engine(trainer)
        runner = engine.pipeline if engine is not None else None
        if runner is not None:
            for stage in schedule_stages(runner.schedule):
                _mark_stage_calls(stage)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._stop_profiler()
        if self._sampling:
            if "tokens" not in self._context_extra:
                self._context_extra.update(_batch_size(batch))
            self._open(STEP)
            self._open(FORWARD)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._sampling and self._ranges:
            self._close()
            self._open(BACKWARD)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._sampling and self._ranges:
            self._close()
            self._open(OPTIMIZER)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._sampling and self._ranges:
            while self._ranges:
                self._close()
            self._sampled += 1
            # The first marked step only opens the window (see analyze_steps). Stopping the profiler takes a while;
            # it waits for the next batch's start, so that no sampled step's time includes it.
            self._done = self._sampled == self.steps + 1
        self._seen += 1
        if self._profiler is None and self._seen == self.skip_first - 1:
            self._start_profiler()  # from here on: the next batch's data fetch, then the sampled steps

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        # Kineto (torch.profiler's back end) prints "profiler_start"/"profiler_stop" and stage lines from every
        # rank at each start and stop; the report is what this callback says. Read at the profiler's first start;
        # a KINETO_LOG_LEVEL the user set is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def _stop_profiler(self) -> None:
        if self._done and not self._stopped:
            self._profiler.stop()
            self._stopped = True

    def _open(self, name: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # CPU ranges then bound the device work they launched
        marker = torch.profiler.record_function(name)
        marker.__enter__()
        self._ranges.append(marker)

    def _close(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._ranges.pop().__exit__(None, None, None)

    # ---------------------------------------------------------------- report
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is None:
            return
        while self._ranges:  # training ended inside the sampled window
            self._close()
        self._done = True
        self._stop_profiler()
        directory = output_directory(trainer, self.dirpath)
        rank = trainer.global_rank
        trace = directory / f"trace_rank{rank}.json"
        self._profiler.export_chrome_trace(str(trace))
        events = _events(trace)
        if self.traces == "all" or (self.traces == "rank0" and rank == 0):
            self.trace_path = trace
        else:
            trace.unlink(missing_ok=True)
        strategy = trainer.strategy
        pp = getattr(getattr(strategy, "layout", None), "pp", 1) > 1
        steps = analyze_steps(events, pp)
        mine = {
            "rank": rank,
            "pp_rank": pp_rank(trainer),
            "step": mean_step(steps),
            "cycles": [s.cycle_us for s in steps],
            "blocks": _last_step_blocks(events, pp),
        }
        everyone = _gather(mine)
        engine = par3d_engine(trainer)
        advising = self.advise and engine is not None and engine.is_set_up and len(steps) > 0
        machine = engine.calibrate() if advising and engine is not None else None  # every rank at once
        if everyone is None:
            return
        plan_copy = copy.deepcopy(self._unconfigured) if advising else None  # before _flops configures its own
        self.summaries = [RankSummary(r["rank"], r["pp_rank"], r["step"]) for r in everyone]
        context = self._context(trainer, len(steps))
        self.findings = diagnose(self.summaries, context)
        if advising and engine is not None:
            self.measured = measured(everyone)
            self.advice, self.advice_error = _advice(
                engine, plan_copy, machine, self.measured, context, self._context_extra
            )
            self.findings = with_advice(self.findings, self.advice)
        self.report_path = directory / "bottleneck_report.md"
        self.report_path.write_text(
            render_markdown(self.summaries, self.findings, context, self.advice, self.advice_error)
        )
        rows = [(f"rank {r['rank']} (pp {r['pp_rank']})", r["blocks"]) for r in everyone]
        title = _title(context)
        self.timeline_path = plot_timeline(rows, directory / "pipeline_timeline.png", title)
        if self.verbose:
            summary = short_summary(self.summaries, self.findings, context, self.advice, self.advice_error)
            kept = {"rank0": f"rank 0's Chrome trace: {trace} (traces='all' keeps every rank's)",
                    "all": f"Chrome traces: {directory}/trace_rank*.json", "none": ""}[self.traces]  # fmt: skip
            rank_zero_info(summary + f"\n  full report: {self.report_path}" + (f"\n  {kept}" if kept else ""))

    def _context(self, trainer: L.Trainer, sampled: int) -> ReportContext:
        from lightning_par3d.config import Layout

        strategy = trainer.strategy
        # Under another strategy, the report reads every rank as a replica (its suggestions then say less).
        layout = getattr(strategy, "layout", None) or Layout(1, trainer.world_size, 1, 1)
        config = getattr(strategy, "config", None)
        loader = trainer.train_dataloader
        tokens = self._context_extra.get("tokens")
        flops, peak = self._flops(trainer, layout)
        return ReportContext(
            layout=layout,
            schedule=getattr(config, "pipeline_schedule", "1f1b"),
            microbatches=getattr(config, "microbatches", 1),
            virtual_stages=getattr(config, "virtual_stages", 1),
            num_workers=getattr(loader, "num_workers", None),
            devices_per_node=max(trainer.num_devices, 1),
            sampled_steps=sampled,
            tokens_per_step=tokens * layout.dp if tokens else None,
            flops_per_step=flops,
            peak_flops=peak,
        )

    def _flops(self, trainer: L.Trainer, layout: Any) -> tuple[int | None, int | None]:
        """Model FLOPs of one global batch (forward and backward, measured by ``measure_flops`` on a meta copy),
        and the device's peak FLOPs from Lightning's table (None where it has none, as for CPUs)."""
        from lightning.fabric.utilities.throughput import get_available_flops, measure_flops

        shape = self._context_extra.get("input_shape")
        if self._unconfigured is None or shape is None:
            return None, None
        try:
            with torch.device("meta"):
                model = self._unconfigured
                model.configure_model()
                x = torch.zeros((shape[0] * layout.dp, *shape[1:]), dtype=self._context_extra["input_dtype"])
                flops = measure_flops(model, lambda: model(x), lambda y: y.sum())
        except Exception:  # a model whose forward does not take the batch's first tensor: no FLOPs figure
            return None, None
        dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
        return flops, get_available_flops(trainer.strategy.root_device, dtype)


def _advice(
    engine: Any,
    module: Any,
    machine: Any,
    measured_step: Any,
    context: ReportContext,
    extra: dict[str, Any],
) -> tuple[list[Any], str | None]:
    """Rank 0: each change's predicted step (:func:`lightning_par3d.planning.advice.advise`, in a fresh
    interpreter), or why there is none."""
    from lightning_par3d.planning.advice import advise
    from lightning_par3d.planning.at_launch import device_memory
    from lightning_par3d.utils.fresh_interpreter import call

    shape = extra.get("input_shape")
    if module is None or shape is None or len(shape) < 2:
        return [], "no copy of the model or no token batch to predict with"
    layout = context.layout
    try:
        advice = call(
            advise, module, engine.config, layout.world_size, context.devices_per_node,
            device_memory(engine.device, context.devices_per_node), measured_step,
            rank_batch=int(shape[0]), seq_len=int(shape[-1]), precision=engine.precision, machine=machine,
            num_workers=context.num_workers, what="the bottleneck report's advice",
        )  # fmt: skip
    except Exception as error:  # the report stands without its predictions
        return [], f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return advice, None


def measured(everyone: list[dict[str, Any]]) -> Any:
    """The run's step as :mod:`lightning_par3d.planning.advice` reads it: every bucket averaged over the ranks, in
    seconds; the noise from the spread of the sampled steps."""
    from lightning_par3d.planning.advice import Measured

    n = len(everyone)

    def mean(*names: str) -> float:
        return sum(r["step"].buckets.get(name, 0.0) for r in everyone for name in names) / n / 1e6

    step = sum(r["step"].cycle_us for r in everyone) / n / 1e6
    accounted = mean("forward", "backward", "optimizer", "tp_comm", "dp_comm", "pipeline")
    cycles = [sum(c) / n / 1e6 for c in zip(*(r["cycles"] for r in everyone), strict=False)]
    noise = (max(cycles) - min(cycles)) / (sum(cycles) / len(cycles)) if len(cycles) > 1 else 0.0
    return Measured(
        step=step,
        compute=mean("forward", "backward", "optimizer"),
        tp_comm=mean("tp_comm"),
        dp_comm=mean("dp_comm"),
        bubble=mean("pipeline"),
        other=max(step - accounted, 0.0),
        dataloader=mean("dataloader"),
        noise=noise,
    )


def _batch_size(batch: Any) -> dict[str, Any]:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(first, torch.Tensor):
        return {"tokens": None}
    tokens = first.numel() if not first.is_floating_point() else first.shape[0]
    return {"tokens": tokens, "input_shape": tuple(first.shape), "input_dtype": first.dtype}


def _mark_stage_calls(stage: Any) -> None:
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


_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})


def _events(trace: Path) -> list[Event]:
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


def _last_step_blocks(events: list[Event], pp: bool) -> list[Block]:
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


def _gather(mine: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's figures on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    return sorted(everyone, key=lambda r: r["rank"]) if dist.get_rank() == 0 else None


def _title(context: ReportContext) -> str:
    layout = context.layout
    if layout is not None and layout.pp > 1:
        return f"{context.schedule}, pp={layout.pp}, {context.microbatches} microbatches: last sampled step"
    return f"{layout}: last sampled step"
