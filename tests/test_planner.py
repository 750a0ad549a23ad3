"""The planner (``lightning_par3d.planning``): every layout listed, each one's memory the estimator's, the pipeline
bubble the schedule's, reasons for what cannot run, clear errors for bad input, ``fixed`` sizes, the cost formulas,
the calibration's fit, and the command line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from examples.gpt import GPT, GPTConfig, GPTModule
from lightning_par3d import Par3DConfig, estimate_memory, resolve_layout
from lightning_par3d.distributed.fakeworld import forget_meshes
from lightning_par3d.planning import Link, Machine, SearchSpace, choose_layout, machine_profile, plan, schedule_bubble
from lightning_par3d.planning.candidates import candidates
from lightning_par3d.planning.cost import (
    all_gather,
    all_reduce,
    all_to_all,
    data_parallel_collectives,
    group_link,
    predict_step,
    reduce_scatter,
    send,
)
from lightning_par3d.planning.machine import format_bytes
from lightning_par3d.planning.probe import StageParams, StageWork
from lightning_par3d.planning.table import PlanRow, layout_kind, to_measure
from tests.constants import MODEL

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ = 16, 32
DEEP = {**MODEL, "n_layer": 4}


def _plan(world: int, **kwargs: object) -> object:
    options = dict(devices_per_node=world, device_memory="1GiB", global_batch=BATCH, seq_len=SEQ)
    options.update(kwargs)
    return plan(GPTModule(**MODEL), world, machine="h100-sxm-8", **options)


@pytest.fixture(scope="module")
def tables() -> dict[int, object]:
    """The example GPT's plan at 4 and 8 ranks (computed once for the module)."""
    return {world: _plan(world) for world in (4, 8)}


def _estimate(row: object, world: int, module: object = None) -> object:
    with forget_meshes():  # the estimator, called for many layouts in one process, needs DTensor's cache cleared
        return estimate_memory(module or GPTModule(**MODEL), row.config, world, (BATCH // row.layout.dp, SEQ))


def _key(config: Par3DConfig) -> tuple:
    return (
        config.pp, config.dp_replicate, config.dp_shard, config.cp, config.tp, config.zero_stage,
        config.pipeline_schedule, config.virtual_stages, config.microbatches, config.activation_checkpointing,
    )  # fmt: skip


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize("world", [4, 8])
def test_every_layout_resolve_layout_accepts_is_listed(tables, world):
    """Each configuration of the search space that resolve_layout accepts is a row: fitting, or with a reason (cp = 1
    alone here, where the plan does not search cp: see the tests of context parallelism below)."""
    table = tables[world]
    listed = {_key(row.config) for row in table}
    accepted = 0
    for config in candidates(world, SearchSpace(context_parallel=(1,)), {}, Par3DConfig()):
        try:
            layout = resolve_layout(config, world)
        except ValueError:
            continue
        accepted += 1
        if layout.zero == 0 and config.dp_shard not in (1, "auto"):
            continue  # zero_stage=0 over dp_shard is replication, listed once as such
        assert _key(config) in listed
    assert accepted > 20 and len(table.fitting) > 10
    assert all(row.fits == (row.reason is None) for row in table)
    assert [row.time.total for row in table.fitting] == sorted(row.time.total for row in table.fitting)


def _sample(table: object, per_class: int, by_microbatches: bool = True) -> list[object]:
    """Rows covering every kind of layout: per (pp, tp, ZeRO, replicas, schedule kind, microbatches, checkpointing),
    the first ``per_class`` rows (without ``by_microbatches``, the microbatch count does not make a kind)."""
    taken: dict[tuple, int] = {}
    rows = []
    for row in table:
        if row.memory is None:
            continue
        layout, config = row.layout, row.config
        microbatches = config.microbatches if layout.pp > 1 and by_microbatches else 0
        kind = (layout.pp, layout.tp, layout.zero, layout.dp_replicate > 1, layout.stages_per_rank, microbatches,
                config.activation_checkpointing)  # fmt: skip
        if taken.get(kind, 0) < per_class:
            taken[kind] = taken.get(kind, 0) + 1
            rows.append(row)
    return rows


def test_memory_is_the_estimators_for_every_kind_of_layout_at_four_ranks(tables):
    """A row of every kind of layout at 4 ranks (the same comparison over all of them passed: 56 of 56)."""
    rows = _sample(tables[4], per_class=1)
    assert len(rows) >= 20
    for row in rows:
        assert row.memory == _estimate(row, 4), row.describe()


def test_memory_is_the_estimators_at_eight_ranks(tables):
    """At 8 ranks, a row of every kind of layout but the microbatch count, which the 4-rank test varies (the same
    comparison over all of them passed: 114 of 114)."""
    rows = _sample(tables[8], per_class=1, by_microbatches=False)
    assert len(rows) > 15
    for row in rows:
        assert row.memory == _estimate(row, 8), row.describe()


def test_memory_is_the_estimators_with_checkpointing_and_bf16_and_deeper_pipelines():
    """bf16-mixed (FSDP2 gathers in bf16), checkpointing, 4 blocks (looped and V schedules, pp=4) under a memory
    limit that leaves some layouts out: a layout of each pipeline schedule and checkpointing mode, and ZeRO-3
    without pipelining (the other stages: the fp32 tests above). (The same comparison over every mode, schedule and
    ZeRO stage, 288 layouts in all, passed too; the V schedule stands for the schedules of two stages per rank.)"""
    module = GPTModule(**DEEP)
    space = SearchSpace(
        activation_checkpointing=("none", "full"),
        schedules=("1f1b", "zbv_zero_bubble"),
        microbatch_multiples=(1,),
        zero_stages=(3,),
    )
    table = plan(module, 4, 4, "1MiB", global_batch=BATCH, seq_len=SEQ, precision="bf16-mixed", search=space)
    assert table.fitting and any("more than the" in (row.reason or "") for row in table)
    rows, kinds = [], set()
    for row in table:
        if row.memory is None:
            continue
        kind = (row.layout.pp, row.config.pipeline_schedule if row.layout.pp > 1 else None,
                row.config.activation_checkpointing, row.layout.zero if row.layout.pp == 1 else None)  # fmt: skip
        if kind not in kinds:
            kinds.add(kind)
            rows.append(row)
    assert {row.layout.pp for row in rows} == {1, 2, 4} and len(rows) > 8
    for row in rows:
        with forget_meshes():
            got = estimate_memory(module, row.config, 4, (BATCH // row.layout.dp, SEQ), precision="bf16-mixed")
        assert row.memory == got, row.describe()


def test_estimates_that_share_stage_measures_equal_their_own_and_measure_fewer_stages(monkeypatch):
    """The planner's estimates share each stage role's measures by depth where the settings they depend on agree
    (:class:`~lightning_par3d.memory.stage_measure.SharedMeasures`): layouts that differ in their stage count,
    schedule or data-parallel split measure a role's blocks once, and every estimate equals the one it makes alone."""
    from lightning_par3d.memory import stage_measure

    calls = {"n": 0}
    own_measure = stage_measure._Part.measure

    def counted(*args, **kwargs):
        calls["n"] += 1
        return own_measure(*args, **kwargs)

    monkeypatch.setattr(stage_measure._Part, "measure", counted)
    configs = [
        Par3DConfig(pp=2, dp_shard=2, microbatches=2),
        Par3DConfig(pp=2, dp_shard=2, microbatches=2, pipeline_schedule="gpipe"),  # another schedule: no new measure
        Par3DConfig(pp=4, microbatches=4, activation_checkpointing="full"),
        Par3DConfig(pp=4, microbatches=4, activation_checkpointing="full", pipeline_schedule="gpipe"),
    ]
    shared, module = stage_measure.SharedMeasures(), GPTModule(**DEEP)
    together, alone = {"n": 0}, {"n": 0}
    for config in configs:
        batch = (BATCH // resolve_layout(config, 4).dp, SEQ)
        estimates = []
        for count, measures in ((together, shared), (alone, None)):
            before = calls["n"]
            with forget_meshes():
                estimates.append(estimate_memory(module, config, 4, batch, shared_measures=measures))
            count["n"] += calls["n"] - before
        assert estimates[0] == estimates[1], config
    assert 0 < together["n"] < alone["n"], (together, alone)


def test_rejected_layouts_carry_their_reason(tables):
    table = tables[8]
    reasons = {row.describe(): row.reason for row in table.rejected}
    assert all(reasons.values())
    assert any("head count" in r and "tp=8" in r for r in reasons.values())  # the model cannot split its heads
    assert any("Number of stages" in r for r in reasons.values())  # more stages than blocks
    assert any("zero_stage=2" in r for r in reasons.values())  # resolve_layout's own message
    across = _plan(8, devices_per_node=2)
    assert all("across nodes" in row.reason for row in across if row.layout and row.layout.tp > 2)
    with pytest.raises(ValueError, match=r"can run:\n  - \d+× tp=4 puts tensor-parallel groups across nodes"):
        _plan(8, fixed={"tp": 4}, devices_per_node=2)


def test_layouts_that_do_not_fit_say_what_they_need():
    table = plan(GPTModule(**MODEL), 4, 4, "700KiB", global_batch=BATCH, seq_len=SEQ)
    too_big = [row for row in table.rejected if row.memory is not None]
    assert too_big and table.fitting
    for row in too_big:
        assert row.memory.peak > 700 * 2**10 and "more than the 700.00 KiB of a device" in row.reason
    assert all(row.memory.peak <= 700 * 2**10 for row in table.fitting)
    # By reason, they share one line (a real-sized model rejects thousands, each with its own figures), closest first.
    closest = min(too_big, key=lambda row: row.memory.peak)
    lines = [line for line in table.to_markdown(group_rejected=True).splitlines() if "of a device" in line]
    assert len(lines) == 1 and f"| {len(too_big)}: {closest.describe()}" in lines[0]
    assert f"of a device ({format_bytes(closest.memory.peak)} to " in lines[0]


def test_checkpointing_is_tried_where_a_layout_does_not_fit_without_it():
    table = plan(GPTModule(**MODEL), 4, 4, "700KiB", global_batch=BATCH, seq_len=SEQ)
    plain_fits = {row.layout for row in table.fitting if row.config.activation_checkpointing == "none"}
    for row in table:
        if row.config.activation_checkpointing != "none" and row.layout in plain_fits:
            assert row.reason.startswith("fits without activation checkpointing")
    assert any(row.config.activation_checkpointing == "full" and row.memory is not None for row in table)


def test_fixed_sizes_constrain_the_search():
    table = _plan(8, fixed={"tp": 2, "zero_stage": 3})
    assert all(row.config.tp == 2 for row in table)
    assert all(row.layout.zero == 3 for row in table.fitting if row.layout.dp_shard > 1)
    pipelined = _plan(4, fixed={"pp": 2, "pipeline_schedule": "gpipe", "microbatches": 4})
    assert {(r.config.pp, r.config.pipeline_schedule, r.config.microbatches) for r in pipelined} == {(2, "gpipe", 4)}


LONG = {**MODEL, "block_size": 1024}
"""The example GPT at a sequence 32× the reference runs': activations dominate its memory."""


def _estimated(row: object, world: int, model: dict, seq: int, batch: int) -> object:
    with forget_meshes():
        return estimate_memory(GPTModule(**model), row.config, world, (batch // row.layout.dp, seq))


def test_context_parallel_is_searched_where_activations_dominate_and_chosen_where_dp_cannot_grow():
    """A global batch of 2 rows of 1024 tokens on 4 ranks: data parallelism stops at 2, so the other 2 ranks go to
    tp, pp or cp. The plan without cp holds more activations than state, so cp = 2 and 4 are searched too; each cp
    row's memory is the estimator's (which runs cp's own slice and gathers), and the fastest layout splits the rows.
    """
    table = plan(GPTModule(**LONG), 4, 4, "12MiB", global_batch=2, seq_len=1024, machine="h100-sxm-8")
    note = next(n for n in table.notes if "cp" in n)
    assert note.startswith("(cp = 2, 4 searched too: the fastest layout without it, pp2") and "dominate" in note
    cp_rows = [row for row in table.fitting if row.layout.cp > 1]
    assert {row.layout.cp for row in cp_rows} == {2, 4} and table.best.layout.cp == 2, table.best.describe()
    assert "cp" in table.best.describe() and table.best.strategy_arguments()["cp"] == 2
    for row in _sample(table, per_class=1, by_microbatches=False):
        if row.layout.cp > 1 or row is table.fitting[0]:
            assert row.memory == _estimated(row, 4, LONG, 1024, 2), row.describe()
    short = plan(GPTModule(**LONG), 4, 4, "12MiB", global_batch=2, seq_len=1022, machine="h100-sxm-8")
    assert "(cp > 1 not searched: no degree that divides 4 ranks has a 2·cp that divides seq_len=1022.)" in short.notes


def test_context_parallel_is_not_searched_where_model_state_dominates(tables):
    """The reference GPT at 32 tokens: its fastest layout is plain data parallelism, whose ranks cp would only give
    the same work and gathers, and the table says so. Pinned, it is searched all the same."""
    assert any(n.startswith("(cp > 1 not searched: the fastest layout without it, pp1·rep4") for n in tables[4].notes)
    assert all(row.config.cp == 1 for row in tables[4])
    pinned = _plan(4, fixed={"cp": 2})
    assert {row.config.cp for row in pinned} == {2} and pinned.fitting
    assert all(row.layout.zero == 3 for row in pinned.fitting)
    with pytest.raises(ValueError, match=r"cp=4 cuts each row into 2·cp = 8 chunks, which seq_len=36 does not divide"):
        _plan(4, fixed={"cp": 4}, seq_len=36)


def test_context_refusal_names_what_the_model_lacks():
    from torch import nn

    from lightning_par3d.planning.context_search import context_refusal
    from lightning_par3d.planning.probe import build_meta

    gpt = build_meta(GPTModule(**MODEL))
    assert context_refusal(gpt, Par3DConfig()) is None
    assert "position_ids" in context_refusal(nn.Linear(4, 4), Par3DConfig())
    assert "token mean" in context_refusal(gpt, Par3DConfig(loss_mean="microbatches"))


def test_expert_parallel_costs_its_all_to_alls_and_shards_the_experts_over_fewer_ranks():
    """ep=2 over dp_shard=4: each block with experts sends its routed rows there and back (two all-to-alls, after a
    latency-only exchange of the counts) in forward, the two again in backward; the compute stays (routing taken as
    balanced); FSDP2 gathers the dense part over 4 ranks and the rank's half of the experts over the 2 that share
    them."""
    link = Link(1e-5, 1e9, all_to_all_factor=1.5)
    machine = Machine("uniform", {"fp32": 1e9}, 0.0, 0.0, 1e30, link, link, async_kernels=False)
    work = StageWork(0, 1e6, 2e6, 0, 0, (1e5, 1e5), (0, 0), (0, 0), (), 0.0, 4, block_routed_bytes=(4e3, 0.0))
    params = StageParams(0, (), (3000, 100), 2, expert_units=((2000, 2000), (0, 0)))
    dense = resolve_layout(Par3DConfig(dp_shard=4), 4)
    split = resolve_layout(Par3DConfig(dp_shard=4, ep=2), 4)
    plain, step = (predict_step(Par3DConfig(), x, [work], [params], 2, machine, 8) for x in (dense, split))
    assert step.compute == pytest.approx(plain.compute) and plain.tp_comm == 0
    exchange = 2 * all_to_all(4e3 * 2, 2, link)
    assert step.tp_comm == pytest.approx(2 * exchange + link.latency_s)
    gathers = data_parallel_collectives(split, [params], "32-true", machine, 8)
    expected = [all_gather(1000 * 4, 4, link), all_gather(1000 * 4, 2, link), all_gather(100 * 4, 4, link)]
    assert sorted(gathers) == pytest.approx(sorted(
        [expected[0]] * 2 + [reduce_scatter(1000 * 4, 4, link)] + [expected[1]] * 2
        + [reduce_scatter(1000 * 4, 2, link)] + [expected[2], reduce_scatter(100 * 4, 4, link)]
    ))  # fmt: skip


def test_context_parallel_costs_its_gathers_and_splits_the_compute():
    """cp=2 halves each rank's FLOPs; each block all-gathers its keys and values (two collectives of half the bytes)
    in forward, reduce-scatters their gradients in backward, and gathers again where checkpointing recomputes it."""
    link = Link(1e-5, 1e9)
    machine = Machine("uniform", {"fp32": 1e9}, 0.0, 0.0, 1e30, link, link, async_kernels=False)
    work = StageWork(0, 1e6, 2e6, 0, 0, (1e5, 1e5), (0, 0), (0, 0), (), 0.0, 4, block_kv_bytes=(4e3, 4e3))
    params = StageParams(0, (), (0,), 0)
    plain = predict_step(Par3DConfig(), resolve_layout(Par3DConfig(dp_shard=1), 1), [work], [params], 2, machine, 8)
    split = resolve_layout(Par3DConfig(cp=2, dp_shard=1), 2)
    step = predict_step(Par3DConfig(), split, [work], [params], 2, machine, 8)
    assert step.compute == pytest.approx(plain.compute / 2)
    gather, scatter = all_gather(4e3, 2, link), reduce_scatter(4e3, 2, link)
    assert step.tp_comm == pytest.approx(2 * 2 * (gather + scatter))
    full = dataclasses.replace(Par3DConfig(), activation_checkpointing="full")
    checkpointed = predict_step(full, split, [work], [params], 2, machine, 8)
    assert checkpointed.tp_comm == pytest.approx(step.tp_comm + 2 * 2 * gather)


def test_choose_layout_is_the_best_row(tables):
    config = choose_layout(GPTModule(**MODEL), 4, 4, "1GiB", global_batch=BATCH, seq_len=SEQ)
    assert isinstance(config, Par3DConfig)
    assert _key(config) == _key(tables[4].best.config)
    resolve_layout(config, 4)


@pytest.mark.parametrize("count", [1, 3, 5])
def test_auto_measures_the_first_choice_then_the_fastest_of_each_pipeline_size(tables, count):
    """layout='auto' measures the plan's first choice, then the fastest prediction of each pipeline size it has not
    measured, then of each engine and ZeRO stage, then of each tensor-parallel size: not near-copies of one kind."""
    fitting = tables[8].fitting
    picked = tables[8].to_measure(count)
    assert len(picked) == count and picked[0] is fitting[0]
    sorts = {(r.layout.pp, r.layout.data_parallel, r.layout.zero, r.layout.tp) for r in picked}
    assert len(sorts) == count  # no near-copies: each differs in its pipeline size, engine, ZeRO stage or tp size
    for row in picked[1:]:  # each the fastest of what it adds: a pipeline size, an engine, a tp size, a kind
        faster = fitting[: fitting.index(row)]
        assert any(
            all(axis(other.layout) != axis(row.layout) for other in faster if other in picked)
            for axis in (lambda x: x.pp, lambda x: (x.data_parallel, x.zero), lambda x: x.tp, layout_kind)
        ), row.describe()
    sizes = sorted({row.layout.pp for row in fitting})
    if count >= len(sizes):
        assert sorted({row.layout.pp for row in picked}) == sizes
    one_kind = [r for r in fitting if layout_kind(r.layout) == layout_kind(fitting[0].layout)]
    assert to_measure(one_kind, 3) == one_kind[:3]  # one kind only: the next fastest fill in


def test_a_plan_whose_fastest_predictions_are_all_pipelines_measures_one_without():
    """The Qwen2 case of issue 50: every one of the five fastest predictions pipelined, plain replication measured
    fastest. The three layouts measured are the first choice, the fastest without a pipeline and the fastest at the
    other pipeline size; then the tensor-parallel sizes."""
    rows = [_row(pp=2, tp=1, rep=2), _row(pp=2, tp=2, rep=1), _row(pp=2, tp=1, shard=2), _row(pp=4, tp=1, rep=1),
            _row(pp=2, tp=1, rep=2, ac="full"), _row(pp=1, tp=1, rep=4), _row(pp=1, tp=2, rep=2)]  # fmt: skip
    picked = to_measure(rows, 3)
    assert [(r.layout.pp, r.layout.tp) for r in picked] == [(2, 1), (4, 1), (1, 1)]
    assert [(r.layout.pp, r.layout.zero) for r in to_measure(rows, 4)] == [(2, 0), (2, 3), (4, 0), (1, 0)]


def _row(pp: int, tp: int, rep: int = 1, shard: int = 1, ac: str = "none") -> PlanRow:
    config = Par3DConfig(pp=pp, tp=tp, dp_replicate=rep, dp_shard=shard, activation_checkpointing=ac)
    return PlanRow(config=config, layout=resolve_layout(config, pp * tp * rep * shard), rank_batch=1, accumulate=1)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(world_size=0), r"world_size=0: give the number of ranks"),
        (dict(devices_per_node=0), r"devices_per_node=0"),
        (dict(world_size=12, devices_per_node=8), r"world_size=12 is not a whole number of nodes"),
        (dict(device_memory="lots"), r"device_memory='lots' is not a size"),
        (dict(global_batch=0), r"global_batch=0"),
        (dict(precision="64-true"), r"precision='64-true'"),
        (dict(machine="tpu-v9"), r"machine='tpu-v9' is not a known profile"),
        (dict(fixed={"tp": 3}), r"fixed tp=3 does not divide the world size 8.*Choose tp among \[1, 2, 4, 8\]"),
        (dict(fixed={"pp": 4, "tp": 4}), r"multiply to 16, which does not divide the world size 8"),
        (dict(fixed={"sp": 2}), r"fixed\['sp'\] is not something a plan chooses"),
    ],
)
def test_bad_input_is_refused_with_the_value_and_the_fix(change, message):
    arguments = dict(world_size=8, devices_per_node=8, device_memory="1GiB", global_batch=BATCH, seq_len=SEQ)
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        plan(GPTModule(**MODEL), **arguments)


def test_a_device_memory_nothing_fits_in_is_refused_with_the_smallest_need():
    with pytest.raises(ValueError, match=r"No layout of GPTModule on 4 ranks fits device_memory=10.00 KiB.*needs"):
        plan(GPTModule(**MODEL), 4, 4, "10KiB", global_batch=BATCH, seq_len=SEQ, fixed={"pp": 1, "tp": 1})


# ---------------------------------------------------------------- the pipeline bubble


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"),
    [("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("gpipe", 4, 4, 1), ("interleaved_1f1b", 4, 8, 2), ("looped_bfs", 2, 4, 2)],
)
def test_bubble_of_equal_stages_is_the_textbook_one(schedule, pp, m, v):
    assert schedule_bubble(schedule, pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_zero_bubble_schedules_idle_less():
    textbook = 3 / (2 * 8 + 3)
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        assert schedule_bubble(schedule, 4, 8, 2) < textbook


def _uniform_machine(**changes: object) -> Machine:
    return Machine(
        "uniform", {"fp32": 1e9}, 0.0, 0.0, 1e30, Link(0.0, 1e30), Link(0.0, 1e30), async_kernels=False, **changes
    )


def test_the_step_of_a_uniform_pipeline_has_the_schedules_bubble():
    """1F1B at pp=4, m=4 over four equal stages with free links: the bubble is (p−1)/(m+p−1) of the step."""
    work = StageWork(0, 1e6, 2e6, 0, 0, (), (), (), (), 0.0, 4)
    params = StageParams(0, (), (0,), 0)
    layout = resolve_layout(Par3DConfig(pp=4, microbatches=4, dp_shard=1), 4)
    step = predict_step(Par3DConfig(), layout, [work] * 4, [params] * 4, 4, _uniform_machine(), 4)
    assert step.bubble / step.total == pytest.approx(3 / 7)
    assert step.compute == pytest.approx(4 * 3e6 / 1e9)


def test_each_pipeline_action_costs_what_the_calibration_measured():
    """1F1B at pp=4, m=4: every rank's 8 actions, each ``pipeline_action_s`` longer, and the first stage waits for the
    chain's 3 extra forwards and 3 extra backwards; a step without pp pays none of it. The calibration's fit is the
    inverse: the cost per action that makes the planner's simulation of its own pipeline last the measured step."""
    from lightning_par3d.planning.calibrate import pipeline_action_seconds

    work = StageWork(0, 1e6, 2e6, 0, 0, (), (), (), (), 0.0, 4)
    params = StageParams(0, (), (0,), 0)
    layout = resolve_layout(Par3DConfig(pp=4, microbatches=4, dp_shard=1), 4)
    plain, slower = _uniform_machine(), _uniform_machine(pipeline_action_s=1e-3)
    free, costly = (predict_step(Par3DConfig(), layout, [work] * 4, [params] * 4, 4, m, 4) for m in (plain, slower))
    assert costly.total - free.total == pytest.approx((8 + 6) * 1e-3)
    flat = resolve_layout(Par3DConfig(dp_shard=4), 4)
    assert predict_step(Par3DConfig(), flat, [work], [params], 4, slower, 4).total == pytest.approx(
        predict_step(Par3DConfig(), flat, [work], [params], 4, plain, 4).total
    )
    # 1F1B over 2 stages and 8 microbatches, free hops: the second stage's 16 actions between the first stage's first
    # forward and last backward, 18 actions end to end
    free_link = Link(0.0, 1e30)
    assert pipeline_action_seconds(18 * 2e-3, 2, free_link, 0.0, 3) == pytest.approx(2e-3, rel=1e-9)
    link, op_s = Link(1e-4, 1e9), 1e-5
    found = pipeline_action_seconds(0.05, 2, link, op_s, 3)
    assert 0 < found < 0.05 / 18  # the hops and the stage's ops take their part
    assert pipeline_action_seconds(1e-6, 2, link, op_s, 3) == 0.0  # faster than its hops: no cost to find


def test_the_zero_bubble_split_costs_what_the_calibration_measured():
    """zbv at pp=2 (two stages per rank), m=4: each of a rank's 8 ``I`` actions carries the split's work, its stage's
    backward ops at ``split_backward_op_s``; a schedule that does not split the backward pays none of it."""
    work = StageWork(0, 1e6, 2e6, 0, 10, (), (), (), (), 0.0, 4)
    params = StageParams(0, (), (0,), 0)
    plain, splitting = _uniform_machine(), _uniform_machine(split_backward_op_s=1e-4)
    for schedule, stages, extra in (("zbv_zero_bubble", 4, 8 * 10 * 1e-4), ("1f1b", 2, 0.0)):
        config = Par3DConfig(pp=2, microbatches=4, dp_shard=1, pipeline_schedule=schedule, virtual_stages=stages // 2)
        layout = resolve_layout(config, 2)
        free, costly = (predict_step(config, layout, [work] * stages, [params] * stages, 4, m, 2)
                        for m in (plain, splitting))  # fmt: skip
        assert costly.compute - free.compute == pytest.approx(extra)
        assert costly.total >= free.total + extra - 1e-12


def test_each_tensor_parallel_module_costs_what_the_calibration_measured():
    """Three planned modules (one with two collectives): each adds the machine's measured (forward, backward) cost of
    a tensor-parallel module to the compute, once per module and microbatch; a profile's machine counts DTensor ops
    instead."""
    from lightning_par3d.planning.cost import DTENSOR_OPS_PER_TP_MODULE, stage_cost
    from lightning_par3d.planning.probe import TPCollective

    collectives = tuple(
        TPCollective(module, "colwise", phase, "all_reduce", 0.0, None)
        for module, phase in (("q", "backward"), ("k", "backward"), ("o", "forward"), ("o", "backward"))
    )
    work = StageWork(0, 0.0, 0.0, 0, 0, (), (), (), collectives, 0.0, 4)
    layout = resolve_layout(Par3DConfig(tp=2, dp_shard=1), 2)
    free = Link(0.0, 1e30)

    def glue(machine: Machine) -> tuple[float, float]:  # compute, as a profile of the run finds it
        cost = stage_cost(work, Par3DConfig(), layout, 1, machine, "32-true", free)
        return cost.forward_compute, cost.backward_compute

    assert glue(_uniform_machine(tp_module_s=(1e-3, 3e-3))) == pytest.approx((3e-3, 9e-3))
    profile = dataclasses.replace(_uniform_machine(), dtensor_op_overhead_s=1e-4)
    assert glue(profile) == pytest.approx((3 * DTENSOR_OPS_PER_TP_MODULE * 1e-4,) * 2)


def test_factors_learned_from_measured_layouts_find_the_layout_worth_measuring():
    """Three layouts measured where data-parallel communication costs twice its prediction: the planner's first
    choice (much of it data-parallel) measures slowest, one of pure compute fastest. The learned factors reproduce
    the measured steps and put that bucket's near 2 and the others' near 1; a layout with little data-parallel
    communication, predicted slower than the first choice, is then worth measuring, one with much of it is not; where
    the measurements agree with the model (or all by one scale), nothing is, and the factors stay 1 (that scale)."""
    from lightning_par3d.planning.learn import bucket_factors, relearned, worth_measuring

    predicted = [(0.6, 0.0, 0.6, 0.0), (1.5, 0.0, 0.0, 0.0), (1.0, 0.3, 0.2, 0.0)]
    measured = [relearned(b, (1.0, 1.0, 2.0, 1.0)) for b in predicted]  # 1.8, 1.5, 1.7
    factors = bucket_factors(predicted, measured)
    for buckets, step in zip(predicted, measured, strict=True):
        assert relearned(buckets, factors) == pytest.approx(step, rel=0.05)
    assert factors == pytest.approx((1.0, 1.0, 2.0, 1.0), abs=0.2)
    assert bucket_factors([], []) == (1.0,) * 4
    communicating, computing = (0.5, 0.0, 0.9, 0.0), (1.35, 0.0, 0.02, 0.0)  # predicted 1.4 and 1.37, both > 1.2
    index, _ = worth_measuring(list(zip(predicted, measured, strict=True)), [communicating, computing])
    assert index == 1  # ~1.39 against the 1.5 measured
    index, _ = worth_measuring(list(zip(predicted, measured, strict=True)), [communicating])
    assert index is None  # ~2.2
    exact = [sum(b) for b in predicted]
    index, factors = worth_measuring(list(zip(predicted, exact, strict=True)), [communicating, computing])
    assert index is None and factors == pytest.approx((1.0,) * 4, abs=1e-6)
    # predicted with a profile of a faster machine: every step 1000× its prediction is a scale, not a lesson
    slower = [1000 * step for step in exact]
    index, factors = worth_measuring(list(zip(predicted, slower, strict=True)), [communicating, computing])
    assert index is None and factors == pytest.approx((1000.0,) * 4)


def test_the_gpt_pipeline_bubble_is_close_to_the_schedules():
    """The GPT's four stages are nearly equal on an op-bound profile: its 1F1B bubble at pp=4, m=4 is near 3/7."""
    table = plan(
        GPTModule(**DEEP), 4, 4, "1GiB", global_batch=BATCH, seq_len=SEQ,
        fixed={"pp": 4, "pipeline_schedule": "1f1b", "microbatches": 4, "activation_checkpointing": "none"},
    )  # fmt: skip
    step = table.best.time
    assert step.bubble / (step.bubble + step.compute + step.tp_comm) == pytest.approx(3 / 7, abs=0.06)


# ---------------------------------------------------------------- cost formulas and machines


def test_collective_formulas():
    link = Link(1e-5, 1e9)
    assert all_reduce(8e6, 4, link) == pytest.approx(6e-5 + 1.5 * 8e-3)
    assert all_gather(8e6, 4, link) == pytest.approx(3e-5 + 0.75 * 8e-3)
    assert all_reduce(8e6, 1, link) == 0.0
    assert send(1e6, link) == pytest.approx(1e-5 + 1e-3)


def test_groups_across_nodes_use_the_network():
    machine = machine_profile("h100-sxm-8")
    layout = resolve_layout(Par3DConfig(dp_shard=4, tp=4), 16)
    assert group_link(layout, "tp", machine, 8) is machine.intra_node
    assert group_link(layout, "dp_shard", machine, 8) is machine.inter_node


def test_profiles_name_their_sources():
    for name in ("h100-sxm-8", "a100-sxm4-8"):
        machine = machine_profile(name)
        assert "datasheet" in machine.source and machine.devices_per_node == 8
        assert machine.flops_for("bf16-mixed") > machine.flops_for("32-true")


def test_calibration_fit_recovers_latency_and_bandwidth():
    from lightning_par3d.planning.calibrate import _fit_link
    from lightning_par3d.planning.timings import COLLECTIVE_SIZES

    truth = Link(5e-5, 2e9)
    samples = [(k, float(s), f(s, 4, truth)) for k, f in (("all_reduce", all_reduce), ("all_gather", all_gather))
               for s in COLLECTIVE_SIZES]  # fmt: skip
    fitted = _fit_link(samples, 4)
    assert fitted.latency_s == pytest.approx(truth.latency_s, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_reduce_scatter_and_all_to_all_cost_what_the_calibration_measured_over_an_all_gather():
    from lightning_par3d.planning.calibrate import factor_over_all_gather

    link = Link(1e-4, 1e9)
    samples = [("reduce_scatter", float(s), 3.0 * all_gather(s, 4, link)) for s in (4096, 2**20)]
    samples += [("all_to_all", float(s), 1.5 * all_gather(s, 4, link)) for s in (4096, 2**20)]
    samples += [("all_gather", 4096.0, all_gather(4096, 4, link))]
    assert factor_over_all_gather("reduce_scatter", samples, 4, link) == pytest.approx(3.0)
    assert factor_over_all_gather("all_to_all", samples, 4, link) == pytest.approx(1.5)
    assert factor_over_all_gather("reduce_scatter", samples[4:], 4, link) == 1.0  # none measured
    assert all_to_all(8e6, 4, Link(1e-4, 1e9, all_to_all_factor=1.5)) == pytest.approx(1.5 * all_gather(8e6, 4, link))
    slower = Link(1e-4, 1e9, reduce_scatter_factor=3.0)
    assert reduce_scatter(8e6, 4, slower) == pytest.approx(3 * all_gather(8e6, 4, link))
    assert reduce_scatter(8e6, 4, link) == pytest.approx(all_gather(8e6, 4, link))
    # ZeRO-2 reduce-scatters its gradients, DDP all-reduces them: only ZeRO-2's step grows with the factor
    zero2, ddp = (resolve_layout(Par3DConfig(**c), 4) for c in ({"dp_shard": 4, "zero_stage": 2}, {"dp_replicate": 4}))
    params = [StageParams(0, ((1000, 1000),), (10**6,), 1)]
    machines = [dataclasses.replace(_uniform_machine(), intra_node=x, inter_node=x) for x in (link, slower)]
    for layout, grows in ((zero2, True), (ddp, False)):
        fast, slow = (sum(data_parallel_collectives(layout, params, "32-true", m, 4)) for m in machines)
        assert (slow > fast) is grows


def test_calibrate_measures_this_machine():
    from lightning_par3d.planning import calibrate

    machine = calibrate(2, seconds=0.05)
    assert machine.flops_for("32-true") > 1e8 and 0 < machine.op_overhead_s < 1e-2
    assert machine.intra_node.bandwidth > 1e6 and math.isfinite(machine.intra_node.latency_s)
    assert 0 < machine.measurements["measuring_s"] < machine.measurements["calibration_s"]  # a part of the whole
    assert machine.intra_node.reduce_scatter_factor >= 1.0 and machine.intra_node.all_to_all_factor >= 1.0
    assert 0 < machine.split_backward_op_s < 1e-2  # torch's split walks the graph in Python: never free on a CPU
    forward, backward = machine.tp_module_s  # DTensor's dispatch and autograd functions: never free either
    assert 0 < forward < 0.1 and 0 < backward < 0.1


# ---------------------------------------------------------------- the command line


def test_command_line_prints_the_ranked_table_and_plots(tmp_path, capsys, monkeypatch):
    """``par3d plan`` from the Hydra app's model config (its arguments overridden), saying which model it built (its
    entry point, as a user types it, runs in ``tests/test_docs.py``); ``--plot`` without a file draws under
    ``outputs/plans/`` of the working directory (which git ignores), never beside the user's files."""
    from lightning_par3d.tools.plan import main

    monkeypatch.chdir(tmp_path)
    code = main(
        ["--model-config", str(ROOT / "conf/model/gpt.yaml"),
         "--model-arg", "n_layer=2", "--model-arg", "n_embd=32", "--model-arg", "block_size=32",
         "--world-size", "4", "--devices-per-node", "4", "--memory", "1GiB", "--batch", "16", "--seq", "32",
         "--profile", "a100-sxm4-8", "--fixed", "tp=2", "--plot"]
    )  # fmt: skip
    (png,) = (tmp_path / "outputs" / "plans").glob("plan-*.png")
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    params = sum(p.numel() for p in GPT(GPTConfig(n_layer=2, n_embd=32, block_size=32)).parameters())
    assert (
        f"model: examples.gpt.GPTModule: {params / 1e6:,.2f} M parameters; blocks: model.transformer.h: 2 × Block"
        in out
    )
    assert "Layouts that fit" in out and "| 1 | pp=" in out and "× tp=2 |" in out and "× tp=1 |" not in out
    assert "Rejected layouts" in out and "best: Par3DStrategy(" in out
    assert png.exists() and png.stat().st_size > 10_000


def test_command_line_refuses_bad_input_with_the_reason(capsys):
    from lightning_par3d.tools.plan import main

    code = main(["--module", "examples.gpt:GPTModule", "--world-size", "8", "--batch", "16", "--seq", "32",
                 "--fixed", "tp=3"])  # fmt: skip
    assert code == 2
    assert "fixed tp=3 does not divide the world size 8" in capsys.readouterr().err


def test_the_package_exports_the_plan_function():
    import lightning_par3d

    table = lightning_par3d.plan(GPTModule(**MODEL), 2, 2, "1GiB", global_batch=4, seq_len=SEQ, fixed={"tp": 2})
    assert table.best.layout.tp == 2


# ---------------------------------------------------------------- the benchmark


def test_benchmark_statistics(tables):
    from benchmarks.bench_planner import MEASURED, compare, ranks, spearman

    assert ranks([3.0, 1.0, 2.0, 1.0]) == [4.0, 1.5, 3.0, 1.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    rows = tables[8].fitting
    another_kind = next(rows.index(r) for r in tables[8].to_measure(MEASURED) if rows.index(r) >= MEASURED)
    measured = [3.0] * len(rows)
    measured[0], measured[1], measured[another_kind] = 1.2, 1.1, 1.0
    got = compare(rows, measured)
    assert got["first_choice_vs_best"] == pytest.approx(1.2)
    assert got["measured_choice_vs_best"] == pytest.approx(1.0)  # measured as layout='auto' picks: one per kind
    assert got["top_predictions_vs_best"] == pytest.approx(1.1)  # the 3 fastest predictions miss it


def test_benchmark_saves_what_it_replays():
    """--save writes the machine and the configurations as --replay reads them back."""
    import json

    from benchmarks.bench_planner import config_record, machine_from, machine_record

    link = Link(1e-4, 1e9, reduce_scatter_factor=2.5)
    machine = dataclasses.replace(_uniform_machine(), intra_node=link, measurements={"op_s": 1e-5})
    assert machine_from(json.loads(json.dumps(machine_record(machine)))) == machine
    assert machine_from(machine_record("h100-sxm-8")) == "h100-sxm-8"
    config = Par3DConfig(pp=2, dp_shard=2, microbatches=4)
    assert json.loads(json.dumps(config_record(config))) == config_record(config)


def test_benchmark_trains_a_planned_layout(pool4):
    """The benchmark's run of one layout the plan lists (a few steps, on the transformers Qwen2 of its three models:
    tied embeddings, so the plan lists no pipeline for it), so that it cannot rot between uses."""
    from benchmarks.bench_planner import timed_layout

    config = Par3DConfig(dp_shard=2, tp=2, zero_stage=2)
    times = pool4.run(timed_layout, config=config, steps=3, warmup=1, model="qwen2")[0]
    assert len(times) == 2 and all(t > 0 for t in times)


def test_the_collector_is_paused_while_planning_and_clears_the_cycles_after():
    """Within ``collector_paused`` (sections nest) the cyclic collector is off; after the outermost, the cycles the
    section left are cleared and the collector runs again."""
    import gc
    import weakref

    from lightning_par3d.distributed import fakeworld

    class Node:
        pass

    with fakeworld.collector_paused():
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        with fakeworld.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        witness = weakref.ref(cycle)
        del cycle
        assert witness() is not None  # a cycle: reference counting alone never frees it
    assert gc.isenabled()
    assert witness() is None


def test_copies_of_a_fake_model_keep_its_fake_mode_and_free_safely(new_interpreter):
    """The cause of the planner's crashes on real-sized models: torch's deep copy of a fake tensor copied its
    ``FakeTensorMode`` (caches and C++ objects with it), and freeing those copies crashed the process. The copies
    the estimator makes keep the model's fake mode; freeing 25 copies of a stage, in a fresh interpreter with the
    collector running, exits cleanly (20 crashed it before, freed as each next copy replaced it)."""
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc
        from examples.hf_llama import CausalLMModule
        from lightning_par3d.memory.stage_measure import _OneBuild
        from lightning_par3d.pipeline.split import build_stage_module, find_trunk_parts
        from lightning_par3d.utils.torch_private import fake_tensor_mode

        module = CausalLMModule(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=300, block_size=32)
        built, fake = _OneBuild(module, "32-true"), fake_tensor_mode()
        with fake:
            trunk = built.root().model
            parts = find_trunk_parts(trunk)
            for i in range(25):
                stage = build_stage_module(trunk, parts, {parts.blocks[0]}, True, False)
                cut = built.copy(["model.layers.0", "model.layers.1"])
                assert len(cut.model.model.layers) == 2, cut
                held = [*stage.parameters(), *stage.buffers(), *cut.parameters(), *cut.buffers()]
                assert all(t.fake_mode is fake for t in held)
            gc.collect()
        print("clean")
        """
    )
    done = new_interpreter([sys.executable, "-c", script], cwd=ROOT)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-3000:]


def test_an_estimate_leaves_no_tensor_for_a_later_full_collection_to_clear():
    """The section's collection runs over the youngest generation only (a full one walks the whole heap): it
    still clears every cycle the estimate made, so a later full collection finds no tensor left."""
    import gc

    import torch

    module = GPTModule(**MODEL)  # held: the user's module is theirs (a LightningModule is cyclic garbage when dropped)
    gc.collect()
    with forget_meshes():
        estimate_memory(module, Par3DConfig(dp_shard=2, tp=2), 4, (BATCH, SEQ))
    flags = gc.get_debug()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        left = [obj for obj in gc.garbage if isinstance(obj, torch.Tensor)]
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)
    assert not left
