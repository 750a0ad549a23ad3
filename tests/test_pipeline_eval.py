"""Evaluation and prediction code written for one device, which computes from the model's output (an argmax, a
softmax), runs unchanged under pp: in a forward-only step the pipelined trunk runs the schedule at the call and
returns the last stage's output on every pipeline rank. The logged values are one process's, and the predictions
of every data-parallel rank (on every rank of its pipeline) form one process's output."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from tests.gpt_runs import MODEL, SEED, trainer_kwargs

EVAL_DATA = dict(block_size=32, max_bytes=2051, val_fraction=0.25)  # 16 validation windows: no sampler pads
EVAL_BATCH = 8  # global


class ArgmaxGPT(GPTModule):
    """A module written for one device: its steps compute from the logits the model returns."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log("val_argmax_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)
        self.log("val_top_prob", logits.softmax(-1).amax(-1).mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).argmax(-1)


def evaluate(strategy: dict[str, Any] | None, devices: int = 1) -> dict[str, Any]:
    """``trainer.validate`` then ``trainer.predict`` over the validation windows, of the seeded model: the logged
    values, this rank's predictions (concatenated) and its data-parallel rank and size."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    kwargs = trainer_kwargs(limit_val_batches=None)
    dp, dp_rank = 1, 0
    if strategy is None:
        trainer = L.Trainer(devices=1, **kwargs)
    else:
        par3d = Par3DStrategy(timeout_s=120, **strategy)
        trainer = L.Trainer(devices=devices, strategy=par3d, **kwargs)
        dp = par3d.layout.dp
    module = ArgmaxGPT(**MODEL)
    data = ShakespeareDataModule(batch_size=EVAL_BATCH // dp, **EVAL_DATA)
    trainer.validate(module, data, verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if strategy is not None:
        dp_rank = trainer.strategy.engine.dp_rank
    predictions = trainer.predict(module, dataloaders=data.val_dataloader())
    assert predictions is not None
    return dict(logged=logged, predictions=torch.cat(predictions), dp=dp, dp_rank=dp_rank)


@functools.cache
def reference() -> dict[str, Any]:
    return evaluate(None)


@pytest.mark.parametrize("strategy", [dict(pp=2, dp_shard=2), dict(pp=2, tp=2)], ids=["pp2xdp2", "pp2xtp2"])
def test_steps_that_compute_from_the_logits_run_unchanged_under_pp(pool4, strategy):
    per_rank = pool4.run(evaluate, strategy=strategy, devices=4)
    ref = reference()
    assert set(ref["logged"]) == {"val_argmax_acc", "val_top_prob"}
    for got in per_rank:
        for name, value in ref["logged"].items():
            assert got["logged"][name] == pytest.approx(value, rel=1e-6, abs=0), name
    # The sampler gives data-parallel rank d the windows d, d + dp, ...: put every rank's part where it belongs.
    dp = per_rank[0]["dp"]
    assembled = torch.empty_like(ref["predictions"])
    for got in per_rank:  # every rank of a pipeline returns its data-parallel rank's predictions
        part = assembled[got["dp_rank"] :: dp]
        assert got["predictions"].shape == part.shape
        part.copy_(got["predictions"])
    assert torch.equal(assembled, ref["predictions"])
    for got in per_rank:  # and the ranks of one pipeline hold the same
        twin = next(o for o in per_rank if o["dp_rank"] == got["dp_rank"])
        assert torch.equal(got["predictions"], twin["predictions"])


def test_reading_the_trunks_output_in_a_training_step_says_what_to_do_instead():
    from lightning_par3d.pipeline.runner import PendingPipelineOutput

    pending = PendingPipelineOutput((torch.zeros(2, 3),), {})
    with pytest.raises(AttributeError, match=r"`\.argmax` cannot be read.*pipeline_loss.*forward-only step"):
        pending.argmax(-1)
    assert not hasattr(pending, "__array__")  # what libraries probe for stays a plain missing attribute
