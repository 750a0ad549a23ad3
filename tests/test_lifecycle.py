"""Long-lived processes: fit then test/validate/predict and a second fit on one Trainer; flat threads and file
descriptors over many fits; damaged checkpoints fail clearly; a checkpoint resumes at another layout."""

from __future__ import annotations

import functools
import gc
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from examples.data import ShakespeareDataModule
from examples.fabric_train import gpt_loss
from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig, GPTModule
from tests.conftest import assert_parity
from tests.constants import ONE_BATCH_EPOCHS
from tests.gpt_runs import (
    GLOBAL_BATCH,
    MODEL,
    SEED,
    LossRecorder,
    ReferenceData,
    full_state,
    run_par3d,
    run_reference,
    trainer_kwargs,
)
from tests.harness import RankError

# 48 training windows (whole global batches: no sampler pads) and 16 held-out ones (divisible by every dp).
LIFE_DATA = dict(block_size=32, max_bytes=2051, val_fraction=0.25)
# The second fit builds a fresh AdamW (Lightning calls configure_optimizers again), whose first step moves every weight
# by lr · g / (|g| + eps): a gradient near eps turns rounding-level differences into visible ones (1.9e-4 of a
# tensor's scale at eps=1e-6, one element). eps=1e-5 keeps that step a smooth function of the gradient (1.6e-5).
LIFE_MODEL = {**MODEL, "eps": 1e-5}


def fit_then_evaluate(strategy: dict[str, Any] | None, devices: int = 1, model: dict | None = None) -> dict[str, Any]:
    """On one Trainer and module: fit 3 steps, test, validate, predict, then fit on to 6 steps."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    recorder = LossRecorder()
    kwargs = trainer_kwargs(max_steps=3, limit_val_batches=None, limit_test_batches=None)
    if strategy is None:
        trainer = L.Trainer(devices=1, callbacks=[recorder], **kwargs)
        data: ShakespeareDataModule = ReferenceData(batch_size=GLOBAL_BATCH, **LIFE_DATA)
        dp, dp_rank, last = 1, 0, True
    else:
        par3d = Par3DStrategy(timeout_s=120, **strategy)
        trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=[recorder], **kwargs)
        dp = par3d.layout.dp
        data = ShakespeareDataModule(batch_size=GLOBAL_BATCH // dp, **LIFE_DATA)
    module = GPTModule(**{**LIFE_MODEL, **(model or {})})
    trainer.fit(module, data)
    tested = trainer.test(module, data, verbose=False)[0]
    validated = trainer.validate(module, data, verbose=False)[0]
    predictions = trainer.predict(module, dataloaders=data.val_dataloader())
    trainer.fit_loop.epoch_loop.max_steps = 6  # a second fit that continues training
    trainer.fit(module, data)
    if strategy is not None:
        dp_rank, last = par3d.engine.dp_rank, par3d.engine.holds_last_stage
    first = predictions[0] if last and predictions else None
    return {
        "losses": recorder.losses,
        "params": full_state(module),
        "test_loss": tested["test_loss"],
        "val_loss": validated["val_loss"],
        "test_ppl": tested["test_ppl"],
        "prediction": (dp, dp_rank, first.detach().cpu() if first is not None else None),
    }


@functools.cache
def lifecycle_reference() -> dict[str, Any]:
    return fit_then_evaluate(None)


def _check_lifecycle(per_rank: list[dict[str, Any]]) -> None:
    ref = lifecycle_reference()
    assert_parity(per_rank[0], ref)  # 3 steps, evaluation in between, 3 more: the single-process trajectory
    ref_logits = ref["prediction"][2]
    compared = 0
    for got in per_rank:
        for key in ("test_loss", "val_loss", "test_ppl"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key
        dp, dp_rank, logits = got["prediction"]
        if logits is not None:  # the ranks holding the last stage read samples dp_rank, dp_rank + dp, …
            expected = ref_logits[dp_rank::dp][: logits.shape[0]]
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
            compared += 1
    assert compared > 0


@pytest.mark.parametrize("strategy", [dict(dp_shard=2, tp=2), dict(pp=2, tp=2)], ids=["dp2xtp2", "pp2xtp2"])
def test_fit_then_test_validate_predict_and_fit_again(pool4, strategy):
    _check_lifecycle(pool4.run(fit_then_evaluate, strategy=strategy, devices=4))


def test_fit_then_test_validate_predict_and_fit_again_in_3d(pool8):
    _check_lifecycle(pool8.run(fit_then_evaluate, strategy=dict(pp=2, dp_shard=2, tp=2), devices=8))


# ---------------------------------------------------------------- long-lived processes


def many_fits(strategy: dict[str, Any], fits: int, rebuild_meshes: bool = False) -> list[tuple[int, int]]:
    """``fits`` fits of fresh Trainers and modules in this process; OS threads and open descriptors after each.
    ``rebuild_meshes`` is the sabotage: a new mesh and new groups for every fit, as before they were shared."""
    from lightning_par3d.distributed import groups

    original = groups.acquire_mesh
    if rebuild_meshes:

        def rebuilt(layout: Any, *args: Any, **kwargs: Any) -> Any:
            groups._MESHES.clear()
            groups._GROUPS.clear()
            return original(layout, *args, **kwargs)

        groups.acquire_mesh = rebuilt
    try:
        counts = []
        for _ in range(fits):
            run_par3d(strategy=strategy, devices=2, max_steps=1, data=ONE_BATCH_EPOCHS)
            gc.collect()
            counts.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
        return counts
    finally:
        groups.acquire_mesh = original


@pytest.mark.parametrize("strategy", [dict(dp_shard=2), dict(tp=2), dict(pp=2)], ids=["dp_shard=2", "tp=2", "pp=2"])
def test_threads_and_descriptors_stay_flat_over_eight_fits(pool2, strategy):
    """A leak of one thread or descriptor per fit climbs 7 over the fits after the first: more than the 3 allowed."""
    counts = pool2.run(many_fits, strategy=strategy, fits=8)[0]
    threads, descriptors = zip(*counts, strict=True)
    assert max(threads) - threads[0] <= 3, threads
    assert max(descriptors) - descriptors[0] <= 3, descriptors


def test_the_flatness_check_sees_a_leak(pool2):
    """The check above can fail: with new groups per fit (the old behaviour) the thread count climbs."""
    counts = pool2.run(many_fits, strategy=dict(dp_shard=2), fits=3, rebuild_meshes=True)[0]
    threads = [c[0] for c in counts]
    assert threads[-1] - threads[0] >= 8, threads


# ---------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("good")
    pool2.run(
        run_par3d, strategy=dict(dp_shard=2), devices=2, max_steps=1, data=ONE_BATCH_EPOCHS, ckpt_dir=str(directory)
    )
    return directory / "last.ckpt"


def _damaged(saved: Path, tmp_path: Path, damage: str) -> Path:
    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(saved, copy)
    if damage == "missing shard":
        next(copy.glob("__1_*.distcp")).unlink()
    elif damage == "truncated shard":
        shard = next(copy.glob("__0_*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "truncated meta.pt":
        meta = copy / "meta.pt"
        meta.write_bytes(meta.read_bytes()[:100])
    return copy


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("missing shard", r"shard file .*__1_0\.distcp is missing"),
        ("truncated shard", r"shard file .*__0_0\.distcp is truncated: \d+ bytes, but the checkpoint's metadata"),
        ("truncated meta.pt", r"meta\.pt is truncated \(100 bytes; its end is missing"),
    ],
)
def test_a_damaged_checkpoint_fails_clearly_on_every_rank(pool2, saved, tmp_path, damage, says):
    import re

    path = _damaged(saved, tmp_path, damage)
    with pytest.raises(RankError) as err:
        pool2.run(run_par3d, strategy=dict(dp_shard=2), devices=2, data=ONE_BATCH_EPOCHS, resume_from=str(path))
    assert err.value.all_ranks_failed
    assert f"Cannot load the par3d checkpoint {path}" in err.value.exc_message
    assert re.search(says, err.value.exc_message), err.value.exc_message


def test_another_models_checkpoint_fails_clearly(pool2, saved):
    with pytest.raises(RankError) as err:
        pool2.run(
            run_par3d,
            strategy=dict(dp_shard=2),
            devices=2,
            data=ONE_BATCH_EPOCHS,
            resume_from=str(saved),
            model=dict(n_embd=64),
        )
    assert err.value.all_ranks_failed
    assert "tensors have other shapes" in err.value.exc_message
    assert "it is another model's checkpoint" in err.value.exc_message


# ---------------------------------------------------------------- resume at another layout


@functools.cache
def one_batch_reference() -> dict:
    return run_reference(max_steps=6, data=ONE_BATCH_EPOCHS)


LAYOUT_CHANGES = [
    pytest.param(dict(dp_shard=2, tp=2), dict(pp=2, dp_shard=2), id="dp2xtp2-to-pp2xdp2"),
    pytest.param(dict(pp=2, tp=2), dict(dp_shard=4), id="pp2xtp2-to-dp_shard4"),
    pytest.param(dict(dp_shard=4, zero_stage=1), dict(pp=2, tp=2), id="zero1-to-pp2xtp2"),
    pytest.param(dict(dp_replicate=4), dict(dp_shard=4), id="ddp-to-fsdp2"),
    pytest.param(dict(cp=2, dp_shard=2), dict(cp=4), id="cp2xdp2-to-cp4"),
]


@pytest.mark.parametrize(("before", "after"), LAYOUT_CHANGES)
def test_resume_at_another_layout_continues_the_single_process_trajectory(pool4, tmp_path, before, after):
    pool4.run(run_par3d, strategy=before, devices=4, max_steps=3, data=ONE_BATCH_EPOCHS, ckpt_dir=str(tmp_path))
    resumed = pool4.run(
        run_par3d,
        strategy=after,
        devices=4,
        max_steps=6,
        data=ONE_BATCH_EPOCHS,
        resume_from=str(tmp_path / "last.ckpt"),
    )[0]
    whole = one_batch_reference()
    done = len(resumed["losses"])
    assert_parity(
        {"losses": resumed["losses"], "params": resumed["params"]}, {**whole, "losses": whole["losses"][-done:]}
    )


def fabric_resume(strategy: dict[str, Any] | None, path: str, start: int, stop: int, devices: int = 4) -> dict:
    """Steps ``start``..``stop`` of a Fabric loop; loads ``path`` first if ``start`` > 0, saves it at the end."""
    from lightning_par3d import Par3DFabricStrategy

    if strategy is None:
        fabric = L.Fabric(accelerator="cpu", devices=1)
    else:
        fabric = L.Fabric(
            accelerator="cpu", devices=devices, strategy=Par3DFabricStrategy(tp_plan=GPT_TP_PLAN, **strategy)
        )
    fabric.launch()
    fabric.seed_everything(SEED)
    with fabric.init_module():
        model = GPT(GPTConfig(**{k: v for k, v in MODEL.items() if k not in ("lr", "eps")}))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=MODEL["lr"], eps=MODEL["eps"]))
    if start:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        assert state["step"] == start
    data = ShakespeareDataModule(**{"block_size": 32, **ONE_BATCH_EPOCHS})
    data.setup()
    split = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=SEED, **split)
    loader = DataLoader(data.train_set, GLOBAL_BATCH // split["num_replicas"], sampler=sampler)
    losses = []
    for step in range(start, stop):
        sampler.set_epoch(step)  # one batch per epoch
        x, y = next(iter(loader))
        if strategy is None:
            loss = gpt_loss(model(x), y)
            fabric.backward(loss)
        else:
            loss = fabric.strategy.train_step(model, x, y, gpt_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    if strategy is not None:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": stop})
    params = full_state(model)
    if params is not None:
        params = {k.removeprefix("trunk."): v for k, v in params.items()}
    return {"losses": losses, "params": params}


@functools.cache
def fabric_reference() -> dict:
    return fabric_resume(None, "", 0, 6)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(dict(dp_shard=2, tp=2), dict(pp=2, dp_shard=2), id="dp2xtp2-to-pp2xdp2"),
        pytest.param(dict(pp=2, tp=2), dict(dp_shard=4), id="pp2xtp2-to-dp_shard4"),
    ],
)
def test_fabric_resume_at_another_layout(pool4, tmp_path, before, after):
    path = str(tmp_path / "fabric.ckpt")
    first = pool4.run(fabric_resume, strategy=before, path=path, start=0, stop=3)[0]
    second = pool4.run(fabric_resume, strategy=after, path=path, start=3, stop=6)[0]
    ref = fabric_reference()
    assert_parity({"losses": first["losses"] + second["losses"], "params": second["params"]}, ref)


# ---------------------------------------------------------------- releasing the meshes


AT_EXIT_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from lightning_par3d.distributed import groups
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
atexit.register(lambda: print("groups at exit:", dist.is_initialized(), len(handlers), flush=True))
handlers = []
original = atexit.register
atexit.register = lambda f, *a, **k: handlers.append(f) or original(f, *a, **k)
groups.destroy_groups_at_exit()
groups.destroy_groups_at_exit()  # once per process however many runs set up
atexit.register = original
dist.new_group([0])
print("trained", flush=True)
"""


def test_a_process_that_ran_par3d_destroys_its_process_groups_at_exit(new_interpreter):
    """The exit handler a run's setup registers (once per process) destroys the default group and every group made
    over it before the interpreter is torn down, which a job that leaves gloo groups alive (Lightning's Trainer
    never destroys the default one) could abort in ("terminate called without an active exception"). A handler
    registered before it runs after it (atexit runs last in, first out) and sees no group."""
    import sys

    from tests.ports import free_port

    done = new_interpreter([sys.executable, "-c", AT_EXIT_SCRIPT, str(free_port())], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["trained", "groups", "at", "exit:", "False", "1"], done.stdout


def test_destroy_meshes_releases_the_groups_threads(new_interpreter):
    """par3d keeps one mesh per layout for the life of the process (DTensor's caches), and
    ``groups.destroy_meshes()`` gives their process groups and transport threads back. A fresh 2-process job
    (``tests/mesh_threads_script.py``), not the pool: destroyed meshes would poison later jobs at the same layout in
    a long-lived worker."""
    import json
    import subprocess
    import sys

    from tests.launch import ROOT, clean_env
    from tests.ports import free_port

    port = str(free_port())
    script = [sys.executable, "tests/mesh_threads_script.py"]
    ranks = [
        subprocess.Popen([*script, str(rank), port], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    for got in (json.loads(out.strip().splitlines()[-1]) for out in outputs):
        assert got["destroyed"] == 3, got
        assert got["held"] - got["before"] >= 6, got  # each layout's groups hold transport threads
        assert got["after"] <= got["before"] + 1, got
