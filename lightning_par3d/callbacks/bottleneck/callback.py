"""``BottleneckReport``: where each rank's step time goes, measured with ``torch.profiler`` over a few steps.

::

    trainer = L.Trainer(strategy="par3d", callbacks=[BottleneckReport(skip_first=5, steps=3)])

After ``skip_first`` training steps the profiler records ``steps`` steps on every rank. The callback marks each step
and its phases (and, under pipelining, every stage's forward and backward call), and
:mod:`~lightning_par3d.callbacks.bottleneck.analysis` splits each step into dataloader wait, forward, backward,
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
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par3d.callbacks.bottleneck.advising import advise_from_run, calibrate_if_advising, measured
from lightning_par3d.callbacks.bottleneck.analysis import BACKWARD, FORWARD, OPTIMIZER, STEP, analyze_steps, mean_step
from lightning_par3d.callbacks.bottleneck.context import batch_facts, report_context
from lightning_par3d.callbacks.bottleneck.findings import RankSummary, diagnose, with_advice
from lightning_par3d.callbacks.bottleneck.sampling import StepSampler, mark_stage_calls
from lightning_par3d.callbacks.bottleneck.trace import gather_on_rank_zero, last_step_blocks, read_events
from lightning_par3d.callbacks.bottleneck.writing import console_summary, write_report
from lightning_par3d.callbacks.run_context import output_directory, par3d_engine, pp_rank, unconfigured_copy
from lightning_par3d.utils.torch_private import schedule_stages

TRACES = ("rank0", "all", "none")
"""Which ranks' Chrome traces :class:`BottleneckReport` keeps."""


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
        self._sampler = StepSampler(skip_first, steps)
        self._unconfigured: Any = None
        self._facts: dict[str, Any] = {}

    # ---------------------------------------------------------------- sampling
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
                mark_stage_calls(stage)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._sampler.stop_if_done()
        if self._sampler.sampling:
            if "tokens" not in self._facts:
                self._facts.update(batch_facts(batch))
            self._sampler.open(STEP)
            self._sampler.open(FORWARD)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._sampler.marking:
            self._sampler.close()
            self._sampler.open(BACKWARD)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._sampler.marking:
            self._sampler.close()
            self._sampler.open(OPTIMIZER)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sampler.step_ended()

    # ---------------------------------------------------------------- report
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Every rank measures its sampled steps; rank 0 gathers them, diagnoses, predicts (``advise``) and writes
        the report: one job per step below, each a function of this package or of the planning services."""
        if self._sampler.profiler is None:
            return
        directory, rank = output_directory(trainer, self.dirpath), trainer.global_rank
        trace = directory / f"trace_rank{rank}.json"
        self._sampler.finish(trace)
        pp = getattr(getattr(trainer.strategy, "layout", None), "pp", 1) > 1
        events = read_events(trace)
        self._keep_or_drop(trace, rank)
        steps = analyze_steps(events, pp)
        everyone = gather_on_rank_zero(self._figures(trainer, steps, events, pp))
        engine = par3d_engine(trainer)
        advising = self.advise and engine is not None and engine.placement.is_set_up and len(steps) > 0
        machine = calibrate_if_advising(engine, advising)  # every rank at once
        if everyone is None:
            return
        plan_copy = copy.deepcopy(self._unconfigured) if advising else None  # before report_context configures its own
        self.summaries = [RankSummary(r["rank"], r["pp_rank"], r["step"]) for r in everyone]
        context = report_context(trainer, len(steps), self._facts, self._unconfigured)
        self.findings = diagnose(self.summaries, context)
        if advising:
            self.measured = measured(everyone)
            self.advice, self.advice_error = advise_from_run(
                engine, plan_copy, machine, self.measured, context, self._facts
            )
            self.findings = with_advice(self.findings, self.advice)
        self.report_path, self.timeline_path = write_report(
            directory, everyone, self.summaries, self.findings, context, self.advice, self.advice_error
        )
        if self.verbose:
            said = (self.summaries, self.findings, context, self.advice, self.advice_error)
            rank_zero_info(console_summary(*said, self.report_path, self.traces, trace))

    def _keep_or_drop(self, trace: Path, rank: int) -> None:
        """Keeps this rank's Chrome trace where ``traces`` says so, else deletes it (it has been read)."""
        if self.traces == "all" or (self.traces == "rank0" and rank == 0):
            self.trace_path = trace
        else:
            trace.unlink(missing_ok=True)

    @staticmethod
    def _figures(trainer: L.Trainer, steps: list[Any], events: list[Any], pp: bool) -> dict[str, Any]:
        """This rank's figures, to gather: its mean step's buckets, each sampled cycle, the last step's blocks."""
        return {
            "rank": trainer.global_rank,
            "pp_rank": pp_rank(trainer),
            "step": mean_step(steps),
            "cycles": [s.cycle_us for s in steps],
            "blocks": last_step_blocks(events, pp),
        }
