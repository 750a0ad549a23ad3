"""``lightning_par3d.dry_run``: chosen ranks of an N-rank layout run one whole training step each, in a fresh
process of their own on this machine, over torch's fake process group."""

from __future__ import annotations

import pytest
import torch

from examples.gpt import GPTModule
from lightning_par3d import Par3DConfig, dry_run, estimate_memory


def _batch(per_rank: int, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 65, (per_rank, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def test_a_64_rank_layout_runs_its_first_rank_of_every_stage_with_the_estimators_model_state(new_interpreter):
    """pp2 × dp_shard8 × tp4 on 64 ranks: ranks 0 and 32 (the first of each pipeline stage) build their own shards,
    run the 1F1B schedule, step AdamW and plan a sharded checkpoint. Their parameters, gradients and optimizer state,
    counted from the tensors they hold, equal the estimator's figures for their pipeline ranks byte for byte: the
    dry run builds what a run builds."""
    config = Par3DConfig(pp=2, dp_shard=8, tp=4)
    batch = _batch(8)
    result = dry_run(GPTModule(), config, 64, batch)
    assert [r.rank for r in result.ranks] == [0, 32]
    assert [r.coordinates["pp"] for r in result.ranks] == [0, 1]
    estimate = estimate_memory(GPTModule(), config, 64, batch)
    for ran, expected in zip(result.ranks, estimate.rows, strict=True):
        assert (ran.params, ran.grads, ran.optimizer) == (
            expected.state.params,
            expected.state.grads,
            expected.state.optimizer,
        ), ran.rank
        assert ran.activations_peak > 0 and ran.saved_items > 0 and ran.saved_bytes > 0
    text = str(result)
    assert "pp=2 × dp_replicate=1 × dp_shard=8 × tp=4 (64 ranks)" in text and "\n       32 " in text


def test_a_model_that_breaks_at_the_layout_fails_with_the_runs_error_naming_the_rank(new_interpreter):
    """tp=2 cannot split 3 attention heads: the configuration checks cannot see it (it is inside the model), the
    dry run raises the error a run raises (``tests/test_cli.py`` checks the run's), with the rank named."""
    message = r"tp=2 does not divide the head count model\.transformer\.h\.0\.attn\.n_head=3"
    with pytest.raises(ValueError, match=message) as info:
        dry_run(GPTModule(n_head=3, n_embd=48), Par3DConfig(dp_shard=2, tp=2), 4, _batch(4), ranks=[1])
    assert any("rank 1 of 4" in note for note in info.value.__notes__)


def test_bad_input_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"dry_run\(ranks=\[8\]\): give ranks from 0 to 7"):
        dry_run(GPTModule(), Par3DConfig(tp=2), 8, _batch(4), ranks=[8])
    with pytest.raises(ValueError, match=r"divisible by pp × dp_replicate × tp = 1 × 1 × 3"):
        dry_run(GPTModule(), Par3DConfig(tp=3), 8, _batch(4))
