"""``layout="auto"``: the layout chosen at launch, on the job's own ranks, by the planner (every rank measures the
machine, rank 0 plans in a fresh interpreter and sends the choice), trains like any other layout: to the
single-process losses and parameters, at the global batch it gives (``rank_batch × dp``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par3d import Par3DConfig, Par3DEngine
from lightning_par3d.planning.at_launch import batch_shape, describe_choice, meta_copy, surrogate_loss
from tests.conftest import assert_parity
from tests.gpt_runs import run_par3d, run_reference


def _trained(pool: object, devices: int, rank_batch: int, **strategy: object) -> tuple[dict, object]:
    """One auto run; every rank trained the same layout, and rank 0's log says which and why."""
    results = pool.run(run_par3d, strategy=dict(layout="auto", **strategy), devices=devices, rank_batch=rank_batch)
    layout = results[0]["layout"]
    assert all(result["layout"] == layout for result in results)
    log = pool.log_tail(0, chars=20000)
    assert "par3d layout='auto': chose " in log and "To pin this layout: Par3DStrategy(" in log, log
    return results[0], layout


def test_auto_at_four_ranks_trains_on_the_single_process_trajectory(pool4):
    got, layout = _trained(pool4, 4, rank_batch=2)
    assert layout.world_size == 4
    assert_parity(got, run_reference(global_batch=2 * layout.dp))


def test_auto_at_eight_ranks_keeps_the_sizes_the_user_fixed(pool8):
    """``tp=2`` stays; pp, the data-parallel sizes, the ZeRO stage, the schedule and checkpointing are searched."""
    got, layout = _trained(pool8, 8, rank_batch=4, tp=2)
    assert layout.tp == 2 and layout.world_size == 8
    assert_parity(got, run_reference(global_batch=4 * layout.dp))


def test_auto_under_accelerate_plans_in_prepare_from_the_dataloader(pool4):
    from tests.accelerate_runs import accelerate_loop, single_process_loop

    got = pool4.run(accelerate_loop, strategy=dict(layout="auto"), rank_batch=2)
    dp = got[0]["dp"]
    assert "par3d layout='auto': chose " in pool4.log_tail(0, chars=20000)
    assert_parity(got[0], single_process_loop(global_batch=2 * dp))


def test_auto_under_fabric_plans_in_setup_module_from_plan_batch(pool4):
    """Fabric sets the model up before any dataloader: the batch's shape comes from ``plan_batch``; the loop reads
    the global batch of 8 at whatever dp was chosen."""
    from tests.accelerate_runs import fabric_loop, single_process_loop

    got = pool4.run(fabric_loop, strategy=dict(layout="auto", plan_batch=[2, 32]))
    assert "par3d layout='auto': chose " in pool4.log_tail(0, chars=20000), got[0]["layout"]
    assert_parity(got[0], single_process_loop())


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
