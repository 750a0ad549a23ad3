"""``sequence_parallel=True``: the plan it derives, its refusals, and parity with one process (fp32, rtol 1e-4) for
the example GPT and an unmodified transformers Llama, alone and under pp and dp. The estimator's figure for it is
checked in tests/test_estimate.py."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
from lightning_par3d.parallel.sequence_parallel import sequence_parallel_plan
from lightning_par3d.parallel.tensor_parallel import expand_plan
from tests import gpt_runs, hf_runs
from tests.conftest import assert_parity


def test_the_gpt_plan_becomes_megatron_sequence_parallelism():
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=2))
    plan = sequence_parallel_plan(gpt, expand_plan(gpt, GPT_TP_PLAN))
    assert plan["transformer.h.0"] == "sequence_shard"  # the first block takes its shard; h.1 gets it sharded
    assert "transformer.h.1" not in plan
    for i in (0, 1):
        block = f"transformer.h.{i}"
        assert plan[f"{block}.ln_1"] == plan[f"{block}.ln_2"] == "sequence_parallel"
        assert plan[f"{block}.attn"] == plan[f"{block}.mlp"] == "gather_sequence"  # one gather for q, k and v
        assert plan[f"{block}.attn.q_proj"] == plan[f"{block}.mlp.c_fc"] == "colwise"
        assert plan[f"{block}.attn.c_proj"] == plan[f"{block}.mlp.c_proj"] == "rowwise_seq"
    assert plan["transformer.ln_f"] == "sequence_parallel"
    assert plan["lm_head"] == "colwise_seq_gather_output"
    assert plan["transformer.wte"] == "embedding_rowwise"  # before the blocks: whole


def test_a_transformers_llama_plan_is_derived_from_its_own():
    from lightning_par3d.parallel.tensor_parallel import transformers_plan

    lm = hf_runs.module()
    with torch.device("meta"):
        lm.configure_model()
    plan = sequence_parallel_plan(lm, expand_plan(lm, transformers_plan(lm)))
    assert plan["model.model.layers.0"] == "sequence_shard"
    assert plan["model.model.layers.1.input_layernorm"] == "sequence_parallel"
    assert plan["model.model.layers.1.self_attn"] == "gather_sequence"
    assert plan["model.model.layers.1.self_attn.o_proj"] == "rowwise_seq"
    assert plan["model.model.layers.1.mlp.down_proj"] == "rowwise_seq"
    assert plan["model.model.norm"] == "sequence_parallel"
    assert plan["model.lm_head"] == "colwise_seq_gather_output"


class Stack(nn.Module):
    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))
        if scaled:
            for block in self.blocks:
                block.register_parameter("gain", nn.Parameter(torch.ones(8)))
        self.head = nn.Linear(8, 16)


def test_what_cannot_be_placed_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape("blocks.0.1 (Linear) holds weight, bias outside the plan")):
        sequence_parallel_plan(Stack(), {"head": "colwise_gather_output"})
    with pytest.raises(ValueError, match=re.escape("blocks.0 (Sequential) holds gain outside the plan")):
        sequence_parallel_plan(
            Stack(scaled=True), {"head": "colwise", "blocks.0.1": "rowwise", "blocks.1.1": "rowwise"}
        )
    with pytest.raises(ValueError, match=re.escape("head (Linear) after the last block is not in the plan")):
        sequence_parallel_plan(Stack(), {"blocks.0.1": "rowwise", "blocks.1.1": "rowwise"})
    with pytest.raises(ValueError, match=re.escape("already has sequence-parallel entries (blocks.0.1)")):
        sequence_parallel_plan(Stack(), {"blocks.0.1": "rowwise_seq"})
    with pytest.raises(ValueError, match="has no ModuleList or ModuleDict of repeated blocks"):
        sequence_parallel_plan(nn.Linear(2, 2), {"": "colwise"})


# ---------------------------------------------------------------- parity


@functools.cache
def gpt_reference() -> dict:
    return gpt_runs.run_reference()


@functools.cache
def llama_reference() -> dict:
    return hf_runs.run_reference({})


def test_gpt_at_tp2(pool2):
    got = pool2.run(gpt_runs.run_par3d, strategy=dict(tp=2, sequence_parallel=True), devices=2)[0]
    assert_parity(got, gpt_reference())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2"),
        pytest.param(dict(pp=2, tp=2, activation_checkpointing="full"), id="pp2xtp2-full-ac"),
    ],
)
def test_gpt_at_four_ranks(pool4, strategy):
    got = pool4.run(gpt_runs.run_par3d, strategy=dict(strategy, sequence_parallel=True), devices=4)[0]
    assert_parity(got, gpt_reference())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2"),
        pytest.param(dict(pp=2, tp=2), id="pp2xtp2"),
    ],
)
def test_llama_own_plan_at_four_ranks(pool4, strategy):
    """The model's own plan (``tp_plan="auto"``), made sequence-parallel; under pp the stages exchange sequence
    shards and each computes positions and masks for the whole sequence."""
    strategy = dict(strategy, tp_plan="auto", sequence_parallel=True)
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4)[0]
    assert_parity(got, llama_reference())


def test_llama_in_full_3d(pool8):
    strategy = dict(pp=2, dp_shard=2, tp=2, tp_plan="auto", sequence_parallel=True)
    assert_parity(pool8.run(hf_runs.run_par3d, strategy=strategy, devices=8)[0], llama_reference())
