"""Padded supervised fine-tuning of an unmodified transformers Llama under pipelining: ``attention_mask`` reaches
every stage, ``-100`` labels on the pads, and the run matches one process that runs the model with the same mask.
A trunk that cannot take a keyword argument of the call is refused by name on every rank before the schedule runs.

What is compared: by default (``loss_mean="tokens"``) each step's loss is the token mean of the whole global batch,
the reference's (:func:`tests.padded_runs.run_reference`). With ``loss_mean="microbatches"`` it is the mean over the
microbatches of the loss method's value on each (torch's schedule splits the batch into ``MICROBATCHES`` contiguous
row groups along dim 0, ``tensor_split``): :class:`MicrobatchReferenceLM` averages the token means of the same row
groups. Both runs read the same samples in the same order: dp = 1, so every par3d rank reads the whole global batch
through the seeded ``DistributedSampler`` Lightning injects, which gives the permutation
:class:`tests.gpt_runs.ReferenceData` reads. The layouts with data parallelism and accumulation are in
``tests/test_token_mean.py``."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from examples.data import ByteWindows, ShakespeareDataModule
from examples.gpt import GPT, GPTConfig, GPTModule
from examples.hf_llama import CausalLMModule
from lightning_par3d.pipeline.runner import PendingPipelineOutput, check_pipeline_call
from lightning_par3d.pipeline.transformers_stages import decoder_layout, install_stage_forward
from tests.conftest import assert_parity
from tests.constants import DATA, GLOBAL_BATCH, MODEL, SEED
from tests.gpt_runs import LossRecorder, full_state, trainer_kwargs
from tests.harness import RankError
from tests.hf_runs import TINY
from tests.padded_runs import MIN_REAL, PAD, PaddedLM, PaddedReferenceData, PaddedWindows, run_par3d, run_reference

MICROBATCHES = 4
"""Microbatches per batch under pp: the global batch of 8 in 4 row groups of 2."""


class MicrobatchReferenceLM(PaddedLM):
    """One process: the model over the whole batch with the same mask; the loss is the mean of the token means of
    the ``MICROBATCHES`` contiguous row groups, as the pipeline computes it under ``loss_mean="microbatches"``. Also
    records the whole batch's token mean, to show that the two differ on this data."""

    token_means: list[float]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"]
        groups = zip(logits.tensor_split(MICROBATCHES), labels.tensor_split(MICROBATCHES), strict=True)
        self.token_means = [*getattr(self, "token_means", []), self.loss_fn(logits, labels).item()]
        return torch.stack([self.loss_fn(lg, y) for lg, y in groups]).mean()


def run_microbatch_reference(side: str, max_steps: int = 5) -> dict[str, Any]:
    L.seed_everything(SEED, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, callbacks=[recorder], **trainer_kwargs(max_steps=max_steps))
    lm = MicrobatchReferenceLM(**TINY)
    trainer.fit(lm, PaddedReferenceData(side, batch_size=GLOBAL_BATCH, **DATA))
    return {"losses": recorder.losses, "params": full_state(lm), "token_means": lm.token_means}


class MaskedGPTModule(GPTModule):
    """The example GPT called with an ``attention_mask=`` its forward has no parameter for."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.model is not None
        return self.loss_fn(self.model(x, attention_mask=torch.ones_like(x)), y)


def run_masked_gpt(strategy: dict[str, Any], devices: int) -> None:
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    trainer = L.Trainer(devices=devices, strategy=Par3DStrategy(timeout_s=120, **strategy), **trainer_kwargs())
    trainer.fit(MaskedGPTModule(**MODEL), ShakespeareDataModule(batch_size=GLOBAL_BATCH, **DATA))


@functools.cache
def reference(side: str) -> dict[str, Any]:
    return run_reference(side, max_steps=5)


# ---------------------------------------------------------------- unit


def test_padded_rows_have_different_real_lengths_on_both_sides():
    windows = ByteWindows(torch.arange(1, 66), block_size=32)  # two windows of ids 1…
    for side in ("left", "right"):
        first, second = PaddedWindows(windows, side)[0], PaddedWindows(windows, side)[1]
        assert first["attention_mask"].sum() == MIN_REAL and second["attention_mask"].sum() == MIN_REAL + 11
        pads = first["attention_mask"] == 0
        assert (first["input_ids"][pads] == PAD).all() and (first["labels"][pads] == -100).all()
        assert bool(pads[0]) is (side == "left") and bool(pads[-1]) is (side == "right")
        real = first["input_ids"][~pads]
        assert torch.equal(real, torch.arange(1, MIN_REAL + 1))  # the window's first real tokens, in order


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_stage_forward_with_a_padding_mask_equals_the_model(architecture):
    """The forward par3d gives a stage, here holding the whole model, with ``attention_mask`` (and with
    ``position_ids``) equals the transformers model's own, on left- and right-padded rows."""
    lm = CausalLMModule(**{**TINY, "architecture": architecture})
    lm.configure_model()
    model = lm.model.eval()
    ids = torch.randint(1, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5], mask[1, :1], mask[2, 7:] = 0, 0, 0  # left, left, right padding; row 3 unpadded
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        expected_with_positions = model(ids, attention_mask=mask, position_ids=positions).logits
        unmasked = model(ids).logits
    layout = decoder_layout(model)
    assert layout is not None
    install_stage_forward(model, layout, list(range(TINY["num_hidden_layers"])), first=True, last=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask), expected, rtol=1e-5, atol=1e-5)
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        torch.testing.assert_close(got, expected_with_positions, rtol=1e-5, atol=1e-5)
    assert (expected[0, 5:] - unmasked[0, 5:]).abs().max() > 1e-3  # left padding changes the real tokens' logits


def _hf_stage() -> torch.nn.Module:
    lm = CausalLMModule(**TINY)
    lm.configure_model()
    layout = decoder_layout(lm.model)
    assert layout is not None
    install_stage_forward(lm.model, layout, [0], first=True, last=False)
    return lm.model


def test_pipeline_call_with_a_mask_is_taken_by_a_transformers_stage():
    ids = torch.zeros(2, 8, dtype=torch.long)
    stage = _hf_stage()
    check_pipeline_call(stage, PendingPipelineOutput((ids,), {"attention_mask": ids, "position_ids": ids}))
    check_pipeline_call(stage, PendingPipelineOutput((), {"input_ids": ids, "attention_mask": ids, "use_cache": 0}))


@pytest.mark.parametrize(
    "args, kwargs, named",
    [
        pytest.param(1, {"attention_mask": 0, "labels": 0}, "'labels'", id="labels"),
        pytest.param(1, {"inputs_embeds": 0}, "'inputs_embeds'", id="inputs_embeds"),
        pytest.param(2, {}, "2 positional arguments", id="positional-mask"),
    ],
)
def test_pipeline_call_a_transformers_stage_cannot_take_is_refused_by_name(args, kwargs, named):
    ids = torch.zeros(2, 8, dtype=torch.long)
    pending = PendingPipelineOutput((ids,) * args, {k: ids for k in kwargs})
    with pytest.raises(TypeError, match=rf"The pipelined LlamaForCausalLM cannot take .*{named}.*Drop the argument"):
        check_pipeline_call(_hf_stage(), pending)


def test_pipeline_call_with_a_mask_is_refused_for_a_trunk_without_one():
    gpt = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32))
    ids = torch.zeros(2, 8, dtype=torch.long)
    check_pipeline_call(gpt, PendingPipelineOutput((ids,), {}))
    named = r"pipelined GPT cannot take the keyword argument 'attention_mask'.*\(x, position_ids\)"
    with pytest.raises(TypeError, match=named):
        check_pipeline_call(gpt, PendingPipelineOutput((ids,), {"attention_mask": ids}))


# ---------------------------------------------------------------- pipelined runs against one process


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_at_pp2(pool2, side):
    got = pool2.run(run_par3d, strategy=dict(pp=2, microbatches=MICROBATCHES), devices=2, side=side, max_steps=5)[0]
    assert_parity(got, reference(side))


def test_padded_batches_at_pp2_tp2(pool4):
    strategy = dict(pp=2, tp=2, tp_plan="auto", microbatches=MICROBATCHES)
    got = pool4.run(run_par3d, strategy=strategy, devices=4, side="right", max_steps=5)[0]
    assert_parity(got, reference("right"))


def test_the_microbatch_mean_stays_available_under_pp(pool2):
    """``loss_mean="microbatches"``: the mean of each microbatch's own token mean, which on this data is not the
    batch's token mean."""
    ref = run_microbatch_reference("left")
    differs = [abs(a - b) / b for a, b in zip(ref["losses"], ref["token_means"], strict=True)]
    assert max(differs) > 1e-3, "the microbatch mean should differ from the batch's token mean on this data"
    strategy = dict(pp=2, microbatches=MICROBATCHES, loss_mean="microbatches")
    got = pool2.run(run_par3d, strategy=strategy, devices=2, side="left", max_steps=5)[0]
    assert_parity(got, ref)


def test_mask_given_to_a_trunk_without_one_is_refused_on_every_rank(pool2):
    with pytest.raises(RankError, match=r"pipelined GPT cannot take the keyword argument 'attention_mask'") as info:
        pool2.run(run_masked_gpt, strategy=dict(pp=2), devices=2, timeout=120)
    assert info.value.all_ranks_failed
