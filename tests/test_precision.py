"""Mixed precision and gradient compression: they train, stay as close to fp32 as their number formats allow, and
really are in effect (a run that silently fell back to fp32 or to a plain all-reduce fails these tests)."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from tests.constants import BF16_MIXED_RTOL, BF16_TRUE_RTOL  # why these bounds: see tests/constants.py
from tests.gpt_runs import run_par3d, run_reference


@functools.cache
def reference() -> dict:
    return run_reference()


def _relative(got: list[float], want: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]


def bf16_job(strategy: dict, devices: int, precision: str) -> dict:
    """A par3d run at ``precision``, with the dtypes it really used: of the weights, and of the parameters FSDP2
    gathers (its mixed-precision policy) where FSDP2 is in use."""
    from torch.distributed.fsdp import FSDPModule

    result = run_par3d(strategy=strategy, devices=devices, precision=precision, keep_module=True)
    module = result.pop("module")
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    gather = str(fsdp[0]._get_fsdp_state()._mp_policy.param_dtype) if fsdp else None
    result["weights"] = sorted({str(p.dtype) for p in module.parameters()})
    result["gather"] = gather
    return result


@pytest.mark.parametrize(
    ("strategy", "gather"),
    [
        pytest.param(dict(zero_stage=3), "torch.bfloat16", id="zero3"),
        pytest.param(dict(zero_stage=1), None, id="zero1"),
        pytest.param(dict(zero_stage=0), None, id="zero0-ddp"),
        pytest.param(dict(tp=2), None, id="tp2"),
        pytest.param(dict(pp=2), None, id="pp2"),
        pytest.param(dict(cp=2), "torch.bfloat16", id="cp2"),
    ],
)
def test_bf16_mixed_trains_close_to_fp32(pool2, strategy, gather):
    got = pool2.run(bf16_job, strategy=strategy, devices=2, precision="bf16-mixed")[0]
    ref = reference()["losses"]
    assert got["weights"] == ["torch.float32"]  # fp32 master weights
    assert got["gather"] == gather  # FSDP2 gathers bf16 parameters; the other layouts keep fp32 weights
    assert got["losses"][-1] < got["losses"][0] - 0.5
    relative = _relative(got["losses"], ref)
    assert max(relative) <= BF16_MIXED_RTOL, relative
    assert max(relative) > 0  # autocast really ran in bf16


@pytest.mark.parametrize(
    "strategy", [dict(zero_stage=3), dict(zero_stage=1), dict(pp=2)], ids=["zero3", "zero1", "pp2"]
)
def test_bf16_true_trains_close_to_fp32(pool2, strategy):
    got = pool2.run(bf16_job, strategy=strategy, devices=2, precision="bf16-true")[0]
    assert got["weights"] == ["torch.bfloat16"]  # no fp32 copy anywhere
    assert got["losses"][-1] < got["losses"][0] - 0.5
    relative = _relative(got["losses"], reference()["losses"])
    assert max(relative) <= BF16_TRUE_RTOL, relative


# ---------------------------------------------------------------- gradient compression (DDP communication hooks)


@functools.cache
def uncompressed(pool) -> dict:
    return pool.run(run_par3d, strategy=dict(zero_stage=0), devices=2)[0]


def _param_distance(a: dict, b: dict) -> float:
    return max(((a[k].float() - v).norm() / v.norm()).item() for k, v in b.items())


def test_fp16_compression_rounds_gradients_only(pool2):
    """fp16 gradients change each update by less than fp16's resolution: the losses stay within parity's 1e-4, but
    the weights measurably leave the uncompressed run (which agrees with one process to ~4e-6)."""
    got = pool2.run(run_par3d, strategy=dict(zero_stage=0, grad_compression="fp16"), devices=2)[0]
    assert max(_relative(got["losses"], reference()["losses"])) <= 1e-4
    distance = _param_distance(got["params"], uncompressed(pool2)["params"])
    assert 1e-4 < distance < 1e-2, distance


def test_powersgd_compresses_after_its_start_iteration(pool2):
    """PowerSGD all-reduces plainly for 2 steps, then sends rank-1 approximations: the losses match one process until
    the first compressed update shows, then depart, and training still makes progress."""
    strategy = dict(zero_stage=0, grad_compression="powersgd", powersgd_rank=1, powersgd_start_iter=2)
    got = pool2.run(run_par3d, strategy=strategy, devices=2)[0]
    relative = _relative(got["losses"], reference()["losses"])
    assert max(relative[:3]) <= 1e-4, relative  # losses before and after the two plain steps
    assert max(relative[3:]) > 1e-4, relative  # the first compressed update shows
    assert got["losses"][-1] < got["losses"][0] - 0.5


def test_bf16_compression_on_cpu_is_refused_before_launch():
    from lightning_par3d import Par3DStrategy

    with pytest.raises(ValueError, match="grad_compression='bf16' uses torch's bf16_compress_hook, which needs NCCL"):
        L.Trainer(accelerator="cpu", devices=2, strategy=Par3DStrategy(zero_stage=0, grad_compression="bf16"))


def test_fp16_mixed_on_cpu_becomes_bf16_mixed():
    """Lightning turns precision='16-mixed' on CPU into bf16-mixed (with a warning); par3d serves that."""
    import lightning_par3d  # noqa: F401  (registers "par3d")

    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="par3d", precision="16-mixed", logger=False)
    assert trainer.strategy.precision == "bf16-mixed"


# ---------------------------------------------------------------- fp16 with loss scaling


class InfOnRankOne(L.Callback):
    """Puts an inf into one gradient on rank 1 only, at the first step: a sharded scaler must still make every rank
    skip that step together."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: object) -> None:
        if trainer.global_step == 0 and trainer.global_rank == 1:
            from lightning_par3d.parallel.tensor_parallel import local_tensor

            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            local_tensor(grad).view(-1)[0] = float("inf")


def fp16_job(strategy: dict, inject_inf: bool) -> dict:
    """16-mixed on CPU through an explicit plugin (Lightning's connector would turn the flag into bf16 there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_par3d.parallel.precision import GlobalGradScaler

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    callbacks = [InfOnRankOne()] if inject_inf else []
    result = run_par3d(strategy=strategy, devices=2, plugins=[plugin], keep_module=True, extra_callbacks=callbacks)
    module = result.pop("module")
    scaler = module.trainer.precision_plugin.scaler
    result["scaler"] = type(scaler).__name__
    result["scale"] = scaler.get_scale()
    steps = {int(state["step"]) for state in module.trainer.optimizers[0].state.values()}
    assert len(steps) == 1
    result["optimizer_steps"] = steps.pop()  # the steps this rank's optimizer really took
    assert isinstance(scaler, GlobalGradScaler)
    return result


@pytest.mark.parametrize("strategy", [dict(zero_stage=3), dict(tp=2)], ids=["zero3", "tp2"])
def test_fp16_mixed_trains_close_to_fp32(pool2, strategy):
    got = pool2.run(fp16_job, strategy=strategy, inject_inf=False)[0]
    assert got["scaler"] == "GlobalGradScaler"
    relative = _relative(got["losses"], reference()["losses"])
    # fp16 keeps 11 significant bits (unit roundoff 2^-12 ≈ 2.4e-4), 8× finer than bf16: half bf16-mixed's bound.
    assert max(relative) <= BF16_MIXED_RTOL / 2, relative


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(pool2):
    """An inf in rank 1's gradient shard only: both ranks skip that step and halve their scale, so the two halves of
    the sharded model stay in step (a per-rank scaler would have stepped rank 0's half alone)."""
    strategy = dict(zero_stage=3)
    clean = pool2.run(fp16_job, strategy=strategy, inject_inf=False)
    skipped = pool2.run(fp16_job, strategy=strategy, inject_inf=True)
    assert [r["optimizer_steps"] for r in clean] == [6, 6]
    assert [r["optimizer_steps"] for r in skipped] == [5, 5]
    assert skipped[0]["scale"] == skipped[1]["scale"] == clean[0]["scale"] / 2
