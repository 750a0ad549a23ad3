"""The NCCL paths, in tiers by the CUDA devices a test needs (``@pytest.mark.gpu(n)``; ``conftest`` skips a tier the
machine cannot hold, and ``PAR3D_REQUIRE_GPUS=N`` fails a session that sees fewer than N devices):

* 1 GPU: par3d on one CUDA device (every size 1: the CUDA placement, an NCCL group of one, checkpointing, DCP),
  bf16-mixed, a save and resume, MemoryStats on the CUDA allocator, and a tiny Qwen3-MoE (its experts' CUDA
  kernels, eager and compiled); the machine most users try first;
* 2 GPUs: FSDP2, tensor parallelism, ZeRO-1/2, the pipeline (send/recv), context parallelism (NCCL's all-gather
  of the keys and values, CUDA's attention with the mask), bf16-mixed, fp16-mixed with its scaler, bf16 gradient
  compression, a save and resume, MemoryStats on the CUDA allocator, and a failing rank;
* 4 GPUs: HSDP, dp_shard × tp, pp × tp, cp × dp_shard;
* 8 GPUs: the demo's 3D layout, HSDP × tp, and the Accelerate example through ``accelerate launch`` with
  ``conf/accelerate/gpu8.yaml``.

Parity is against one process on one GPU, fp32 with TF32 off on every rank (the pool's workers turn it off), whose
model is built on the CPU as par3d's rank 0 builds it (``init="rank0"``): Lightning's single-device strategy builds it
on the GPU, whose generator draws other weights from the same seed (the first 1-GPU run here, 2026-11-25, differed
by 0.3 % at its first loss for that reason alone)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_parity, assert_resume_continues
from tests.constants import BF16_MIXED_RTOL, FAULT_TIMEOUT_S
from tests.gpt_runs import run_par3d, run_reference
from tests.harness import DistPool

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def gpu_pool(size: int) -> DistPool:
    """One pool of ``size`` GPU ranks for the session (closed at exit by the harness's daemon workers)."""
    return DistPool(size)


@functools.cache
def reference() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return run_reference(accelerator="gpu", build_on_cpu=True)  # par3d's rank 0 builds on the CPU (init="rank0")


def _parity(size: int, **strategy: object) -> None:
    got = gpu_pool(size).run(run_par3d, strategy=strategy, devices=size, accelerator="gpu")[0]
    assert_parity(got, reference())


def _close_to_fp32(size: int, precision: str, **strategy: object) -> None:
    got = gpu_pool(size).run(run_par3d, strategy=strategy, devices=size, accelerator="gpu", precision=precision)[0]
    ref = reference()["losses"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref, strict=True)) <= BF16_MIXED_RTOL


# ---------------------------------------------------------------- 1 GPU


@pytest.mark.gpu(1)
@pytest.mark.parametrize("strategy", [dict(), dict(activation_checkpointing="full")], ids=["plain", "full-ac"])
def test_parity_on_one_gpu(strategy):
    """par3d at world size 1 on a CUDA device trains to the losses and parameters of Lightning's own single-device
    run on the same GPU (its model built on the CPU, as par3d's rank 0 builds it)."""
    _parity(1, **strategy)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_compile_on_one_gpu(ac):
    """compile=True on CUDA (inductor and Triton; fp32, TF32 off): the eager single-GPU run's losses and parameters,
    the blocks sharing graphs, and no recompilation after the first step."""
    from tests.compile_runs import run_compiled

    strategy = dict(compile=True, activation_checkpointing=ac)
    got = gpu_pool(1).run(run_compiled, strategy=strategy, devices=1, accelerator="gpu")[0]
    assert_parity(got, reference())
    assert got["graphs"][0] >= 1 and set(got["graphs"]) == {got["graphs"][0]}, got["graphs"]


@pytest.mark.gpu(1)
def test_bf16_mixed_on_one_gpu():
    _close_to_fp32(1, "bf16-mixed")


@pytest.mark.gpu(1)
def test_save_and_resume_on_one_gpu(tmp_path):
    assert_resume_continues(gpu_pool(1), str(tmp_path), 6, strategy={}, devices=1, accelerator="gpu")


@pytest.mark.gpu(1)
def test_memory_stats_read_the_cuda_allocator_on_one_gpu(tmp_path):
    from lightning_par3d.callbacks import MemoryStats

    stats = MemoryStats(dirpath=str(tmp_path), estimate=False, verbose=False)
    gpu_pool(1).run(run_par3d, strategy={}, devices=1, accelerator="gpu", extra_callbacks=[stats])
    assert (tmp_path / "memory_stats.csv").read_text().count("cuda_peak") == 1


@functools.cache
def moe_reference() -> dict:
    from tests import hf_runs
    from tests.test_moe import MOE

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return hf_runs.run_reference(MOE["qwen3_moe"], accelerator="gpu", build_on_cpu=True)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("strategy", [dict(), dict(compile=True)], ids=["eager", "compiled"])
def test_moe_parity_on_one_gpu(strategy):
    """A tiny transformers Qwen3-MoE (4 experts, top-2, renormalised) on CUDA, eager and compiled: the experts'
    CUDA kernels through par3d train to the losses and parameters of Lightning's single-device run."""
    from tests import hf_runs
    from tests.test_moe import MOE

    got = gpu_pool(1).run(hf_runs.run_par3d, strategy=strategy, devices=1, model=MOE["qwen3_moe"], accelerator="gpu")[0]
    assert_parity(got, moe_reference())


@pytest.mark.gpu(1)
def test_moe_bf16_mixed_on_one_gpu():
    from tests import hf_runs
    from tests.test_moe import MOE

    got = gpu_pool(1).run(
        hf_runs.run_par3d,
        strategy={},
        devices=1,
        model=MOE["qwen3_moe"],
        accelerator="gpu",
        precision="bf16-mixed",
    )[0]
    ref = moe_reference()["losses"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref, strict=True)) <= BF16_MIXED_RTOL


# ---------------------------------------------------------------- 2 GPUs


@pytest.mark.gpu(2)
@pytest.mark.parametrize(
    "strategy",
    [dict(dp_shard=2), dict(tp=2), dict(zero_stage=1), dict(zero_stage=2), dict(pp=2), dict(cp=2)],
    ids=["dp_shard=2", "tp=2", "zero1", "zero2", "pp=2", "cp=2"],
)
def test_parity_on_two_gpus(strategy):
    _parity(2, **strategy)


@pytest.mark.gpu(2)
def test_fp16_mixed_on_two_gpus():
    """precision='16-mixed' on CUDA: the global gradient scaler, losses within half of bf16's bound of fp32."""
    got = gpu_pool(2).run(run_par3d, strategy=dict(zero_stage=3), devices=2, accelerator="gpu", precision="16-mixed")
    ref = reference()["losses"]
    assert max(abs(a - b) / b for a, b in zip(got[0]["losses"], ref, strict=True)) <= BF16_MIXED_RTOL / 2


@pytest.mark.gpu(2)
def test_bf16_mixed_on_two_gpus():
    _close_to_fp32(2, "bf16-mixed", dp_shard=2)


@pytest.mark.gpu(2)
def test_bf16_gradient_compression_on_two_gpus():
    """DDP's bf16 compression hook (NCCL only): the all-reduced gradients rounded to bf16, the losses close."""
    got = gpu_pool(2).run(
        run_par3d, strategy=dict(dp_replicate=2, dp_shard=1, grad_compression="bf16"), devices=2, accelerator="gpu"
    )[0]
    ref = reference()["losses"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref, strict=True)) <= BF16_MIXED_RTOL


@pytest.mark.gpu(2)
def test_save_and_resume_on_two_gpus(tmp_path):
    assert_resume_continues(gpu_pool(2), str(tmp_path), 6, strategy=dict(dp_shard=2), devices=2, accelerator="gpu")


@pytest.mark.gpu(2)
def test_memory_stats_read_the_cuda_allocator(tmp_path):
    from lightning_par3d.callbacks import MemoryStats

    stats = MemoryStats(dirpath=str(tmp_path), estimate=False, verbose=False)
    gpu_pool(2).run(run_par3d, strategy=dict(dp_shard=2), devices=2, accelerator="gpu", extra_callbacks=[stats])
    assert (tmp_path / "memory_stats.csv").read_text().count("cuda_peak") == 1


@pytest.mark.gpu(2)
def test_a_failing_rank_ends_the_job_over_nccl(tmp_path):
    """A rank raises in its third step: the job (Lightning's launcher, 2 GPU ranks) ends non-zero within
    ``timeout_s`` + 30 s, and the output names the rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PAR3D_FAULT_ACCELERATOR"] = "gpu"
    command = [sys.executable, str(ROOT / "tests" / "fault_script.py"), str(tmp_path), '{"dp_shard": 2}', "2",
               "raise", "1", "3"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    ended = time.time()
    fault_at = float((tmp_path / "fault_at").read_text())
    assert done.returncode != 0, done.stderr[-3000:]
    assert ended - fault_at <= FAULT_TIMEOUT_S + 30, ended - fault_at
    assert "rank 1" in done.stdout + done.stderr


# ---------------------------------------------------------------- 4 GPUs


@pytest.mark.gpu(4)
@pytest.mark.parametrize(
    "strategy",
    [dict(dp_replicate=2, dp_shard=2), dict(dp_shard=2, tp=2), dict(pp=2, tp=2), dict(cp=2, dp_shard=2)],
    ids=["hsdp=2x2", "dp_shard=2xtp=2", "pp=2xtp=2", "cp=2xdp_shard=2"],
)
def test_parity_on_four_gpus(strategy):
    _parity(4, **strategy)


# ---------------------------------------------------------------- 8 GPUs


@pytest.mark.gpu(8)
@pytest.mark.parametrize(
    "strategy",
    [dict(pp=2, dp_shard=2, tp=2), dict(dp_replicate=2, dp_shard=2, tp=2)],
    ids=["pp=2xdp_shard=2xtp=2", "hsdp=2x2xtp=2"],
)
def test_parity_on_eight_gpus(strategy):
    _parity(8, **strategy)


@pytest.mark.gpu(8)
def test_the_accelerate_example_launches_on_eight_gpus():
    """``accelerate launch --config_file conf/accelerate/gpu8.yaml examples/accelerate_train.py`` (8 ranks) trains
    and prints its layout and final metrics."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    launcher = str(Path(sys.executable).with_name("accelerate"))
    command = [launcher, "launch", "--config_file", "conf/accelerate/gpu8.yaml", "--main_process_port", "0",
               "examples/accelerate_train.py", "strategy.tp=2", "steps=4", "eval_every=4"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 8 ranks" in done.stdout + done.stderr and "final metrics: train_loss=" in done.stdout + done.stderr
