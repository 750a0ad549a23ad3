"""Fabric parity, and checkpoint resume at the same layout (Trainer and Fabric)."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch

from examples.fabric_train import fabric_train
from examples.gpt import GPT_TP_PLAN
from tests.conftest import assert_parity
from tests.constants import BF16_MIXED_RTOL, DATA, MODEL, ONE_BATCH_EPOCHS, SEED
from tests.fabric_runs import FABRIC_MODEL, fabric_checkpoint_job
from tests.gpt_runs import full_state, run_par3d

FABRIC_DATA = {k: v for k, v in DATA.items()}


def fabric_job(
    devices: int,
    strategy: dict | None,
    steps: int = 6,
    clip: float | None = None,
    model: dict | None = None,
    precision: str = "32-true",
) -> dict:
    from lightning_par3d import Par3DFabricStrategy

    if strategy is None:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    else:
        par3d = Par3DFabricStrategy(tp_plan=GPT_TP_PLAN, **strategy)
        fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=par3d, precision=precision)
    fabric.launch()
    losses, model, _ = fabric_train(
        fabric, steps, 8, {**FABRIC_MODEL, **(model or {})}, FABRIC_DATA, eps=MODEL["eps"], clip=clip, seed=SEED
    )
    params = full_state(model)
    if params is not None:  # under pp the model is the trunk of a PipelineHost
        params = {k.removeprefix("trunk."): v for k, v in params.items()}
    return {"losses": losses, "params": params, "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


@functools.cache
def fabric_reference(clip: float | None, n_layer: int = 2) -> dict:
    return fabric_job(1, None, clip=clip, model=dict(n_layer=n_layer))


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clip=0.5"])
def test_fabric_parity_dp2_tp2(pool4, clip):
    got = pool4.run(fabric_job, devices=4, strategy=dict(dp_shard=2, tp=2), clip=clip)[0]
    assert_parity(got, fabric_reference(clip))


def test_fabric_parity_cp2_dp2(pool4):
    """Context parallelism under Fabric: each row split over 2 ranks, 2 data-parallel ranks."""
    got = pool4.run(fabric_job, devices=4, strategy=dict(cp=2, dp_shard=2))[0]
    assert_parity(got, fabric_reference(None))


def test_fabric_train_step_pp2_tp2(pool4):
    """`fabric.strategy.train_step` runs the 1F1B schedule at pp=2 × tp=2, with clipping over both stages."""
    got = pool4.run(fabric_job, devices=4, strategy=dict(pp=2, tp=2), clip=0.5, model=dict(n_layer=4))[0]
    assert_parity(got, fabric_reference(0.5, n_layer=4))


def test_fabric_bf16_mixed_train_step(pool4):
    """Fabric's precision='bf16-mixed' at pp=2 × tp=2: train_step runs the schedule under the precision's
    autocast; fp32 weights, losses within bf16-mixed's bound of fp32 (see tests/test_precision.py)."""
    got = pool4.run(fabric_job, devices=4, strategy=dict(pp=2, tp=2), model=dict(n_layer=4), precision="bf16-mixed")
    ref = fabric_reference(None, n_layer=4)["losses"]
    relative = [abs(a - b) / b for a, b in zip(got[0]["losses"], ref, strict=True)]
    assert got[0]["dtypes"] == ["torch.float32"]
    assert 0 < max(relative) <= BF16_MIXED_RTOL, relative


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async_save"])
def test_trainer_resume_continues_the_loss_trajectory(pool4, tmp_path: Path, async_save: bool):
    """8 steps uninterrupted against 4 steps, a sharded checkpoint, and 4 more steps resumed from it in a new
    Trainer: the resumed losses and final parameters equal the uninterrupted ones within 1e-6. The model has dropout:
    each rank's random generators are in the checkpoint, so the resumed run draws the masks the whole run drew.
    With ``async_save`` a checkpoint is written each step while the next trains (each save waits for the last)."""
    strategy = dict(dp_shard=2, tp=2)
    run = functools.partial(pool4.run, run_par3d, devices=4, data=ONE_BATCH_EPOCHS, model=DROPOUT)
    whole = run(strategy=strategy, max_steps=8)[0]
    run = functools.partial(run, strategy=dict(strategy, async_save=async_save))
    first = run(max_steps=4, ckpt_dir=str(tmp_path))[0]
    assert first["saved"][-2:] == ["epoch=3-step=4.ckpt", "last.ckpt"]
    last = tmp_path / "last.ckpt"
    assert (last / ".metadata").is_file() and (last / "meta.pt").is_file()
    assert len(list(last.glob("*.distcp"))) == 4  # one shard file per rank
    assert sorted(p.name for p in (last / "rng").iterdir()) == [f"rank{r}.pt" for r in range(4)]
    resumed = run(max_steps=8, resume_from=str(last))[0]
    assert len(resumed["losses"]) == 4
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][4:]), rtol=0, atol=1e-6)
    for name, value in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6, msg=name)


DROPOUT = dict(dropout=0.1)


def test_random_streams_restore_at_the_same_layout_and_start_afresh_at_another(tmp_path: Path):
    from lightning_par3d.checkpoint import rng

    cpu = torch.device("cpu")
    rng.write(tmp_path, 0, cpu)
    expected = torch.rand(4)
    assert rng.load(tmp_path, 0, "pp=2 on 4 ranks", "pp=2 on 4 ranks", cpu)
    assert torch.equal(torch.rand(4), expected)
    afresh = r"saved by the ranks of pp=2 on 4 ranks; this run is tp=2 on 2 ranks.*dropout"
    with pytest.warns(UserWarning, match=afresh):
        assert not rng.load(tmp_path, 0, "pp=2 on 4 ranks", "tp=2 on 2 ranks", cpu)
    assert not rng.load(tmp_path, 0, None, "tp=2 on 2 ranks", cpu)  # saved without streams: nothing to say


def test_a_missing_checkpoint_is_a_clear_error(pool4, tmp_path: Path):
    from tests.harness import RankError

    with pytest.raises(RankError) as err:
        pool4.run(run_par3d, strategy=dict(dp_shard=2, tp=2), devices=4, resume_from=str(tmp_path / "nope.ckpt"))
    assert err.value.all_ranks_failed
    assert "is not a par3d checkpoint" in err.value.exc_message


@pytest.mark.parametrize("strategy", [dict(dp_shard=2, tp=2), dict(pp=2, tp=2)], ids=["dp2xtp2", "pp2xtp2"])
def test_fabric_checkpoint_round_trip(pool4, tmp_path: Path, strategy):
    results = pool4.run(fabric_checkpoint_job, strategy=strategy, path=str(tmp_path / "ckpt"))
    assert all(r == {"params": True, "optimizer": True, "step": 1} for r in results), results
