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
