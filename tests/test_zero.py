"""ZeRO stages 0–3: parity with one process, the bytes each rank really holds against the ZeRO formulas, checkpoints
of the sharded optimizer state, and clear errors for stages a layout cannot serve."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_par3d import Par3DConfig, resolve_layout
from lightning_par3d.zero.buckets import shard_rows
from lightning_par3d.zero.formula import model_state_formula, tensor_state_elements
from tests.conftest import assert_parity, assert_resume_continues
from tests.gpt_runs import run_par3d, run_reference
from tests.harness import RankError

STAGES = [0, 1, 2, 3]


@functools.cache
def reference(n_layer: int = 2, **trainer_overrides: object) -> dict:
    return run_reference(model=dict(n_layer=n_layer), **trainer_overrides)


# ---------------------------------------------------------------- unit


def test_shard_rows_are_torch_chunk_sizes():
    for rows in range(1, 12):
        for n in (1, 2, 3, 4, 8):
            pieces = torch.arange(rows).chunk(n)
            for index in range(n):
                start, stop, chunk = shard_rows(rows, n, index)
                expected = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(start, stop)) == expected, (rows, n, index)
                assert chunk == len(pieces[0])


def test_formula_is_the_paper_table_when_rows_divide():
    shapes = [(8, 4), (8,)]  # Ψ = 40 elements, every dim 0 divisible by N = 4
    psi, n = 40, 4
    got = {s: model_state_formula(shapes, s, n, optimizer=_no_scalars()) for s in STAGES}
    k = 2 * 4  # Adam's two fp32 moments
    assert (got[0].params, got[0].grads, got[0].optimizer) == (4 * psi, 4 * psi, k * psi)
    assert (got[1].params, got[1].grads, got[1].optimizer) == (4 * psi, 4 * psi, k * psi // n)
    assert (got[2].params, got[2].grads, got[2].optimizer) == (4 * psi, 4 * psi // n, k * psi // n)
    assert (got[3].params, got[3].grads, got[3].optimizer) == (4 * psi // n, 4 * psi // n, k * psi // n)


def test_formula_counts_padding_where_storage_holds_it():
    # 5 rows over 4 ranks: chunks of 2 rows, the last rank owns none.
    assert tensor_state_elements((5, 3), 1, 4, index=0) == (8 * 3, 5 * 3, 2 * 3)
    assert tensor_state_elements((5, 3), 2, 4, index=3) == (8 * 3, 2 * 3, 0)
    assert tensor_state_elements((5, 3), 3, 4, index=2) == (2 * 3, 2 * 3, 1 * 3)
    assert tensor_state_elements((), 2, 4) == (1, 1, 1)  # 0-d: not cut


def _no_scalars():
    from lightning_par3d.zero.formula import OptimizerStateLayout

    return OptimizerStateLayout(2, 0)


@pytest.mark.parametrize(
    ("fields", "world", "message"),
    [
        (dict(zero_stage=4), 4, "zero_stage=4 is not a ZeRO stage. Allowed: 0 (replicate everything, DDP), 1"),
        (dict(zero_stage=2, pp=2), 4, "zero_stage=2 reduce-scatters gradients in every backward pass"),
        (dict(zero_stage=1, tp=2), 2, "zero_stage=1 shards across the dp_shard ranks, but dp_shard=1 here"),
        (dict(zero_stage=1, offload=True), 4, "offload=True moves the shards of parameters, gradients and optimizer"),
        (dict(dp_replicate=4, offload=True), 4, "which needs zero_stage=3; here zero_stage=0"),
        (dict(grad_compression="fp16"), 4, "grad_compression='fp16' compresses DDP's gradient all-reduce"),
        (dict(grad_compression="int8"), 4, "grad_compression='int8' is not a compression"),
        (dict(zero_stage=1, reshard_after_forward=False), 4, "reshard_after_forward=False applies to FSDP2"),
        (dict(powersgd_start_iter=1), 4, "powersgd_start_iter=1 must be at least 2"),
    ],
)
def test_bad_zero_settings_fail_before_launch(fields, world, message):
    with pytest.raises(ValueError, match="Invalid par3d configuration") as err:
        resolve_layout(Par3DConfig(**fields), world)
    assert message in str(err.value)


def test_stage_zero_turns_shard_ranks_into_replicas():
    layout = resolve_layout(Par3DConfig(zero_stage=0, tp=2), 8)
    assert (layout.dp_replicate, layout.dp_shard, layout.zero) == (4, 1, 0)
    assert resolve_layout(Par3DConfig(), 4).zero == 3
    assert resolve_layout(Par3DConfig(dp_replicate=4), 4).zero == 0


def test_precision_that_a_stage_cannot_serve_fails_before_launch():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_par3d import Par3DStrategy

    with pytest.raises(ValueError, match="precision='16-mixed' scales the loss and unscales gradients"):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=Par3DStrategy(zero_stage=1),
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        )


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("stage", STAGES)
def test_parity_each_stage_dp2(pool2, stage):
    got = pool2.run(run_par3d, strategy=dict(zero_stage=stage), devices=2)[0]
    assert_parity(got, reference())


@pytest.mark.parametrize("stage", STAGES)
def test_parity_each_stage_dp4(pool4, stage):
    got = pool4.run(run_par3d, strategy=dict(zero_stage=stage), devices=4)[0]
    assert_parity(got, reference())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(zero_stage=1, dp_shard=2, tp=2), id="zero1-dp2xtp2"),
        pytest.param(dict(zero_stage=2, dp_shard=2, tp=2), id="zero2-dp2xtp2"),
        pytest.param(dict(zero_stage=1, dp_replicate=2, dp_shard=2), id="zero1-replicate2xshard2"),
        pytest.param(dict(zero_stage=2, dp_replicate=2, dp_shard=2), id="zero2-replicate2xshard2"),
    ],
)
def test_parity_zero_with_tp_and_replicas(pool4, strategy):
    got = pool4.run(run_par3d, strategy=strategy, devices=4)[0]
    assert_parity(got, reference())


@pytest.mark.parametrize("stage", [1, 2])
def test_parity_zero_with_clipping_and_accumulation(pool4, stage):
    """Stage 2 clips by the norm over every rank's gradient rows; both stages accumulate over 2 batches (stage 1
    without reducing the first, stage 2 reduce-scattering each)."""
    overrides = dict(gradient_clip_val=0.5, accumulate_grad_batches=2)
    got = pool4.run(run_par3d, strategy=dict(zero_stage=stage, dp_shard=2, tp=2), devices=4, **overrides)[0]
    assert_parity(got, reference(**overrides))


def run_with_warnings(**kwargs: Any) -> dict:
    """:func:`run_par3d`, with the warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_par3d(**kwargs)
    return {**result, "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("stage", [1, 2])
def test_parity_zero_with_an_lr_scheduler(pool2, stage):
    """A step-wise LambdaLR warm-up bound to the module's AdamW: the ZeRO wrapper shares its parameter groups, so
    every step uses the scheduled learning rate, and the scheduler sees the wrapper's steps (no "lr_scheduler.step()
    before optimizer.step()" warning)."""
    model = dict(warmup_steps=4)
    ref = run_reference(model=model)
    got = pool2.run(run_with_warnings, strategy=dict(zero_stage=stage), devices=2, model=model)[0]
    assert_parity(got, ref)
    assert ref["losses"] != reference()["losses"]  # the warm-up really changed the trajectory
    assert not [w for w in got["warnings"] if "lr_scheduler.step()" in w], got["warnings"]


def test_parity_zero1_under_pipelining(pool4):
    """pp=2 × dp_shard=2 at ZeRO-1: gradients stay local through the schedule and are all-reduced once."""
    got = pool4.run(run_par3d, strategy=dict(zero_stage=1, pp=2), devices=4, model=dict(n_layer=4))[0]
    assert_parity(got, reference(n_layer=4))


def test_parity_offload_stage3(pool2):
    got = pool2.run(run_par3d, strategy=dict(zero_stage=3, offload=True), devices=2)[0]
    assert_parity(got, reference())


# ---------------------------------------------------------------- measured bytes against the formulas


class StateBytesProbe(L.Callback):
    """Counts the model state this rank holds just before the optimizer's second step (gradients present, and
    optimizer state from the first step)."""

    def __init__(self) -> None:
        self.measured: Any = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        from lightning_par3d.memory.meters import model_state_bytes

        if trainer.global_step == 1:
            self.measured = model_state_bytes(pl_module, trainer.optimizers)


def memory_job(stage: int, devices: int) -> dict:
    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, trainer_kwargs

    L.seed_everything(0, verbose=False)
    probe = StateBytesProbe()
    strategy = Par3DStrategy(zero_stage=stage, timeout_s=120)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=[probe], **trainer_kwargs(max_steps=2))
    module = GPTModule(**MODEL)
    trainer.fit(module, ShakespeareDataModule(batch_size=GLOBAL_BATCH // devices, **DATA))
    shapes = [tuple(p.shape) for p in module.parameters()]  # global shapes (no tp here)
    layout = strategy.layout
    index = strategy.mesh.coords(trainer.global_rank).dp_shard
    return {"measured": probe.measured, "shapes": shapes, "n": layout.dp_shard, "index": index, "zero": layout.zero}


@pytest.mark.parametrize("pool", [2, 4, 8], indirect=True)
def test_measured_bytes_match_the_zero_formulas(pool):
    for stage in STAGES:
        for rank, got in enumerate(pool.run(memory_job, stage=stage, devices=pool.world_size, timeout=400)):
            assert got["zero"] == stage
            expected = model_state_formula(got["shapes"], stage, got["n"], got["index"])
            measured = got["measured"]
            for kind in ("params", "grads", "optimizer"):
                want, have = getattr(expected, kind), getattr(measured, kind)
                assert abs(have - want) <= 0.05 * want, f"stage {stage}, rank {rank}, {kind}: {have} vs {want}"


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("stage", STAGES)
def test_resume_restores_each_stage(pool2, tmp_path: Path, stage):
    assert_resume_continues(pool2, str(tmp_path), 8, strategy=dict(zero_stage=stage), devices=2)


@pytest.mark.parametrize(
    "strategy",
    [dict(zero_stage=1, dp_shard=4), dict(zero_stage=2, dp_shard=2, tp=2), dict(zero_stage=1, pp=2, dp_shard=2)],
    ids=["zero1-dp4", "zero2-dp2xtp2", "zero1-pp2xdp2"],
)
def test_fabric_checkpoint_restores_zero_state_exactly(pool4, tmp_path: Path, strategy):
    from tests.fabric_runs import fabric_checkpoint_job

    results = pool4.run(fabric_checkpoint_job, strategy=strategy, path=str(tmp_path / "ckpt"))
    assert all(r == {"params": True, "optimizer": True, "step": 1} for r in results), results


def full_export_job(steps: int) -> dict:
    """ZeRO-1 at dp_shard=2 × tp=2 for ``steps`` steps: the full optimizer export (rank 0), and whether loading it
    into a fresh wrapper restores every rank's rows and the learning rate exactly."""
    import torch.distributed as dist

    from examples.fabric_train import fabric_train
    from examples.gpt import GPT_TP_PLAN
    from lightning_par3d import Par3DFabricStrategy
    from lightning_par3d.zero.optimizer import ZeroOptimizer
    from tests.gpt_runs import DATA, MODEL, SEED

    strategy = Par3DFabricStrategy(tp_plan=GPT_TP_PLAN, dp_shard=2, tp=2, zero_stage=1)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    config = {k: v for k, v in MODEL.items() if k not in ("lr", "eps")}
    _, model, optimizer = fabric_train(fabric, steps, 8, config, DATA, eps=MODEL["eps"], seed=SEED)
    zero = optimizer.optimizer
    assert isinstance(zero, ZeroOptimizer)
    full = zero.full_state_dict()
    fresh = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1.0), 1, strategy.mesh)
    fresh.load_state_dict(full)
    same = all(
        torch.equal(fresh.inner.state[a][k], zero.inner.state[b][k])
        for a, b in zip(fresh.inner.state, zero.inner.state, strict=True)
        for k in ("exp_avg", "exp_avg_sq", "step")
    )
    same = same and fresh.param_groups[0]["lr"] == zero.param_groups[0]["lr"]
    fresh.close()
    names = [name for name, _ in model.named_parameters()]
    state = {name: full["state"][i] for i, name in enumerate(names)} if dist.get_rank() == 0 else None
    return {"state": state, "same": same}


def single_process_adam_state(steps: int) -> dict:
    from examples.fabric_train import fabric_train
    from tests.gpt_runs import DATA, MODEL, SEED

    config = {k: v for k, v in MODEL.items() if k not in ("lr", "eps")}
    fabric = L.Fabric(accelerator="cpu", devices=1)
    _, model, optimizer = fabric_train(fabric, steps, 8, config, DATA, eps=MODEL["eps"], seed=SEED)
    return {name: dict(optimizer.state[p]) for name, p in model.named_parameters()}


def test_full_export_is_the_single_process_optimizer_state(pool4):
    """The gathered ZeRO-1 state (tp and dp pieces put together) equals, per parameter, the AdamW state of one
    process that trained the same steps; loading it back restores every rank's rows exactly."""
    results = pool4.run(full_export_job, steps=4)
    assert all(r["same"] for r in results)
    expected = single_process_adam_state(4)
    exported = results[0]["state"]
    assert sorted(exported) == sorted(expected)
    for name, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            want, have = state[key], exported[name][key]
            scale = want.abs().max().item()
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4 * scale, msg=f"{name}.{key}")
        assert exported[name]["step"].item() == state["step"].item()


# ---------------------------------------------------------------- errors on every rank


def non_elementwise_job() -> None:
    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from tests.gpt_runs import DATA, MODEL, trainer_kwargs

    class Adafactor(GPTModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)

    trainer = L.Trainer(devices=2, strategy=Par3DStrategy(zero_stage=1, timeout_s=60), **trainer_kwargs(max_steps=1))
    trainer.fit(Adafactor(**MODEL), ShakespeareDataModule(batch_size=4, **DATA))


def test_non_elementwise_optimizer_is_refused_on_every_rank(pool2):
    with pytest.raises(RankError) as err:
        pool2.run(non_elementwise_job, timeout=120)
    assert err.value.all_ranks_failed
    assert err.value.exc_type == "TypeError"
    assert re.search(r"Adafactor is not known to be one \(known: .*AdamW", err.value.exc_message)
