"""Parity over NCCL on CUDA devices. Marked ``gpu``; skipped where fewer than two CUDA devices exist."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_parity
from tests.gpt_runs import run_par3d, run_reference
from tests.harness import DistPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices"),
]


@pytest.fixture(scope="module")
def gpu_pool():
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy", [dict(dp_shard=2), dict(tp=2)], ids=["dp_shard=2", "tp=2"])
def test_parity_on_two_gpus(gpu_pool, strategy):
    # Matmuls in full fp32 on both sides: TF32 would round differently from the reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    got = gpu_pool.run(run_par3d, strategy=strategy, devices=2, accelerator="gpu")[0]
    assert_parity(got, run_reference(accelerator="gpu"))


@pytest.mark.parametrize("strategy", [dict(zero_stage=1), dict(zero_stage=2)], ids=["zero1", "zero2"])
def test_zero_parity_on_two_gpus(gpu_pool, strategy):
    """ZeRO-1/2's bucketed collectives over NCCL (in-place all-gather, reduce-scatter with AVG)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    got = gpu_pool.run(run_par3d, strategy=strategy, devices=2, accelerator="gpu")[0]
    assert_parity(got, run_reference(accelerator="gpu"))


def test_fp16_mixed_on_two_gpus(gpu_pool):
    """precision='16-mixed' on CUDA: the global gradient scaler, losses within fp16's bound of fp32."""
    from tests.constants import BF16_MIXED_RTOL

    torch.backends.cuda.matmul.allow_tf32 = False
    got = gpu_pool.run(run_par3d, strategy=dict(zero_stage=3), devices=2, accelerator="gpu", precision="16-mixed")[0]
    ref = run_reference(accelerator="gpu")["losses"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref, strict=True)) <= BF16_MIXED_RTOL / 2


def test_memory_stats_read_the_cuda_allocator(gpu_pool, tmp_path):
    from lightning_par3d.callbacks import MemoryStats

    stats = MemoryStats(dirpath=str(tmp_path), estimate=False, verbose=False)
    gpu_pool.run(run_par3d, strategy=dict(dp_shard=2), devices=2, accelerator="gpu", extra_callbacks=[stats])
    assert (tmp_path / "memory_stats.csv").read_text().count("cuda_peak") == 1
