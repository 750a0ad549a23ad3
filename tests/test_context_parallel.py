"""Context parallelism (``cp``): each row split over the cp ranks, trained to one process's losses and parameters.

Each parity case trains for 6 (GPT) or 5 (transformers Llama) AdamW steps with the same seed and global batch as
the single-process reference, in a pool of real gloo processes, on the samples each data-parallel rank read
(context-parallel peers read the same rows), and compares per-step loss and final parameters (fp32, rtol 1e-4).
The rows are 32 tokens: at cp=2 each rank holds chunks 0 and 3 (or 1 and 2) of 8 tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_par3d.parallel.context_parallel import positions_of
from tests import hf_runs, padded_runs
from tests.conftest import assert_parity
from tests.gpt_runs import run_par3d, run_reference


@functools.cache
def gpt_reference(**overrides: object) -> dict:
    return run_reference(**overrides)


def test_positions_balance_the_causal_work_and_cover_the_row():
    held = [positions_of(r, 4, 32) for r in range(4)]
    assert held[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert sorted(torch.cat(held).tolist()) == list(range(32))
    work = [int((p + 1).sum()) for p in held]  # keys each rank's queries attend to under the causal mask
    assert len(set(work)) == 1


@pytest.mark.parametrize("strategy", [pytest.param(dict(cp=2), id="cp=2")])
def test_gpt_parity_two_ranks(pool2, strategy):
    got = pool2.run(run_par3d, strategy=strategy, devices=2)[0]
    assert_parity(got, gpt_reference())


@pytest.mark.parametrize(
    "strategy, overrides",
    [
        pytest.param(dict(cp=2, dp_shard=2), {}, id="cp=2xdp_shard=2"),
        pytest.param(dict(cp=2, tp=2), {}, id="cp=2xtp=2"),
        pytest.param(dict(cp=4), {}, id="cp=4"),
        pytest.param(
            dict(cp=2, dp_shard=2, activation_checkpointing="full"),
            dict(accumulate_grad_batches=2),
            id="cp=2xdp_shard=2-checkpointed-accumulate2",
        ),
    ],
)
def test_gpt_parity_four_ranks(pool4, strategy, overrides):
    got = pool4.run(run_par3d, strategy=strategy, devices=4, **overrides)[0]
    assert_parity(got, gpt_reference(**overrides))


# ---------------------------------------------------------------- a transformers Llama (SDPA), as it is


@functools.cache
def llama_reference() -> dict:
    return hf_runs.run_reference()


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(cp=2, dp_shard=2), id="cp=2xdp_shard=2"),
        pytest.param(dict(cp=2, tp=2, tp_plan="auto"), id="cp=2xtp=2-own-plan"),
        pytest.param(dict(cp=2, tp=2, tp_plan="auto", sequence_parallel=True), id="cp=2xtp=2-sequence-parallel"),
    ],
)
def test_llama_parity(pool4, strategy):
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4)[0]
    assert_parity(got, llama_reference())


@functools.cache
def padded_reference(side: str, own_loss: bool = False, accumulate: int = 1) -> dict:
    module = padded_runs.OwnLossLM if own_loss else padded_runs.PaddedLM
    return padded_runs.run_reference(side, module=module, accumulate=accumulate, max_steps=5)


@pytest.mark.parametrize(
    "side, own_loss, accumulate, strategy",
    [
        pytest.param("left", False, 1, dict(cp=2, dp_shard=2), id="left-padded-cp=2xdp_shard=2"),
        pytest.param("right", True, 2, dict(cp=2, dp_shard=2), id="right-padded-own-loss-cp=2xdp_shard=2-accumulate2"),
        pytest.param("packed", False, 1, dict(cp=2, dp_shard=2), id="packed-documents-cp=2xdp_shard=2"),
        pytest.param("packed", True, 1, dict(cp=4), id="packed-own-loss-cp=4"),
    ],
)
def test_padded_and_packed_rows(pool4, side, own_loss, accumulate, strategy):
    """Rows of different real lengths (``attention_mask``, ``-100`` labels on the pads) and rows of two packed
    documents (``position_ids`` restarting; the model masks them apart without a KV cache), through the module's
    declared loss and through the transformers model's own ``labels=`` loss (shifted before the rows are cut)."""
    module = padded_runs.OwnLossLM if own_loss else padded_runs.PaddedLM
    got = pool4.run(
        padded_runs.run_par3d, strategy=strategy, devices=4, side=side, module=module, accumulate=accumulate,
        max_steps=5,
    )[0]  # fmt: skip
    assert_parity(got, padded_reference(side, own_loss, accumulate))
