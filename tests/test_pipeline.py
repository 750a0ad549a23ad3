"""Pipeline parallelism: every schedule, and pipelining composed with tensor and data parallelism, trains to the
single-process losses and parameters; the logged values agree on every rank; bad settings fail clearly."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPTConfig
from lightning_par3d import Par3DConfig, resolve_layout
from lightning_par3d.config.schedules import stage_indices
from lightning_par3d.pipeline.split import balanced_split, explicit_split, find_trunk_parts
from tests.conftest import assert_parity, assert_resume_continues
from tests.gpt_runs import run_par3d, run_reference
from tests.harness import RankError

DEEP = dict(n_layer=4)  # 4 blocks: enough for 2 ranks × 2 stages, or 4 ranks × 1


@functools.cache
def reference(n_layer: int = 2, **trainer_overrides: object) -> dict:
    return run_reference(model=dict(n_layer=n_layer), **trainer_overrides)


# ---------------------------------------------------------------- unit


def meta_gpt(n_layer: int = 4) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=n_layer))


def test_trunk_parts_of_the_gpt():
    parts = find_trunk_parts(meta_gpt())
    assert parts.container == "transformer.h"
    assert parts.blocks == tuple(f"transformer.h.{i}" for i in range(4))
    assert parts.head == ("transformer.wte", "transformer.wpe")
    assert parts.tail == ("transformer.ln_f", "lm_head")
    assert parts.shared == ("transformer.drop",)  # no parameters: every stage uses the trunk's own


def test_balanced_split_accounts_for_embedding_and_head():
    # 256×64 embedding and head weigh about a third of a 64-wide block each: 4 blocks over 2 stages stay 2 + 2,
    # but over 3 stages the middle stage takes the extra block.
    model = meta_gpt()
    parts = find_trunk_parts(model)
    assert balanced_split(model, parts, 2) == [
        ["transformer.h.0", "transformer.h.1"],
        ["transformer.h.2", "transformer.h.3"],
    ]
    assert [len(s) for s in balanced_split(model, parts, 3)] == [1, 2, 1]
    assert [len(s) for s in balanced_split(model, parts, 4)] == [1, 1, 1, 1]


def test_explicit_split_points():
    parts = find_trunk_parts(meta_gpt())
    assert explicit_split(parts, ["transformer.h.3"], 2) == [
        [f"transformer.h.{i}" for i in range(3)],
        ["transformer.h.3"],
    ]
    assert explicit_split(parts, ["h.1"], 2)[0] == ["transformer.h.0"]
    with pytest.raises(ValueError, match=re.escape("split_points has 1 entries but pp × virtual_stages = 4 stages")):
        explicit_split(parts, ["h.1"], 4)
    with pytest.raises(ValueError, match=re.escape("split point 'h.9' names no block")):
        explicit_split(parts, ["h.9"], 2)


def test_stage_placement():
    assert [stage_indices("1f1b", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices("interleaved_1f1b", r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices("zbv_zero_bubble", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]


def test_blocks_must_keep_their_names():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"the repeated blocks must live in an nn\.ModuleDict"):
        find_trunk_parts(model)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(pipeline_schedule="1F1B-fast"), "pipeline_schedule='1F1B-fast' is not a schedule. Allowed: 'gpipe'"),
        (dict(microbatches=0), "microbatches=0 must be a positive integer"),
        (dict(virtual_stages=2), "'1f1b' runs one stage per rank, but virtual_stages=2"),
        (dict(pipeline_schedule="zbv_zero_bubble", virtual_stages=1, microbatches=8), "needs exactly 2 stages"),
        (dict(microbatches=1), "microbatches=1 is fewer than the 2 pipeline stages that '1f1b' needs"),
        (
            dict(pipeline_schedule="interleaved_1f1b", virtual_stages=2, microbatches=7),
            "microbatches=7: 'interleaved_1f1b' runs microbatches in rounds of pp=2, so microbatches must be a "
            "multiple of 3",
        ),
    ],
)
def test_bad_pipeline_settings(fields, message):
    fields = {"pp": 2, **fields}
    with pytest.raises(ValueError, match="Invalid par3d configuration") as err:
        resolve_layout(Par3DConfig(**fields), 8)
    assert message in str(err.value)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_parity_pp2_one_stage_per_rank(pool2, schedule):
    got = pool2.run(run_par3d, strategy=dict(pp=2, pipeline_schedule=schedule), devices=2)[0]
    assert_parity(got, reference())


def test_parity_pp2_with_explicit_split_points(pool2):
    """An uneven split at a named block: stage 0 holds blocks 0–2, stage 1 holds block 3."""
    strategy = dict(pp=2, split_points=["transformer.h.3"])
    got = pool2.run(run_par3d, strategy=strategy, devices=2, model=DEEP)[0]
    assert_parity(got, reference(n_layer=4))


@pytest.mark.parametrize(
    "schedule", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"]
)
def test_parity_pp2_two_stages_per_rank(pool2, schedule):
    strategy = dict(pp=2, pipeline_schedule=schedule, virtual_stages=2, microbatches=4)
    got = pool2.run(run_par3d, strategy=strategy, devices=2, model=DEEP)[0]
    assert_parity(got, reference(n_layer=4))


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(pp=2, tp=2), id="pp=2xtp=2"),
        pytest.param(dict(pp=2, dp_shard=2), id="pp=2xdp_shard=2"),
        pytest.param(dict(pp=2, dp_replicate=2, dp_shard=1), id="pp=2xdp_replicate=2"),
        pytest.param(dict(pp=4, microbatches=4), id="pp=4-1f1b"),
    ],
)
def test_parity_pp_four_ranks(pool4, strategy):
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=DEEP)[0]
    assert_parity(got, reference(n_layer=4))


def test_parity_pp_with_clipping_and_accumulation(pool4):
    """Clipping by the norm over both stages and both dp shards, with accumulate_grad_batches=2 across pipeline
    steps, at pp=2 × dp_shard=2."""
    overrides = dict(gradient_clip_val=0.5, accumulate_grad_batches=2)
    got = pool4.run(run_par3d, strategy=dict(pp=2, dp_shard=2), devices=4, model=DEEP, **overrides)[0]
    assert_parity(got, reference(n_layer=4, **overrides))


def test_parity_full_3d_on_eight_ranks(pool8):
    got = pool8.run(run_par3d, strategy=dict(pp=2, dp_shard=2, tp=2), devices=8, model=DEEP, timeout=600)[0]
    assert_parity(got, reference(n_layer=4))


# ---------------------------------------------------------------- Lightning's view


def test_logged_training_loss_and_validation_metrics_agree_on_every_rank(pool4):
    overrides = dict(limit_val_batches=2, val_check_interval=3, num_sanity_val_steps=1)
    results = pool4.run(run_par3d, strategy=dict(pp=2, tp=2), devices=4, model=DEEP, **overrides)
    first = results[0]
    assert "val_loss" in first["metrics"] and "train_loss" in first["metrics"]
    for other in results[1:]:
        assert other["local_losses"] == first["local_losses"]
        assert other["metrics"] == first["metrics"]


def test_pp_resume_continues_the_loss_trajectory(pool4, tmp_path):
    """With dropout: each stage's ranks resume the random streams they saved, so the masks are the whole run's; from
    checkpoints written in the background (``async_save``) while the next steps trained."""
    model = {**DEEP, "dropout": 0.1}
    strategy = dict(pp=2, dp_shard=2, async_save=True)
    assert_resume_continues(pool4, str(tmp_path), 6, strategy=strategy, devices=4, model=model)


# ---------------------------------------------------------------- errors, not hangs


def test_too_few_blocks_for_the_stages(pool2):
    with pytest.raises(RankError) as err:
        pool2.run(run_par3d, strategy=dict(pp=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2), devices=2)
    assert err.value.all_ranks_failed
    assert "Number of stages (4 = pp 2 × 2 per rank) cannot be greater than the number of blocks (2" in (
        err.value.exc_message
    )


def test_batch_not_divisible_by_microbatches(pool2):
    """A full batch that microbatches does not divide fails at setup, before the first step, naming the loader."""
    with pytest.raises(RankError) as err:
        pool2.run(run_par3d, strategy=dict(pp=2, microbatches=3), devices=2)
    assert err.value.all_ranks_failed
    message = "The batch of 8 samples per data-parallel rank of the training dataloader is not divisible by"
    assert f"{message} microbatches=3" in err.value.exc_message


PARTIAL = dict(max_bytes=1210)
"""30 training windows: one process reads batches of 8, 8, 8 and 6; two data-parallel ranks 4, 4, 4 and 3 each."""


@pytest.mark.parametrize("pool", [2, 4], indirect=True, ids=["pp=2", "pp=2xdp_shard=2"])
def test_a_partial_last_batch_trains_as_one_process_trains_it(pool):
    """The epoch's last batch (6 samples at pp=2, 3 per rank at pp=2 × dp_shard=2) is not divisible by
    microbatches=4: it runs as 3 equal microbatches, and the losses of that step and the next epoch's, and the final
    parameters, are one process's, which trains that batch whole."""
    strategy = dict(pp=2) if pool.world_size == 2 else dict(pp=2, dp_shard=2)
    got = pool.run(run_par3d, strategy=strategy, devices=pool.world_size, max_steps=5, data=PARTIAL)[0]
    assert_parity(got, run_reference(max_steps=5, data=PARTIAL))


def test_microbatches_for_a_partial_batch():
    from lightning_par3d.config.schedules import microbatches_for
    from lightning_par3d.pipeline.batches import EpochShape, check_epoch

    assert microbatches_for(16, "1f1b", 4, 2, 1) == 4
    assert microbatches_for(15, "1f1b", 4, 2, 1) == 3  # 3 of 5
    assert microbatches_for(13, "1f1b", 4, 2, 1) == 13  # prime: 1 microbatch is fewer than 1f1b's 2 stages
    assert microbatches_for(13, "gpipe", 4, 2, 1) == 1
    assert microbatches_for(6, "1f1b", 4, 4, 1) == 6  # 1f1b over 4 stages needs 4 or more: 6 of 1
    assert microbatches_for(3, "1f1b", 4, 4, 1) is None  # 3 samples cannot fill 4 stages
    layout = resolve_layout(Par3DConfig(pp=2), 2)
    assert check_epoch(EpochShape(16, 160), layout, "the training dataloader") is None
    note = check_epoch(EpochShape(16, 2879), layout, "the training dataloader")
    assert note is not None and "holds 15 samples per data-parallel rank" in note and "3 microbatches of 5" in note
    with pytest.raises(ValueError, match=re.escape("Drop it (DataLoader(..., drop_last=True))")):
        check_epoch(EpochShape(16, 2881), layout, "the training dataloader")  # 1 left, for 2 stages


def predict_job(strategy: dict) -> list | None:
    import lightning as L
    from torch.utils.data import DataLoader

    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from tests.gpt_runs import DATA, MODEL, SEED, trainer_kwargs

    L.seed_everything(SEED, verbose=False)
    data = ShakespeareDataModule(batch_size=8, **DATA)
    data.setup()
    trainer = L.Trainer(devices=2, strategy=Par3DStrategy(timeout_s=120, **strategy), **trainer_kwargs())
    loader = DataLoader(data.val_set, batch_size=4)
    return trainer.predict(GPTModule(**MODEL), dataloaders=loader)


def test_predict_returns_the_logits_on_every_pipeline_rank(pool2):
    import lightning as L
    from torch.utils.data import DataLoader

    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from tests.gpt_runs import DATA, MODEL, SEED

    L.seed_everything(SEED, verbose=False)
    module = GPTModule(**MODEL)
    module.configure_model()
    data = ShakespeareDataModule(batch_size=8, **DATA)
    data.setup()
    with torch.no_grad():
        expected = [module(x) for x, _ in DataLoader(data.val_set, batch_size=4)]
    for stage in pool2.run(predict_job, strategy=dict(pp=2, microbatches=2)):  # the first stage's too (broadcast)
        assert len(stage) == len(expected)
        for got, want in zip(stage, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_call_whose_own_loss_ran_cannot_train_again_through_the_declared_loss():
    """Under pp a trunk call with ``labels=`` runs the model's own loss at once; handing its output to the declared
    loss as well would train the batch twice: refused, naming both ways out. A call that did not run goes on."""
    from lightning_par3d.pipeline.runner import OwnLossOutput, PendingPipelineOutput
    from lightning_par3d.pipeline.trunk import PipelinedLoss

    ran = []
    loss = PipelinedLoss(lambda out, y: out, lambda pending, y, user: ran.append(pending) or torch.zeros(()))
    pending = PendingPipelineOutput((), {"input_ids": torch.zeros(1, 2)})
    loss(pending, None)
    assert ran == [pending]
    done = OwnLossOutput((), {"input_ids": torch.zeros(1, 2)}, loss=torch.ones(()))  # what the own-loss run returns
    with pytest.raises(ValueError, match=r"cannot go to the declared pipeline_loss too .* Return the output's \.loss"):
        loss(done, None)
    assert done.loss == 1 and done.aux_loss is None
    with pytest.raises(AttributeError, match=r"returns its own \.loss .* `\.logits` stayed inside the pipeline"):
        done.logits  # noqa: B018
