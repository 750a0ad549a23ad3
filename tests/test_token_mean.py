"""``loss_mean="tokens"`` (the default): each step's loss and gradient are the token mean of the whole global batch,
at every layout, on padded variable-length data, as one process computes it.

The data (:mod:`tests.padded_runs`): the Shakespeare windows cut to lengths 6 … 32 and left-padded, ``-100`` labels
on the pads, so that every microbatch, data-parallel rank and accumulated batch holds a different number of real
tokens. The reference is one process training on each step's whole global batch (``GLOBAL_BATCH × accumulate``
samples in one batch) with the same clipping: the token mean over all of them. Each par3d run reads the same samples
in two accumulated batches of ``GLOBAL_BATCH`` split over its data-parallel ranks, and is compared on the per-step
loss (the window's batch losses, averaged over the data-parallel ranks, summed) and on every parameter."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_par3d import Par3DStrategy
from lightning_par3d.engine.tokens import TokenMean, TokenWindows, batch_targets, real_tokens
from tests.conftest import assert_parity
from tests.padded_runs import (
    OwnLossLM,
    PaddedLM,
    accelerate_loop,
    fabric_loop,
    loop_reference,
    run_par3d,
    run_reference,
)

ACCUMULATE = 2
CLIP = dict(gradient_clip_val=0.5)


@functools.cache
def reference(own_loss: bool = False) -> dict[str, Any]:
    return run_reference("left", OwnLossLM if own_loss else PaddedLM, ACCUMULATE, **CLIP)


@functools.cache
def loop_ref(own_loss: bool) -> dict[str, Any]:
    return loop_reference("left", own_loss=own_loss, accumulate=ACCUMULATE, clip=0.5)


def _run(pool: Any, strategy: dict[str, Any], devices: int, **kwargs: Any) -> dict[str, Any]:
    run = dict(side="left", accumulate=ACCUMULATE, **CLIP, **kwargs)
    return pool.run(run_par3d, strategy=strategy, devices=devices, **run)[0]


# ---------------------------------------------------------------- the Trainer at every layout


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_replicate=2, dp_shard=2), id="hsdp"),
        pytest.param(dict(pp=2, dp_shard=2, microbatches=2), id="pp2-dp2"),
        pytest.param(dict(pp=2, tp=2, tp_plan="auto", microbatches=4), id="pp2-tp2"),
    ],
)
def test_token_mean_at_four_ranks(pool4, strategy):
    assert_parity(_run(pool4, strategy, 4), reference())


def test_token_mean_at_two_ranks(pool2):
    assert_parity(_run(pool2, dict(dp_shard=2), 2), reference())


def test_token_mean_in_3d(pool8):
    strategy = dict(pp=2, dp_shard=2, tp=2, tp_plan="auto", microbatches=2)
    assert_parity(_run(pool8, strategy, 8), reference())


def test_the_microbatch_mean_is_not_the_token_mean(pool2):
    """The same run with ``loss_mean="microbatches"`` (each rank's and batch's own mean) leaves the one-process
    trajectory: what the default fixes."""
    got = _run(pool2, dict(dp_shard=2, loss_mean="microbatches"), 2)
    with pytest.raises(AssertionError):
        assert_parity(got, reference())


def test_a_transformers_models_own_loss(pool2):
    """``labels=`` to the model and its ``.loss`` returned (no ``pipeline_loss``): par3d scales the model's own loss
    function, counting the labels it shifts."""
    assert_parity(_run(pool2, dict(dp_shard=2), 2, module=OwnLossLM), reference(own_loss=True))


def test_a_transformers_models_own_loss_under_pipelining(pool4):
    """The same module under pp: its trunk called with ``labels=`` runs the schedule with the model's own loss
    function on the last stage, the labels shifted as the model shifts them (and counted so for the window)."""
    got = _run(pool4, dict(pp=2, dp_shard=2, microbatches=2), 4, module=OwnLossLM)
    assert_parity(got, reference(own_loss=True))


# ---------------------------------------------------------------- Fabric and Accelerate


def test_fabric_train_step_at_pp2_dp2(pool4):
    got = pool4.run(fabric_loop, strategy=dict(pp=2, dp_shard=2, microbatches=2), side="left", clip=0.5)[0]
    assert_parity(got, loop_ref(False))


def test_accelerate_with_the_models_own_loss_at_dp2_tp2(pool4):
    got = pool4.run(accelerate_loop, strategy=dict(dp_shard=2, tp=2), side="left", clip=0.5)[0]
    assert_parity(got, loop_ref(True))


# ---------------------------------------------------------------- unit


def test_real_tokens_skip_the_ignore_index_and_count_float_targets_whole():
    assert int(real_tokens(torch.tensor([[1, -100, 3], [-100, -100, 2]]), -100)) == 3
    assert int(real_tokens(torch.tensor([[1, 0, 3]]), 0)) == 2
    assert int(real_tokens(torch.zeros(2, 5), -100)) == 10


def test_batch_targets_default_to_labels_or_the_last_element_and_shift_for_a_models_own_loss():
    labels = torch.arange(6).reshape(2, 3)
    assert batch_targets({"labels": labels, "input_ids": labels}, None, False) is labels
    assert torch.equal(batch_targets((labels, labels + 1), None, True), (labels + 1)[:, 1:])
    assert batch_targets({"y": labels}, "y", False) is labels
    with pytest.raises(ValueError, match=r"has no 'labels'.*Set loss_tokens="):
        batch_targets({"target": labels}, None, False)


def _token_mean(accumulation: int) -> TokenMean:
    return TokenMean(-100, 1, lambda: None, lambda: torch.device("cpu"), lambda: accumulation)


def test_windows_count_each_window_ahead_including_an_epochs_shorter_last():
    batches = [(torch.zeros(1), torch.tensor([[1, 2, -100]])) for _ in range(5)]  # 2 real tokens each
    tokens = _token_mean(2)
    seen = []
    for _ in TokenWindows(batches, tokens, lambda: False, lambda: float("inf")):
        tokens.start_batch()
        seen.append((tokens.current.total, tokens.current.batches, tokens.current.counted))
    assert seen == [(4, 2, 2)] * 4 + [(2, 1, 2)]


def test_a_training_batch_comes_from_the_training_loader_around_an_evaluation():
    """A loop that reads its training loader one batch ahead (as Accelerate's does) and evaluates from another
    read-ahead loader in the middle of the epoch: the next training batch still takes the training loader's entry."""
    tokens = _token_mean(2)
    train = TokenWindows([(0, torch.tensor([1] * n)) for n in (1, 2, 3, 4)], tokens, lambda: False, lambda: 9)
    evaluation = TokenWindows([(0, torch.tensor([1] * 9))] * 2, tokens, lambda: False, lambda: 9)
    ahead = iter(train)
    next(ahead), next(ahead)  # batch 2 read ahead while batch 1 trains
    tokens.start_batch()
    assert (tokens.current.total, tokens.current.counted) == (3, 1)
    list(evaluation)  # an evaluation in the middle of the epoch
    tokens.start_batch()
    assert (tokens.current.total, tokens.current.counted) == (3, 2)
    next(ahead), next(ahead, None), next(ahead, None)  # the epoch ends while its last batch waits
    tokens.start_batch()
    tokens.start_batch()
    assert (tokens.current.total, tokens.current.counted) == (7, 4)


def test_windows_stop_where_the_trainer_stops_the_epoch():
    batches = [(torch.zeros(1), torch.tensor([[1, 2, 3]])) for _ in range(5)]
    tokens = _token_mean(2)
    seen = []
    for _ in TokenWindows(batches, tokens, lambda: False, lambda: 3):
        tokens.start_batch()
        seen.append(tokens.current.batches)
    assert seen == [2, 2, 1]


def test_the_share_of_each_piece_adds_up_to_the_token_mean():
    """Two accumulated batches of 3 and 1 real tokens: the shares the backward takes (1/w of each) add up to the
    window's token mean, not the mean of the two means."""
    losses = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    targets = [torch.tensor([1, 1, 1, -100]), torch.tensor([-100, 1, -100, -100])]
    tokens = _token_mean(2)
    total = 0.0
    windows = TokenWindows(list(zip(losses, targets, strict=True)), tokens, lambda: False, lambda: float("inf"))
    for loss, target in windows:
        tokens.start_batch()
        share = tokens.wrap(lambda values, _targets: values.mean())(loss, target)
        total += float(share) * tokens.backward_factor(1)
    assert total == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_a_batch_outside_the_windows_is_refused_with_accumulation():
    tokens = _token_mean(2)
    tokens.start_batch()
    with pytest.raises(RuntimeError, match=r"did not come through a dataloader par3d set up"):
        tokens.wrap(lambda x, y: x.mean())(torch.ones(2, requires_grad=True), torch.ones(2, dtype=torch.long))


def test_a_window_counted_elsewhere_than_the_loss_is_named():
    """The window read the batch's ``labels``; the loss is given other targets: the mismatch says what to set."""
    batches = [{"labels": torch.tensor([1, 1, 1]), "other": torch.tensor([1, -100, -100])} for _ in range(2)]
    tokens = _token_mean(2)
    for batch in TokenWindows(batches, tokens, lambda: False, lambda: float("inf")):
        tokens.start_batch()
        with pytest.raises(ValueError, match=r"counted 1 real tokens.*counted 3.*Set loss_tokens="):
            tokens.wrap(lambda x, y: x.mean())(torch.ones(3), batch["other"])
        break


def test_global_batch_without_real_tokens_is_refused():
    tokens = _token_mean(1)
    with pytest.raises(ValueError, match=r"no real tokens.*ignore_index=-100"):
        tokens.wrap(lambda x, y: x.mean())(torch.ones(2), torch.full((2,), -100))


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(loss_mean="sum"), r"loss_mean='sum' is not a loss mean\. Allowed: 'tokens'.*'microbatches'"),
        (dict(ignore_index="pad"), r"ignore_index='pad' must be an integer"),
        (dict(loss_tokens=1.5), r"loss_tokens=1\.5 must be a key of a dict batch"),
    ],
)
def test_bad_token_mean_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        Par3DStrategy(**settings)
