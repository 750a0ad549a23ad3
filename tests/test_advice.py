"""The bottleneck report's advice (``lightning_par3d.planning.advice``): every change it weighs is predicted from
what the run measured, through the planner's cost model, and suggested only where predicted to help beyond the
run's noise."""

from __future__ import annotations

import dataclasses

import pytest

from examples.gpt import GPTModule
from lightning_par3d import Par3DConfig
from lightning_par3d.planning.advice import Measured, advise, mean_buckets
from lightning_par3d.planning.machine import machine_profile
from lightning_par3d.planning.planner import evaluate
from tests.constants import MODEL

PIPELINE = Par3DConfig(pp=2, microbatches=4)
"""The run weighed: 2 pipeline ranks, 1F1B over 4 microbatches of a per-rank batch of 8."""
BATCH = dict(rank_batch=8, seq_len=32)


def _as_predicted(machine: object, noise: float = 0.02, scale: float = 1.0) -> Measured:
    """A run that measured what the cost model predicts for its own layout (times ``scale``)."""
    [row] = evaluate(GPTModule(**MODEL), [PIPELINE], 2, 2, "1GiB", machine=machine, **BATCH)
    buckets = mean_buckets(row.time)
    step = sum(buckets.values()) * scale
    return Measured(step, *(buckets[name] * scale for name in ("compute", "tp_comm", "dp_comm", "bubble")),
                    other=0.0, dataloader=0.0, noise=noise)  # fmt: skip


def _weighed(machine: object, measured: Measured) -> dict[str, object]:
    advice = advise(GPTModule(**MODEL), PIPELINE, 2, 2, "1GiB", measured, precision="32-true", machine=machine, **BATCH)
    return {a.change.description: a for a in advice}


def test_more_microbatches_are_not_suggested_where_each_costs_more_than_the_bubble_it_saves():
    """Where every op has a fixed cost (a CPU, or a GPU at a small model's batch), twice the microbatches is twice
    the ops: the step is predicted slower, so "raise microbatches" is weighed and not suggested (issue 26: it made
    the demo 1.9× slower)."""
    cpu_like = machine_profile("h100-sxm-8", op_overhead_s=2e-3, async_kernels=False)
    more = _weighed(cpu_like, _as_predicted(cpu_like))["microbatches=8"]
    assert more.predicted_s is not None and more.predicted_s > more.measured_s
    assert not more.suggested and "+" in more.line()


def test_more_microbatches_are_suggested_where_the_bubble_is_what_costs():
    """Where the arithmetic is all there is (no fixed cost per op), the same change shrinks the bubble and nothing
    grows: predicted faster, and suggested."""
    arithmetic = machine_profile("h100-sxm-8", op_overhead_s=0.0, dtensor_op_overhead_s=0.0,
                                 matmul_flops={"fp32": 1e9, "bf16": 1e9, "fp16": 1e9})  # fmt: skip
    more = _weighed(arithmetic, _as_predicted(arithmetic))["microbatches=8"]
    assert more.predicted_s is not None and more.predicted_s < 0.95 * more.measured_s
    assert more.suggested


def test_predictions_follow_the_measurement_and_stay_silent_within_the_noise():
    """A run measured twice as slow as the model predicts, bucket by bucket: every change is predicted twice as
    slow as the model alone says, so the ratios hold; and with noise as large as any gain, nothing is suggested."""
    arithmetic = machine_profile("h100-sxm-8", op_overhead_s=0.0, dtensor_op_overhead_s=0.0,
                                 matmul_flops={"fp32": 1e9, "bf16": 1e9, "fp16": 1e9})  # fmt: skip
    once, twice = (
        _weighed(arithmetic, _as_predicted(arithmetic)),
        _weighed(arithmetic, _as_predicted(arithmetic, 0.02, 2)),
    )
    for name, advice in once.items():
        if advice.predicted_s is not None:
            assert twice[name].predicted_s == pytest.approx(2 * advice.predicted_s, rel=1e-9), name
    noisy = _weighed(arithmetic, dataclasses.replace(_as_predicted(arithmetic), noise=0.9))
    assert not any(a.suggested for a in noisy.values())


def test_the_zero_bubble_split_keeps_the_calibrations_figure():
    """The split of each backward into ``I`` and ``W`` is Python walking the graph, priced by the calibration: a run
    whose ops took 3× the model's takes 3× for them and the split as measured, both ways (learning and
    predicting)."""
    from lightning_par3d.planning.advice import corrected_step, corrections
    from lightning_par3d.planning.cost import StepTime

    zbv = StepTime(1.0, 0.0, 0.0, 0.0, 0, ((1.0, 0.0, 0.0, 0.0),), (24,), (0.4,))  # 0.4 s of its 1.0 the split
    measured = Measured(2.2, 0.6 * 3 + 0.4, 0.0, 0.0, 0.0, other=0.0, dataloader=0.0, noise=0.0)
    factors = corrections(measured, zbv)
    assert factors["compute"] == pytest.approx(3.0)
    assert corrected_step(zbv, factors, other=0.0) == pytest.approx(2.2)


def test_every_change_weighed_is_a_valid_layout():
    """The changes weighed at the demo's layout and at a wider one each resolve (HSDP only where dp_shard leaves at
    least 2 ranks to shard over)."""
    from lightning_par3d.config import resolve_layout
    from lightning_par3d.planning.advice import candidate_changes, configs_of

    for sizes, world in ((dict(pp=2, dp_shard=2, tp=2, microbatches=4), 8), (dict(dp_shard=8), 8)):
        config = Par3DConfig(**sizes)
        layout = resolve_layout(config, world)
        assert layout is not None
        changes = candidate_changes(config, layout, rank_batch=8, num_workers=0)
        for change, changed in zip(changes, configs_of(config, layout, changes)[1:], strict=True):
            assert resolve_layout(changed, world) is not None, change.description
        assert any("HSDP" in c.description for c in changes) == (layout.dp_shard >= 4)
