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
from tests.harness import RankError


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
        pytest.param(dict(cp=2, pp=2), {}, id="pp=2xcp=2"),
        pytest.param(dict(cp=2, pp=2, activation_checkpointing="full"), {}, id="pp=2xcp=2-checkpointed"),
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


def test_compiled_blocks_gather_the_whole_rows_keys(pool2):
    """``compile=True``: each block compiled with the context-parallel attention inside it (traced with
    ``aot_eager``), on one process's trajectory, and compiled once."""
    from tests.compile_runs import run_compiled

    strategy = dict(cp=2, compile=True, compile_options={"backend": "aot_eager"})
    ranks = pool2.run(run_compiled, strategy=strategy, devices=2)
    assert_parity(ranks[0], gpt_reference())
    for rank in ranks:
        assert rank["graphs"][0] > 0 and rank["graphs"][-1] == rank["graphs"][0], rank["graphs"]


# ---------------------------------------------------------------- a transformers Llama (SDPA), as it is


@functools.cache
def llama_reference() -> dict:
    return hf_runs.run_reference()


def test_llama_parity_two_ranks(pool2):
    got = pool2.run(hf_runs.run_par3d, strategy=dict(cp=2), devices=2)[0]
    assert_parity(got, llama_reference())


def test_llama_without_a_kv_cache_gathers_the_same_shapes_on_every_rank(pool2):
    """Without a KV cache (``use_cache=False``, as ``compile=True`` sets it) transformers reads the positions of a
    rank's slice for packed documents: rank 0's two chunks look packed and get a mask (and keys and values repeated
    for the query heads), rank 1's contiguous ones do not. Each rank's keys are gathered once per key/value head."""
    model = dict(config_overrides={"use_cache": False})  # one process computes the same without a cache here
    got = pool2.run(hf_runs.run_par3d, strategy=dict(cp=2), devices=2, model=model)[0]
    assert_parity(got, llama_reference())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(cp=2, dp_shard=2), id="cp=2xdp_shard=2"),
        pytest.param(dict(cp=2, tp=2, tp_plan="auto"), id="cp=2xtp=2-own-plan"),
        pytest.param(dict(cp=2, tp=2, tp_plan="auto", sequence_parallel=True), id="cp=2xtp=2-sequence-parallel"),
        pytest.param(dict(cp=2, pp=2, microbatches=2), id="pp=2xcp=2"),
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
        pytest.param("left", False, 1, dict(cp=2, pp=2, microbatches=4), id="left-padded-pp=2xcp=2"),
        pytest.param(
            "left",
            False,
            1,
            dict(cp=2, pp=2, microbatches=4, activation_checkpointing="full"),
            id="left-padded-pp=2xcp=2-checkpointed",
        ),
        pytest.param("packed", False, 1, dict(cp=2, pp=2, microbatches=2), id="packed-pp=2xcp=2"),
        pytest.param(
            "right", True, 2, dict(cp=2, pp=2, microbatches=2), id="right-padded-own-loss-pp=2xcp=2-accumulate2"
        ),
    ],
)
def test_padded_and_packed_rows(pool4, side, own_loss, accumulate, strategy):
    """Rows of different real lengths (``attention_mask``, ``-100`` labels on the pads) and rows of two packed
    documents (``position_ids`` restarting; the model masks them apart without a KV cache), through the module's
    declared loss and through the transformers model's own ``labels=`` loss (shifted before the rows are cut; under
    pp its call by keyword, ``input_ids=``, is cut as a positional one is)."""
    module = padded_runs.OwnLossLM if own_loss else padded_runs.PaddedLM
    got = pool4.run(
        padded_runs.run_par3d, strategy=strategy, devices=4, side=side, module=module, accumulate=accumulate,
        max_steps=5,
    )[0]  # fmt: skip
    assert_parity(got, padded_reference(side, own_loss, accumulate))


def test_forward_only_batches_under_pp_keep_their_own_rows(pool4):
    """Validation at pp2 × cp2 over two padded batches, through the model's own loss: a forward-only schedule hands
    every microbatch to a stage in the same buffer, and each must attend with its own rows' slice (the second batch
    failed before, finding the first one's). The loss is the batch's token mean over the cp ranks' slices."""
    strategy = dict(pp=2, cp=2, microbatches=2)
    got = pool4.run(padded_runs.validate_own_loss, model={}, strategy=strategy, devices=4)[0]
    assert got == pytest.approx(padded_runs.validate_own_loss(model={}), rel=1e-5)


# ---------------------------------------------------------------- refusals, before any process group where possible


@pytest.mark.parametrize(
    "settings, named",
    [
        (
            dict(cp=2, ep=4, dp_shard=1, dp_replicate=2),
            r"ep=4 splits the experts over ranks taken from dp_shard × cp, "
            r"but dp_shard × cp = 2 is not a multiple of 4",
        ),
        (dict(cp=2, loss_mean="microbatches"), r"cp=2 with loss_mean='microbatches'.*use loss_mean='tokens'"),
        (dict(cp=2, dp_shard=2, zero_stage=1), r"cp=2 with zero_stage=1.*use zero_stage=3"),
        (dict(cp=0), r"cp=0 must be a positive integer"),
        (dict(cp=2, dp_shard=2, tp=2), r"pp × dp_replicate × dp_shard × cp × tp = 1 × 1 × 2 × 2 × 2 = 8.*is 4"),
    ],
)
def test_bad_context_parallel_settings_are_refused_before_launch(settings, named):
    from lightning_par3d import Par3DConfig
    from lightning_par3d.config import resolve_layout

    with pytest.raises(ValueError, match=named):
        resolve_layout(Par3DConfig(**settings), 4)


def test_the_layout_counts_cp_ranks_apart_from_data_parallel_ones():
    from lightning_par3d import Par3DConfig
    from lightning_par3d.config import resolve_layout
    from lightning_par3d.distributed.mesh import Par3DMesh

    layout = resolve_layout(Par3DConfig(cp=2, tp=2), 8)
    assert (layout.dp_shard, layout.cp, layout.tp, layout.dp, layout.dp_cp, layout.zero) == (2, 2, 2, 2, 4, 3)
    assert str(layout) == "pp=1 × dp_replicate=1 × dp_shard=2 × cp=2 × tp=2"
    mesh = Par3DMesh(layout)
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # cp and tp peers read the same rows
    assert [mesh.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert mesh.group_ranks("cp", 5) == [5, 7]
    assert mesh.all_group_ranks()["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("dp", 0) == [0, 2, 4, 6]  # the ranks whose gradients are summed


def test_a_row_length_that_does_not_split_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"2 × cp = 4 equal chunks.*rows hold 30 tokens.*multiple of 4"):
        positions_of(0, 2, 30)


def _tiny_llama(**overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_runs.module().model_config(), **overrides)


def test_attention_cp_cannot_split_is_refused_by_name():
    from lightning_par3d.parallel.context_parallel import check_model

    check_model(_tiny_llama())  # sdpa: taken
    with pytest.raises(
        ValueError, match=r"attn_implementation='eager'.*Build the model with attn_implementation='sdpa'"
    ):
        check_model(_tiny_llama(attn_implementation="eager"))


def test_sliding_window_attention_is_refused_not_replaced():
    from transformers import AutoModelForCausalLM

    from lightning_par3d.parallel.context_parallel import check_model

    config = hf_runs.module(dict(architecture="mistral")).model_config()
    config.sliding_window = 8
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=8.*will not replace"):
        check_model(AutoModelForCausalLM.from_config(config))
    config.sliding_window = None
    check_model(AutoModelForCausalLM.from_config(config))


def _installed(trunk: torch.nn.Module, blocks: list[torch.nn.Module]) -> object:
    from lightning_par3d.parallel.context_parallel import ContextParallel

    return ContextParallel(trunk, blocks, group=None, cp_rank=0, cp=2, ignore_index=-100)


def test_inputs_cp_cannot_cut_are_refused_by_name():
    model = _tiny_llama()
    cp = _installed(model, list(model.model.layers))
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"a \(batch, sequence\) attention_mask.*shape \(2, 1, 16, 16\)"):
        cp._cut(model, (ids,), {"attention_mask": torch.ones(2, 1, 16, 16)})
    with pytest.raises(ValueError, match=r"token_type_ids= of shape \(2, 16\).*does not know how to split"):
        cp._cut(model, (ids,), {"token_type_ids": torch.zeros(2, 16)})
    with pytest.raises(ValueError, match=r"one per token, \(batch, sequence\) = \(2, 16\).*shape \(2,\)"):
        cp._cut(model, (ids,), {"labels": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"inputs_embeds is not supported"):
        cp._cut(model, (), {"inputs_embeds": torch.zeros(2, 16, 32)})


def test_a_trunk_without_position_ids_is_refused_with_the_fix():
    class NoPositions(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    cp = _installed(NoPositions(), [])
    with pytest.raises(TypeError, match=r"position_ids= argument, which its forward does not take.*position_ids=None"):
        cp._cut(None, (torch.zeros(1, 8, dtype=torch.long),), {})


def test_a_bad_row_length_fails_every_rank_instead_of_hanging(pool2):
    with pytest.raises(RankError, match=r"rows hold 30 tokens") as info:
        pool2.run(run_par3d, strategy=dict(cp=2), devices=2, model=dict(block_size=30), data=dict(block_size=30))
    assert info.value.all_ranks_failed
