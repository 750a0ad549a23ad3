"""``layout="auto"``: the layout chosen at launch, on the job's own ranks, by the planner (every rank measures the
machine, rank 0 plans in a fresh interpreter and sends the choice), trains like any other layout: to the
single-process losses and parameters, at the global batch the user set (``global_batch``, or the loader's
``batch_size`` × the data-parallel size the sizes set give without ``"auto"``), whatever dp it chose: the per-rank
batch and ``accumulate_grad_batches`` are the plan's."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par3d import Par3DConfig, Par3DEngine
from lightning_par3d.planning.at_launch import batch_shape, describe_choice, meta_copy, surrogate_loss
from tests.conftest import assert_parity
from tests.gpt_runs import run_par3d, run_reference


def _trained(
    pool: object, devices: int, rank_batch: int, root: object, kept: bool = False, **strategy: object
) -> tuple[dict, object]:
    """One auto run, its measured choices kept in ``root``; every rank trained the same layout, and rank 0's log
    says which and why (``kept``: that it took a choice kept in ``root`` before)."""
    strategy = dict(layout="auto", **strategy)
    results = pool.run(run_par3d, strategy=strategy, devices=devices, rank_batch=rank_batch, default_root_dir=str(root))
    layout = results[0]["layout"]
    assert all(result["layout"] == layout for result in results)
    log = pool.log_tail(0, chars=20000)
    if kept:
        assert "measured fastest for this job before" in log and "not measuring again" in log, log
    else:
        assert "par3d layout='auto': chose " in log and "To pin this layout: Par3DStrategy(" in log, log
    return results[0], layout


def test_auto_at_four_ranks_trains_on_the_single_process_trajectory(pool4, tmp_path):
    """batch_size 2 on 4 ranks: the global batch is 8 at any chosen dp. 3 layouts (the first choice, then the fastest
    predicted at another pipeline size, tensor-parallel size or engine) are measured first (the default), in the same
    processes: the run after them is one process's all the same. A second launch of the same job (a restart, a
    resume) takes the kept choice without measuring again."""
    got, layout = _trained(pool4, 4, rank_batch=2, root=tmp_path)
    assert layout.world_size == 4
    reference = run_reference(global_batch=8)
    assert_parity(got, reference)
    log = pool4.log_tail(0, chars=20000)
    assert "It takes the global batch of 8 samples as batch_size" in log
    assert "par3d layout='auto': measured 3 layouts, the first choice and the fastest predicted at each" in log, log
    assert log.count(" chosen") == 1, log
    kept = json.loads((tmp_path / "par3d_auto_layout.json").read_text())
    (entry,) = kept.values()
    learned = "so it was measured too" in log  # one more where the steps measured put another ahead (see below)
    assert len(entry["measured"]) == 3 + learned and entry["arguments"]["tp"] == layout.tp

    again, layout_again = _trained(pool4, 4, rank_batch=2, root=tmp_path, kept=True)
    assert layout_again == layout
    assert_parity(again, reference)


def test_auto_at_eight_ranks_keeps_the_sizes_the_user_fixed(pool8, tmp_path):
    """``tp=2`` stays; pp, the data-parallel sizes, the ZeRO stage, the schedule and checkpointing are searched;
    the global batch is batch_size 4 × the 4 data-parallel ranks tp=2 leaves; 2 layouts measured. Predicted with a
    profile (the 4-rank test calibrates the job's machine)."""
    got, layout = _trained(pool8, 8, rank_batch=4, root=tmp_path, tp=2, measure=2, plan_machine="h100-sxm-8")
    assert layout.tp == 2 and layout.world_size == 8
    assert_parity(got, run_reference(global_batch=16))


def test_auto_chooses_cp_where_rows_are_long_and_few_and_trains_on_the_single_process_trajectory(pool4, tmp_path):
    """2 rows of 256 tokens a step on 4 ranks: data parallelism stops at 2, the fastest layout without cp splits the
    model and holds more activations than state, so the plan searches cp and predicts pp=2 × cp=2 fastest (on the
    profile; measure=0 trains the prediction). As launched, it trains to one process's losses and parameters. (A
    pinned ``cp=2`` is a pinned size as any other: ``test_auto_keeps_a_pinned_ep...`` in test_moe.py pins ep.)"""
    long_rows = dict(model=dict(block_size=256), data=dict(block_size=256, max_bytes=256 * 20 + 2))
    strategy = dict(layout="auto", global_batch=2, measure=0, plan_machine="h100-sxm-8")
    results = pool4.run(run_par3d, strategy=strategy, devices=4, rank_batch=1, default_root_dir=str(tmp_path),
                        **long_rows)  # fmt: skip
    layout = results[0]["layout"]
    assert all(result["layout"] == layout for result in results)
    assert (layout.pp, layout.cp, layout.dp) == (2, 2, 1), layout
    log = pool4.log_tail(0, chars=20000)
    assert "(cp = 2, 4 searched too: the fastest layout without it, pp2·rep1·shard1·tp2" in log, log
    assert "To pin this layout: Par3DStrategy(pp=2, dp_replicate=1, dp_shard=1, tp=1, zero_stage=3, cp=2" in log
    assert_parity(results[0], run_reference(global_batch=2, **long_rows))


def test_auto_accumulates_where_the_per_rank_batch_does_not_fit(pool4, tmp_path):
    """global_batch=16 with dp=4 pinned (pure replication) and 1 MiB a device: batch_size 4 a rank does not fit,
    so the plan takes 2 a rank × 2 accumulated batches; the loader (batch_size 4) is re-made at 2, Lightning
    accumulates 2, and the run is one process's at 16 samples a step."""
    strategy = dict(dp_replicate=4, dp_shard=1, global_batch=16, plan_device_memory="1MiB", measure=0)
    got, layout = _trained(pool4, 4, rank_batch=4, root=tmp_path, **strategy)
    assert layout.dp == 4
    log = pool4.log_tail(0, chars=20000)
    assert "batch_size 2 per data-parallel rank × dp=4 × accumulate_grad_batches=2" in log, log
    losses = got["losses"]  # per batch: each the step's token-mean share of its half of the 16 samples
    assert len(losses) == 12
    steps = [first + second for first, second in zip(losses[::2], losses[1::2], strict=True)]
    assert_parity(dict(got, losses=steps), run_reference(global_batch=16))


def test_auto_under_accelerate_plans_in_prepare_from_the_dataloader(pool4):
    from tests.accelerate_runs import accelerate_loop, single_process_loop

    got = pool4.run(accelerate_loop, strategy=dict(layout="auto"), rank_batch=2)
    log = pool4.log_tail(0, chars=20000)
    assert f"global batch of 8 samples as batch_size {8 // got[0]['dp']} per data-parallel rank" in log, log
    assert_parity(got[0], single_process_loop(global_batch=8))  # batch_size 2 × 4 ranks, re-made at 8 / dp


def test_auto_under_fabric_plans_in_setup_module_and_remakes_the_dataloader(pool4):
    """Fabric sets the model up before any dataloader: the batch's shape comes from ``plan_batch``. tp=2 pinned,
    global batch 8: Fabric's loader of plan_batch's 2 samples is re-made at 8 / dp per rank by
    ``setup_dataloaders``; the run follows one process reading the same global batches (the samples the dp ranks
    really read under Fabric's shuffling sampler). Measuring, which needs a batch at planning, is refused."""
    from tests.accelerate_runs import fabric_loader_loop, fabric_loop, single_process_loop
    from tests.harness import RankError

    strategy = dict(layout="auto", tp=2, plan_batch=[2, 32], global_batch=8)
    ranks = pool4.run(fabric_loader_loop, strategy=strategy, batch_size=2)
    assert "par3d layout='auto': chose " in pool4.log_tail(0, chars=20000)
    firsts = sorted((r for r in ranks if r["first_copy"]), key=lambda r: r["dp_rank"])
    assert [len(x) for x, _ in firsts[0]["read"]] == [8 // len(firsts)] * 4  # re-made from 2
    batches = [tuple(torch.cat([r["read"][step][k] for r in firsts]) for k in (0, 1)) for step in range(4)]
    assert_parity(ranks[0], single_process_loop(steps=4, batches=batches))
    with pytest.raises(RankError, match=r"measure=2, but there is no batch to measure with here \(Fabric"):
        pool4.run(fabric_loop, strategy=dict(layout="auto", plan_batch=[2, 32], measure=2))


def test_measuring_more_layouts_than_fit_is_refused_on_every_rank(pool2, tmp_path):
    from tests.harness import RankError

    strategy = dict(layout="auto", measure=50, plan_machine="h100-sxm-8")  # a profile: no calibration to wait for
    with pytest.raises(RankError, match=r"measure=50, but only \d+ layouts fit: give measure \d+ or fewer"):
        pool2.run(run_par3d, strategy=strategy, devices=2, rank_batch=4, default_root_dir=str(tmp_path))


def _measure_the_learned_one() -> dict:
    """In a pool of 2: two layouts "measured" (their steps given), whose steps say that data-parallel communication
    costs far more than predicted and compute less; the reserve holds a layout of compute only and one of
    communication only. The learned factors make the first worth measuring: it is trained for real, and the fastest
    of the three is returned."""
    import io
    from contextlib import redirect_stdout

    from examples.gpt import GPTModule
    from lightning_par3d.distributed.groups import init_default_group
    from lightning_par3d.engine.trial import measure_step
    from lightning_par3d.planning.at_launch import BatchSplit, candidate_from
    from lightning_par3d.planning.measuring import MeasureWith, measure_learned
    from tests.constants import MODEL

    device = torch.device("cpu")
    init_default_group(device, 120.0)
    config, split = Par3DConfig(timeout_s=120), BatchSplit(4, 2)
    ddp, tp = {"dp_replicate": 2, "dp_shard": 1}, {"dp_shard": 1, "tp": 2}
    candidates = [candidate_from(config, ddp, split, 0.1, "A", (0.08, 0.0, 0.02, 0.0)),
                  candidate_from(config, tp, split, 0.1, "B", (0.02, 0.0, 0.08, 0.0))]  # fmt: skip
    reserve = [candidate_from(config, ddp, split, 0.1, "C", (0.1, 0.0, 0.0, 0.0), reserve=True),
               candidate_from(config, tp, split, 0.1, "D", (0.0, 0.0, 0.1, 0.0), reserve=True)]  # fmt: skip
    tokens = torch.randint(0, 65, (2, MODEL["block_size"] + 1))
    sample = MeasureWith(meta_copy(GPTModule(**MODEL)), (tokens[:, :-1], tokens[:, 1:]))
    times = [0.06, 0.3]
    printed = io.StringIO()
    with redirect_stdout(printed):
        best = measure_learned(candidates, times, 0, reserve, sample, "32-true", device, measure_step)
    return {"best": best, "names": [c.name for c in candidates], "times": times, "printed": printed.getvalue()}


def test_the_steps_measured_teach_the_model_which_other_layout_to_measure(pool2):
    """What layout='auto' does after measuring its candidates: the factors learned from their steps re-predict the
    other fitting layouts, and one they put ahead of the fastest measured is measured too (and chosen where it is
    the fastest); rank 0 says what it learned."""
    results = pool2.run(_measure_the_learned_one)
    got = results[0]
    assert got["names"] == ["A", "B", "C"] and all(r["names"] == got["names"] for r in results)
    assert got["times"][2] > 0 and got["best"] == min(range(3), key=got["times"].__getitem__)
    assert (
        "dp_comm ×3.57, bubble ×1.80 of its prediction; with them C (predicted 100.0 ms) comes to 45.0 ms"
        in got["printed"]
    )
    assert re.search(r"so it was measured too: [\d.,]+ ms \(measuring it took [\d.]+ s more\)", got["printed"])
    assert results[1]["printed"] == ""


def _calibrate_with_a_failing_fit() -> float:
    """``calibrate_job`` where rank 0's fresh interpreter fails: every rank gets a machine (no wait on rank 0)."""
    from unittest import mock

    from lightning_par3d.distributed.groups import group_of, init_default_group
    from lightning_par3d.planning.calibrate import calibrate_job

    device = torch.device("cpu")
    init_default_group(device, 120.0)
    with mock.patch("lightning_par3d.utils.fresh_interpreter.call", side_effect=RuntimeError("no interpreter")):
        machine = calibrate_job(device, lambda ranks: group_of(ranks, "gloo", 120.0), seconds=0.02)
    return machine.pipeline_action_s


def test_a_calibration_whose_pipeline_fit_fails_goes_on_without_it(pool2):
    """Rank 0 fits the cost per pipeline action in a fresh interpreter; where that fails, every rank takes 0 (the
    model without it) and rank 0 says why, instead of the other ranks waiting out the collective timeout."""
    assert pool2.run(_calibrate_with_a_failing_fit, timeout=120) == [0.0, 0.0]
    assert "par3d calibration: no cost per pipeline action (RuntimeError: no interpreter)" in pool2.log_tail(0)


# ---------------------------------------------------------------- before any process


def test_bad_auto_settings_fail_before_launch():
    with pytest.raises(ValueError, match=r"layout='bogus' is not a layout mode. Allowed: None .* or 'auto'"):
        Par3DEngine(Par3DConfig(layout="bogus"))
    with pytest.raises(ValueError, match=r"plan_batch=\[8, 64\] set, but layout=None: .* Set layout='auto'"):
        Par3DEngine(Par3DConfig(plan_batch=[8, 64]))
    with pytest.raises(ValueError, match=r"plan_batch=\[8\] must be \[samples per data-parallel rank, sequence"):
        Par3DEngine(Par3DConfig(layout="auto", plan_batch=[8]))
    engine = Par3DEngine(Par3DConfig(layout="auto", tp=3))
    with pytest.raises(ValueError, match=r"fixed tp=3 does not divide the world size 4.* among \[1, 2, 4\]"):
        engine.resolve(4)
    with pytest.raises(ValueError, match=r"machine='a-cluster-of-toasters' is not a known profile"):
        Par3DEngine(Par3DConfig(layout="auto", plan_machine="a-cluster-of-toasters")).resolve(4)
    with pytest.raises(ValueError, match=r"global_batch=0 must be a positive number of samples per optimizer step"):
        Par3DEngine(Par3DConfig(layout="auto", global_batch=0))
    with pytest.raises(ValueError, match=r"global_batch=16 set, but layout=None"):
        Par3DEngine(Par3DConfig(global_batch=16))
    with pytest.raises(ValueError, match=r"measure=-1 must be how many of the fastest predicted layouts to measure"):
        Par3DEngine(Par3DConfig(layout="auto", measure=-1))
    with pytest.raises(ValueError, match=r"measure=2 set, but layout=None"):
        Par3DEngine(Par3DConfig(measure=2))
    pinned = Par3DEngine(Par3DConfig(layout="auto", dp_replicate=2, dp_shard=2, global_batch=6))
    with pytest.raises(ValueError, match=r"global_batch=6 does not split over the dp=4 .* nearest that do: 4 or 8"):
        pinned.resolve(8)


def test_pinned_cp_and_ep_are_kept_and_cp_leaves_fewer_data_parallel_ranks():
    """``cp`` and ``ep`` set with ``layout="auto"`` are pinned for the plan; ``cp`` ranks read the same rows, so the
    global batch the configuration names is the loader's batch × the ranks left after pp, tp and cp."""
    from lightning_par3d.planning.at_launch import default_dp, fixed_settings, global_batch_of

    config = Par3DConfig(layout="auto", cp=2, ep=2)
    assert fixed_settings(config) == {"cp": 2, "ep": 2}
    assert default_dp(config, 8) == 4 and global_batch_of(config, rank_batch=3, world_size=8) == 12
    Par3DEngine(config).resolve(8)  # accepted before launch (was refused for both)


def test_the_layout_is_read_after_it_is_chosen():
    engine = Par3DEngine(Par3DConfig(layout="auto"))
    assert engine.resolve(4) is None and engine.awaits_layout
    with pytest.raises(RuntimeError, match=r"layout='auto': the layout is chosen at launch, when the model is set up"):
        _ = engine.layout


def test_the_batch_shape_comes_from_the_loader_or_plan_batch():
    tokens = torch.zeros(10, 33, dtype=torch.long)
    windows = [(t[:-1], t[1:]) for t in tokens]
    assert batch_shape(Par3DConfig(layout="auto"), DataLoader(windows, batch_size=4), "x") == (4, 32)
    named = [{"input_ids": t, "labels": t} for t in tokens]
    assert batch_shape(Par3DConfig(layout="auto"), DataLoader(named, batch_size=2), "x") == (2, 33)
    assert batch_shape(Par3DConfig(layout="auto", plan_batch=[3, 7]), None, "x") == (3, 7)
    with pytest.raises(ValueError, match=r"Fabric does not tell it .* Give it: plan_batch=\[samples per"):
        batch_shape(Par3DConfig(layout="auto"), None, "Fabric")


def test_the_planners_copy_holds_no_storage_and_its_loss_counts_the_logits():
    from examples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=8))
    copy = meta_copy(model)
    assert all(p.is_meta for p in copy.parameters()) and not any(p.is_meta for p in model.parameters())
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in model.named_parameters()]
    logits, targets = torch.randn(2, 8, 65), torch.randint(0, 65, (2, 8))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(surrogate_loss(logits, targets), expected)
    assert surrogate_loss(logits).item() == pytest.approx(logits.mean().item())


def test_the_choice_is_printed_with_why_and_how_to_pin_it():
    from examples.gpt import GPTModule
    from lightning_par3d import plan

    table = plan(GPTModule(block_size=32, n_layer=2, n_head=4, n_embd=32), 4, 4, "1GiB", rank_batch=2, seq_len=32)
    text = describe_choice(table)
    assert text.startswith(f"par3d layout='auto': chose {table.best.describe()} on 4 ranks: the fastest predicted")
    assert "| 1 | " in text and "Rejected layouts" not in text
    assert "To pin this layout: Par3DStrategy(pp=" in text


def test_a_kept_choice_is_reused_only_for_the_same_model_not_the_same_class(pool2, tmp_path):
    """The record of a measured choice is keyed on what decides the layout: the same GPT class with another
    ``n_layer`` plans and measures again, and says why, instead of taking the smaller model's layout."""
    strategy = dict(layout="auto", measure=2, plan_machine="h100-sxm-8")  # a profile: no calibration to wait for
    run = dict(strategy=strategy, devices=2, rank_batch=4, default_root_dir=str(tmp_path), max_steps=1)
    pool2.run(run_par3d, **run)
    pool2.run(run_par3d, **run, model=dict(n_layer=3))
    log = pool2.log_tail(0, chars=20000)
    assert "are for other jobs: the nearest differs in the model's config; planning again" in log  # its hparams
    kept = json.loads((tmp_path / "par3d_auto_layout.json").read_text())
    assert len(kept) == 2 and {entry["job"]["model"] for entry in kept.values()} == {"examples.gpt.GPTModule"}


def test_the_job_record_names_what_decides_the_layout():
    from examples.gpt import GPTModule
    from lightning_par3d.planning.layout_record import job_record, why_not_kept
    from tests.constants import MODEL

    def record(**model: object) -> dict[str, str]:
        module = meta_copy(GPTModule(**{**MODEL, **model}))
        return job_record(Par3DConfig(tp=2), module, 4, 8, 32, "32-true", torch.device("cpu"))

    two, three, wider = record(), record(n_layer=3), record(n_embd=64)
    assert two == record()  # the same job
    assert {k for k in two if two[k] != three[k]} == {"config"}  # the GPT builds its blocks in configure_model
    assert {k for k in two if two[k] != wider[k]} == {"config"}
    assert "('tp', '2')" in two["pinned"] and two["world"] == "4" and two["device"].startswith("cpu×")
    kept = {"x": {"job": two}}
    assert "differs in the model's config" in why_not_kept(kept, three, __import__("pathlib").Path("f.json"))


def _measuring_refused_alike(refusing_ranks: list[int]) -> dict:
    """``pick_measured`` over two layouts whose second raises the same refusal on ``refusing_ranks``, before any of
    its collectives; what it returned and what rank 0 printed."""
    import io
    from contextlib import redirect_stdout

    import torch.distributed as dist

    from examples.gpt import GPTModule
    from lightning_par3d.distributed.groups import init_default_group
    from lightning_par3d.engine.trial import measure_step
    from lightning_par3d.planning import measuring as measure
    from lightning_par3d.planning.at_launch import BatchSplit, candidate_from
    from tests.constants import MODEL

    device = torch.device("cpu")
    init_default_group(device, 120.0)
    config, split = Par3DConfig(timeout_s=120), BatchSplit(4, 2)
    candidates = [candidate_from(config, {"dp_replicate": 2, "dp_shard": 1}, split, 0.1, "A"),
                  candidate_from(config, {"dp_shard": 2}, split, 0.1, "B")]  # fmt: skip
    tokens = torch.randint(0, 65, (2, MODEL["block_size"] + 1))
    sample = measure.MeasureWith(meta_copy(GPTModule(**MODEL)), (tokens[:, :-1], tokens[:, 1:]))

    def refuse_b(candidate: Any, *args: Any) -> float:
        if getattr(candidate, "name", "") == "B" and dist.get_rank() in refusing_ranks:
            raise TypeError("training_step needs a Trainer here")
        return measure_step(candidate, *args)

    printed = io.StringIO()
    with redirect_stdout(printed):
        best, times = measure.pick_measured(candidates, sample, "32-true", device, refuse_b)
    return {"best": best, "times": times, "printed": printed.getvalue()}


def test_a_candidate_refused_alike_on_every_rank_falls_back_to_the_first_choice(pool2):
    """Every rank raised the same error before any collective of the candidate: nobody waits, so measuring stops
    and the run trains the first prediction, saying why. (A failure on one rank only ends the job:
    ``tests/test_faults.py``'s "raise on rank 1 while layout='auto' measures".)"""
    results = pool2.run(_measuring_refused_alike, refusing_ranks=[0, 1])
    assert [(r["best"], r["times"]) for r in results] == [(0, None), (0, None)]
    printed = results[0]["printed"]
    assert "measuring B was refused alike on every rank (TypeError: training_step needs a Trainer here)" in printed
    assert "training the planner's first choice, A." in printed


def test_one_rebatching_behind_every_front_end_keeps_every_argument_and_refuses_a_batch_sampler():
    """``layout="auto"``'s per-rank batch size, applied to a training loader the same way at every front-end: every
    other argument of the loader kept; a loader batched by a ``batch_sampler`` refused with the fix (Accelerate's
    path used to copy some arguments only and leave such a loader at its own size: another global batch)."""
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

    from lightning_par3d.engine.rebatching import KEPT, with_batch_size

    data = TensorDataset(torch.arange(16))
    loader = DataLoader(data, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator(), in_order=False)
    remade = with_batch_size(loader, 2)
    assert remade.batch_size == 2 and all(getattr(remade, k) is getattr(loader, k) for k in KEPT if k != "sampler")
    assert type(remade.sampler) is type(loader.sampler) and remade.sampler.generator is loader.generator
    assert with_batch_size(remade, 2) is remade
    batched = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, drop_last=False))
    with pytest.raises(ValueError, match=r"batches through a batch_sampler\. Give the DataLoader batch_size="):
        with_batch_size(batched, 2)

    class Custom(DataLoader):
        pass

    with pytest.raises(ValueError, match="a Custom, a DataLoader subclass whose own arguments par3d cannot know"):
        with_batch_size(Custom(data, batch_size=4), 2)


def _auto_with_a_pipeline_predicted_first(root: str) -> dict:
    """``layout="auto"`` at 2 ranks (global batch 8) where the plan's first choice is forced to be a pipeline (pp=2,
    1F1B, 8 microbatches, full checkpointing: slower than plain replication here by far) and the layout measured
    beside it is plain replication; what the run trained."""
    from lightning_par3d.planning import measuring
    from lightning_par3d.planning.at_launch import BatchSplit, candidate_from

    pipeline = dict(pp=2, dp_replicate=1, dp_shard=1, tp=1, zero_stage=0, pipeline_schedule="1f1b", microbatches=8,
                    activation_checkpointing="full")  # fmt: skip
    replicated = dict(pp=1, dp_replicate=2, dp_shard=1, tp=1, zero_stage=0)

    def pipeline_first(config: Par3DConfig, module: Any, **kwargs: Any) -> list:
        return [candidate_from(config, pipeline, BatchSplit(8, 8), 0.010, "pp2 1f1b m8 ac=full"),
                candidate_from(config, replicated, BatchSplit(8, 4), 0.020, "rep2")]  # fmt: skip

    original, measuring.choose_at_launch = measuring.choose_at_launch, pipeline_first
    try:
        return run_par3d(strategy=dict(layout="auto", measure=2), devices=2, rank_batch=4, default_root_dir=root)
    finally:
        measuring.choose_at_launch = original


def test_a_pipeline_predicted_first_but_measured_slower_is_not_trained(pool2, tmp_path):
    """The cost model's first choice is a pipeline; the fastest measured layout has none: ``layout="auto"`` trains
    the one without, on one process's trajectory, and says by how much the first choice measured slower, with each
    candidate's median and spread."""
    results = pool2.run(_auto_with_a_pipeline_predicted_first, root=str(tmp_path))
    assert [(r["layout"].pp, r["layout"].dp_replicate) for r in results] == [(1, 2), (1, 2)]
    assert_parity(results[0], run_reference(global_batch=8))
    log = pool2.log_tail(0, chars=20000)
    assert re.search(r"training rep2 \(the planner's first choice measured \d+\.\d\d×\)", log), log
    assert "| measured ms/step (median) | spread (ms) | steps |" in log


def test_two_candidates_closer_than_their_spread_are_measured_again():
    """The medians of the two fastest within the larger spread (slowest less fastest step): one measuring cannot
    tell them apart, so both are measured again; apart by more, neither."""
    from lightning_par3d.planning.measuring import describe_measured, spread, too_close

    assert too_close([[0.30, 0.31, 0.32], [0.10, 0.12, 0.11], [0.115, 0.12, 0.13]]) == [1, 2]
    assert too_close([[0.10, 0.101, 0.102], [0.20, 0.21, 0.20]]) == []
    assert too_close([[0.10, 0.12, 0.11]]) == [] and spread([0.10, 0.12, 0.11]) == pytest.approx(0.02)
    config = Par3DConfig()
    from lightning_par3d.planning.at_launch import BatchSplit, candidate_from

    a, b = (candidate_from(config, {}, BatchSplit(4, 2), 0.1, name) for name in ("A", "B"))
    text = describe_measured([a, b], [[0.10, 0.12, 0.11, 0.105], [0.115, 0.12, 0.13]], 0, 1.5, [0, 1])
    assert "#1 and #2 were closer than their spread: both measured again" in text
    assert "| 1 | A | 100.0 | 107.5 | 20.0 | 4 | chosen" in text and "| 2 | B | 100.0 | 120.0 | 15.0 | 3 |" in text
