"""MemoryStats and BottleneckReport: figures checked against independent counts, bottlenecks found where they were
put, buckets that account for the measured step, and pictures that decode."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_par3d.callbacks.bottleneck.analysis import Event, analyze_steps
from lightning_par3d.callbacks.intervals import intersect, length, merge, subtract

# ---------------------------------------------------------------- unit: intervals and attribution


def test_interval_arithmetic():
    assert merge([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert length([(0, 2), (1, 3), (5, 6)]) == 4
    assert intersect([(0, 5)], [(1, 2), (4, 9)]) == [(1, 2), (4, 5)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def _step(start: float, forward: float, backward: float, end: float) -> list[Event]:
    return [
        Event("par3d/step", start, end, 1),
        Event("par3d/forward", start, forward, 1),
        Event("par3d/backward", forward, backward, 1),
        Event("par3d/optimizer", backward, end, 1),
    ]


def test_exposed_collective_time_is_what_compute_does_not_cover():
    """A worker-thread all-reduce of 40 µs overlapping 30 µs of backward compute exposes 10 µs, as dp time; a
    blocking DTensor wait of 5 µs in forward is tensor-parallel time; a 20 µs DataLoader call before the step is
    the dataloader's."""
    events = [
        *_step(0, 10, 20, 30),  # the step that opens the window
        Event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 40, 60, 1),
        *_step(60, 100, 160, 200),
        Event("aten::mm", 60, 95, 1),
        Event("_c10d_functional::wait_tensor", 95, 100, 1),
        Event("autograd::engine::evaluate_function: MmBackward0", 100, 150, 1),
        Event("c10d::allreduce_", 120, 121, 1),
        Event("gloo:all_reduce", 120, 160, 7),
        Event("aten::add_", 160, 190, 1),
    ]
    (step,) = analyze_steps(events, pp=False)
    assert step.cycle_us == 170  # from the previous step's end (30) to this one's (200)
    assert step.buckets["dataloader"] == 20
    assert step.buckets["tp_comm"] == 5
    assert step.buckets["dp_comm"] == 10  # 150..160: the backward's compute ended, the all-reduce had not
    assert step.buckets["forward"] == 35
    assert step.buckets["backward"] == 50
    assert step.buckets["optimizer"] == 40
    assert step.buckets["loop"] == 10  # from the previous step's end (30) to this one's start (60), but the dataloader
    assert step.accounted_us == step.cycle_us


def test_pipeline_time_is_the_schedule_outside_stage_compute():
    events = [
        *_step(0, 10, 20, 30),
        *_step(30, 130, 130, 140),
        Event("par3d/pp/F s0 mb0", 32, 52, 1),
        Event("c10d::send", 52, 53, 1),
        Event("gloo:send", 52, 90, 1),  # the send's lifetime, while the rank waits for its neighbour
        Event("par3d/pp/B s0 mb0", 90, 125, 1),
        Event("aten::mm", 92, 120, 1),
    ]
    (step,) = analyze_steps(events, pp=True)
    assert step.buckets["forward"] == 20
    assert step.buckets["backward"] == 35
    assert step.buckets["pipeline"] == 100 - 20 - 35
    assert step.buckets["optimizer"] == 10


# ---------------------------------------------------------------- real runs


class SlowWindows(torch.utils.data.Dataset):
    """The training windows, each taking ``delay`` seconds to load."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return self.inner[i]


class WallClock(L.Callback):
    """Each batch's end, by ``time.perf_counter``: a step time measured apart from the profiler."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def observed_job(
    strategy: dict,
    devices: int,
    out: str,
    delay: float = 0.0,
    steps: int = 10,
    estimate: bool = False,
    advise: bool = False,
) -> dict:
    """10 steps with ``MemoryStats`` and ``BottleneckReport`` sampling 3 steps; what they measured, and what each
    rank holds counted apart. The estimate and the advice (each a fresh interpreter on rank 0 at the end of fit)
    where asked for."""
    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from lightning_par3d.callbacks import BottleneckReport, MemoryStats
    from lightning_par3d.memory.meters import optimizer_state_tensors
    from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, trainer_kwargs

    class Data(ShakespeareDataModule):
        def setup(self, stage: str | None = None) -> None:
            super().setup(stage)
            if delay:
                self.train_set = SlowWindows(self.train_set, delay)

    L.seed_everything(0, verbose=False)
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    memory = MemoryStats(dirpath=out, log_every_n_steps=1, estimate=estimate)
    report = BottleneckReport(skip_first=3, steps=3, dirpath=out, advise=advise)
    logger = L.pytorch.loggers.CSVLogger(out, name="logs")
    kwargs = trainer_kwargs(max_steps=steps, logger=logger)
    clock = WallClock()  # last: its time stamps close each step after the others' work
    trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=[memory, report, clock], **kwargs)
    module = GPTModule(**{**MODEL, "n_layer": 4})
    data = Data(batch_size=GLOBAL_BATCH // par3d.layout.dp, **{**DATA, "max_bytes": 20_000})
    trainer.fit(module, data)
    from lightning_par3d.parallel.tensor_parallel import local_tensor

    params = [local_tensor(p) for p in module.parameters()]
    states = [local_tensor(t) for opt in trainer.optimizers for t in optimizer_state_tensors(opt)]
    return {
        "records": [vars(r) for r in memory.records],
        "independent": {
            "params": sum(p.numel() * p.element_size() for p in params),
            "optimizer": sum(t.numel() * t.element_size() for t in states),
        },
        "estimated": memory.estimated,
        "findings": [(f.bucket, f.fraction, f.severity) for f in report.findings],
        "suggestions": [f.suggestion for f in report.findings],
        "advice": report.advice,
        "advice_error": report.advice_error,
        "steps": [(s.rank, s.step.cycle_us, s.step.accounted_us) for s in report.summaries],
        "buckets": [(s.rank, s.step.cycle_us, dict(s.step.buckets)) for s in report.summaries],
        "batch_size": data.batch_size,
        # The analyzed steps are batches 4-6 (skip_first=3: batch 3 opens the window): their wall-clock cycles.
        "wall_us": [(b - a) * 1e6 for a, b in zip(clock.ends[2:5], clock.ends[3:6], strict=True)],
        "log_dir": str(trainer.logger.log_dir),
    }


def _png(path: Path) -> tuple[int, ...]:
    import matplotlib.image

    return matplotlib.image.imread(path).shape


@pytest.fixture(scope="module")
def observed_dp2_tp2(pool4: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """One observed run at dp_shard=2 × tp=2 with the estimate, for the tests of both callbacks."""
    out = tmp_path_factory.mktemp("observed_dp2_tp2")
    return pool4.run(observed_job, strategy=dict(dp_shard=2, tp=2), devices=4, out=str(out), estimate=True), out


def test_memory_stats_match_independent_counts(pool4, observed_dp2_tp2):
    """dp_shard=2 × tp=2 (every dimension divisible: no padding). Parameter bytes equal the sum of each rank's
    local shards, optimizer bytes the sum of its state tensors; activations agree with the estimator's."""
    results, tmp_path = observed_dp2_tp2
    for rank, got in enumerate(results):
        records = got["records"]
        assert [r["step"] for r in records] == list(range(1, 11))
        last = records[-1]
        assert last["params"] == last["params_peak"] == got["independent"]["params"], rank
        assert last["grads_peak"] == got["independent"]["params"]  # FSDP2 gradient shards: the parameters' size
        assert last["optimizer"] == got["independent"]["optimizer"]
        assert last["activations_peak"] > 0
    estimate = results[0]["estimated"]
    assert estimate is not None, "the estimate child failed"
    row = estimate.rows[0]
    measured = max(r["activations_peak"] for r in results[0]["records"][1:])
    assert abs(row.activations - measured) <= 0.25 * measured
    assert row.state.params == results[0]["records"][-1]["params"]
    # Logged for every rank, under the documented names; the CSV, the plot.
    import csv

    rows = list(csv.DictReader((Path(results[0]["log_dir"]) / "metrics.csv").open()))
    for rank in range(4):
        values = [r[f"memory/rank{rank}/params_mib"] for r in rows if r.get(f"memory/rank{rank}/params_mib")]
        assert len(values) == 10 and float(values[-1]) == pytest.approx(results[rank]["independent"]["params"] / 2**20)
    assert (tmp_path / "memory_stats.csv").read_text().count("\n") == 1 + 10 * 4
    height, width, _ = _png(tmp_path / "memory_stats.png")
    assert width > 400 and height > 200


def estimate_after_another_strategy_job(out: str) -> bool:
    """Lightning's own ModelParallelStrategy trains at dp2×tp2, then par3d with MemoryStats at the same layout, in
    the same processes (a notebook comparing the two); whether rank 0 got its estimate."""
    from benchmarks.bench_strategies import timed_run
    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from lightning_par3d.callbacks import MemoryStats
    from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, trainer_kwargs

    timed_run(name="ModelParallel dp2×tp2", steps=2, warmup=1)
    L.seed_everything(0, verbose=False)
    memory = MemoryStats(dirpath=out, log_every_n_steps=1, verbose=False)
    par3d = Par3DStrategy(timeout_s=120, dp_shard=2, tp=2)
    trainer = L.Trainer(devices=4, strategy=par3d, callbacks=[memory], **trainer_kwargs(max_steps=2))
    trainer.fit(GPTModule(**MODEL), ShakespeareDataModule(batch_size=GLOBAL_BATCH // 2, **DATA))
    return memory.estimated is not None


def test_the_estimate_survives_dtensor_caches_of_an_earlier_run(pool4, tmp_path: Path):
    """The estimate runs over fake groups in a fresh interpreter. DTensor's caches (sharding decisions, redistribute
    plans) are keyed by mesh equality: an entry left from an equal mesh of an earlier run in this process would hand
    an estimator running here the run's groups ("Could not resolve the process group"); a new interpreter has none."""
    assert pool4.run(estimate_after_another_strategy_job, out=str(tmp_path))[0], "the estimate child failed"


def test_a_slow_dataloader_is_measured_and_named_with_its_fix(pool2, tmp_path: Path):
    """Each sample takes at least 0.2 s to load (a sleep never returns early): every sampled step's dataloader
    bucket holds at least the batch's sleeps and at most the step's measured cycle, and the report names the wait
    with its fix. Which bucket tops a report depends on how loaded the machine is (the rest of the step stretches
    with the load, a sleep does not), so the ranking is tested on fixed buckets
    (``test_bottleneck_findings.test_the_findings_rank_the_buckets_by_their_share_of_the_step``)."""
    results = pool2.run(observed_job, strategy=dict(dp_shard=2), devices=2, out=str(tmp_path), delay=0.2)
    slept_us = 0.2e6 * results[0]["batch_size"]
    steps = results[0]["buckets"]  # each rank's mean of the sampled steps
    assert sorted(rank for rank, _, _ in steps) == [0, 1]
    for _, cycle_us, buckets in steps:
        assert slept_us <= buckets["dataloader"] <= cycle_us, (slept_us, buckets["dataloader"], cycle_us)
    findings = {bucket: severity for bucket, _, severity in results[0]["findings"]}
    assert findings["dataloader"] != "low", results[0]["findings"]
    report = (tmp_path / "bottleneck_report.md").read_text()
    assert "dataloader wait" in report and "raise num_workers (now 0)" in report


def test_the_pipeline_bubble_is_the_top_bottleneck_at_pp4_with_4_microbatches(pool4, tmp_path: Path):
    """The bubble tops the report, and its suggestion is a change predicted from the run's own buckets (or that none
    is predicted to help), each change weighed with its predicted step in the report."""
    results = pool4.run(observed_job, strategy=dict(pp=4, microbatches=4), devices=4, out=str(tmp_path), advise=True)
    findings = results[0]["findings"]
    assert findings[0][0] == "pipeline", findings
    assert results[0]["advice_error"] is None and results[0]["advice"]
    assert all(a.predicted_s is not None or a.reason for a in results[0]["advice"])
    weighed = {a.change.description for a in results[0]["advice"]}
    assert {"microbatches=8", "microbatches=2", "pipeline_schedule=gpipe"} <= weighed, weighed
    pipeline = results[0]["suggestions"][0]
    assert "step " in pipeline and " ms (" in pipeline and ("try " in pipeline or "every change weighed" in pipeline)
    report = (tmp_path / "bottleneck_report.md").read_text()
    assert "## Changes weighed, with their predicted step" in report and "| microbatches=8 | pipeline |" in report
    _assert_buckets_account_for_the_step(results)
    height, width, _ = _png(tmp_path / "pipeline_timeline.png")
    assert width > 400 and height > 150
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())  # rank 0's kept, by default
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "par3d/step" in names and any(str(n).startswith("par3d/pp/F") for n in names)
    assert not any((tmp_path / f"trace_rank{rank}.json").exists() for rank in (1, 2, 3))


def test_buckets_account_for_the_measured_step_with_tp_and_dp(pool4, observed_dp2_tp2):
    results, _ = observed_dp2_tp2
    _assert_buckets_account_for_the_step(results)
    findings = dict((bucket, fraction) for bucket, fraction, _ in results[0]["findings"])
    assert findings["tp_comm"] > 0 and findings["dp_comm"] > 0  # both kinds of collectives were seen


def _assert_buckets_account_for_the_step(results: list[dict]) -> None:
    """Every rank's buckets (from profiler events) sum to its step time as a wall clock measured it apart (the
    mean over the sampled steps, from one step's end to the next) within 10 %."""
    steps = results[0]["steps"]
    assert len(steps) == len(results)
    for rank, _, accounted in steps:
        wall = sum(results[rank]["wall_us"]) / len(results[rank]["wall_us"])
        assert abs(wall - accounted) <= 0.10 * wall, (
            f"rank {rank}: buckets {accounted:.0f} µs, wall clock {wall:.0f} µs"
        )


def test_the_report_refuses_an_unknown_traces_choice():
    from lightning_par3d.callbacks import BottleneckReport

    with pytest.raises(ValueError, match=r"traces='every'.*'rank0', 'all', 'none'"):
        BottleneckReport(traces="every")
