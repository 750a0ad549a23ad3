"""The benchmark scripts still run (a few steps each), so that they cannot rot unnoticed between uses."""

from __future__ import annotations

import math

import pytest


@pytest.mark.parametrize("name", ["par3d dp2×tp2", "ModelParallel dp2×tp2", "par3d dp_replicate=4", "DDP dp=4"])
def test_strategy_benchmark_runs(pool4, name):
    from benchmarks.bench_strategies import timed_run

    times = pool4.run(timed_run, name=name, steps=3, warmup=1)[0]
    assert len(times) == 2 and all(t > 0 for t in times)


def test_bubble_benchmark_runs(pool4):
    from benchmarks.bench_pipeline_bubble import bubble_run

    got = pool4.run(bubble_run, schedule="gpipe", microbatches=4, virtual=1, steps=3)[0]
    assert 0.0 < got["idle"] < 1.0 and not math.isnan(got["idle"])
    assert got["inflight"] == 4  # GPipe keeps every microbatch in flight
    assert got["peak_mib"] > 0


def test_zero_benchmark_runs(pool2):
    from benchmarks.bench_zero import predicted, zero_run

    got = pool2.run(zero_run, stage=2, devices=2, steps=3, warmup=1)[0]
    assert len(got["times"]) == 2
    formula, estimate = predicted(2, 2, got["shapes"])
    assert got["state"].total == formula == estimate


def test_callbacks_benchmark_runs(pool4):
    from benchmarks.bench_callbacks import throughput_run

    # The estimate and the advice at the end of fit are left out: they run outside the timed window, and
    # test_callbacks checks them.
    assert pool4.run(throughput_run, observe=True, steps=10, end_of_fit=False)[0] > 0


def test_async_save_benchmark_runs(pool2, tmp_path):
    import json

    from benchmarks.bench_async_save import launched_run

    out = tmp_path / "timings.json"
    pool2.run(launched_run, mode="async", steps=3, every=1, n_embd=32, n_layer=2, out=out)
    got = json.loads(out.read_text())
    assert len(got["saves"]) >= 3 and len(got["steps"]) == 3 and got["params"] > 0


def test_compile_benchmark_runs(pool4):
    """Its eager side (the compiled side is tests/test_compile.py's inductor case)."""
    from benchmarks.bench_compile import timed_run

    times = pool4.run(timed_run, layout="dp2xtp2", compiled=False, steps=3)[0]
    assert len(times) == 3 and all(t > 0 for t in times)
