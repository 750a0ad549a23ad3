"""Optimizers over a tensor-parallel model without FSDP, whose groups mix DTensor and plain parameters: ``foreach``
(torch's default on CUDA) trains on the single-process trajectory, also after a checkpoint restores the group's
options, and ``fused=True`` is refused before training, on every rank."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning as L
import pytest
import torch

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from tests.accelerate_runs import accelerate_loop, fabric_loop, single_process_loop
from tests.conftest import assert_parity
from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, SEED, LossRecorder, full_state, run_reference, trainer_kwargs
from tests.harness import RankError


class OptionsGPT(GPTModule):
    """The example GPT with extra AdamW options, as a user passes them."""

    def __init__(self, options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options = options

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return torch.optim.AdamW(
            self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas), eps=hp.eps, **self.options
        )


def options_job(strategy: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=4, strategy=par3d, callbacks=[recorder], **trainer_kwargs())
    module = OptionsGPT(options, **MODEL)
    data = ShakespeareDataModule(batch_size=GLOBAL_BATCH // par3d.layout.dp, **DATA)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    notices = [str(w.message) for w in seen if "foreach" in str(w.message)]
    groups = [dict(g) for g in trainer.optimizers[0].param_groups]
    return {
        "losses": recorder.losses,
        "params": full_state(module),
        "foreach": [g["foreach"] for g in groups],
        "notices": notices,
    }


@pytest.mark.parametrize("strategy", [dict(tp=4), dict(pp=2, tp=2)], ids=["tp=4", "pp2xtp2"])
def test_foreach_over_mixed_parameters_trains_on_the_single_process_trajectory(pool4, strategy):
    got = pool4.run(options_job, strategy=strategy, options={"foreach": True})
    assert all(r["foreach"] == [False] for r in got)
    [notice] = got[0]["notices"]  # said once, by rank 0
    assert re.search(r"AdamW\(foreach=True\): group 0 holds \d+ DTensor and \d+ plain parameters", notice), notice
    assert all(r["notices"] == [] for r in got[1:])
    assert_parity(got[0], run_reference())


@pytest.mark.parametrize("loop", [accelerate_loop, fabric_loop], ids=["accelerate", "fabric"])
def test_foreach_over_mixed_parameters_under_accelerate_and_fabric(pool4, loop):
    """The same fix reaches the other front-ends (both set their optimizers up through the engine)."""
    got = pool4.run(loop, strategy=dict(pp=2, tp=2), optimizer_options={"foreach": True})[0]
    assert_parity(got, single_process_loop())


def reload_job() -> list[Any]:
    """A mixed group's ``foreach`` after loading a state dict saved with ``foreach=True`` (as an older checkpoint,
    or another layout's, holds it)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor, init_device_mesh

    from lightning_par3d.parallel.optimizer_paths import use_per_tensor_path_where_mixed

    mesh = init_device_mesh("cpu", (4,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.ones(4))
    assert isinstance(sharded, DTensor)
    optimizer = torch.optim.AdamW([sharded, plain], foreach=None)
    use_per_tensor_path_where_mixed(optimizer, {plain: "norm.weight"})
    after_setup = optimizer.param_groups[0]["foreach"]
    saved = optimizer.state_dict()
    saved["param_groups"][0]["foreach"] = True
    optimizer.load_state_dict(saved)
    return [after_setup, optimizer.param_groups[0]["foreach"]]


def test_a_loaded_state_dict_does_not_turn_foreach_back_on(pool4):
    assert pool4.run(reload_job) == [[False, False]] * 4


def test_fused_over_mixed_parameters_is_refused_before_training_on_every_rank(pool4):
    with pytest.raises(RankError) as err:
        pool4.run(options_job, strategy=dict(tp=4), options={"fused": True})
    assert err.value.all_ranks_failed
    message = err.value.exc_message
    assert "AdamW(fused=True): parameter group 0 holds" in message
    assert re.search(r"plain ones \(such as 'model\.transformer\.\S+'\)", message), message
    assert "Pass fused=False" in message
