"""Activation checkpointing: the same losses as without it, measurably less activation memory, and the
recomputation visible as extra FLOPs, at data-, tensor- and pipeline-parallel layouts."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from examples.gpt import GPT, Block, GPTConfig
from lightning_par3d import Par3DConfig, resolve_layout
from lightning_par3d.parallel.activation_checkpoint import apply_activation_checkpointing, find_ac_blocks
from tests.conftest import assert_parity
from tests.gpt_runs import run_par3d, run_reference

DEEP = dict(n_layer=4)


@functools.cache
def reference(n_layer: int = 4) -> dict:
    return run_reference(model=dict(n_layer=n_layer))


# ---------------------------------------------------------------- unit


def test_modes_choose_blocks_and_keep_names():
    model = GPT(GPTConfig(n_layer=4, n_embd=32))
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_activation_checkpointing(model, "selective", every=2) == 2
    assert [type(b).__name__ for b in model.transformer.h.values()] == [
        "CheckpointedBlock",
        "Block",
        "CheckpointedBlock",
        "Block",
    ]
    assert [n for n, _ in model.named_parameters()] == names  # nothing renamed
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert isinstance(model.transformer.h["0"], Block)  # still a Block for isinstance checks and plans


def test_blocks_by_class_or_pattern():
    model = GPT(GPTConfig(n_layer=3, n_embd=32))
    assert find_ac_blocks(model, "Block") == list(model.transformer.h.values())
    assert find_ac_blocks(model, "h.*.mlp") == [model.transformer.h[str(i)].mlp for i in range(3)]
    with pytest.raises(ValueError, match="ac_blocks='Layer' names no module class and matches no module name"):
        apply_activation_checkpointing(model, "full", "Layer")


def test_checkpointed_block_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=2, n_embd=32, block_size=16))
    for mode in ("full", "op"):
        checkpointed = GPT(GPTConfig(n_layer=2, n_embd=32, block_size=16))
        checkpointed.load_state_dict(plain.state_dict())
        apply_activation_checkpointing(checkpointed, mode)
        x = torch.randint(0, 256, (2, 16))
        for model in (plain, checkpointed):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
        for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")


def test_unknown_mode_fails_before_launch():
    with pytest.raises(ValueError, match=r"activation_checkpointing='all' is not a mode\. Allowed: 'none', 'full'"):
        resolve_layout(Par3DConfig(activation_checkpointing="all"), 2)


# ---------------------------------------------------------------- parity at every kind of layout

LAYOUTS = [
    pytest.param(dict(dp_shard=2, activation_checkpointing="full"), id="dp_shard=2-full"),
    pytest.param(dict(tp=2, activation_checkpointing="full"), id="tp=2-full"),
    pytest.param(dict(pp=2, activation_checkpointing="full"), id="pp=2-full"),
    pytest.param(dict(dp_shard=2, activation_checkpointing="selective"), id="dp_shard=2-selective"),
    pytest.param(dict(tp=2, activation_checkpointing="op"), id="tp=2-op"),
    pytest.param(dict(pp=2, activation_checkpointing="op"), id="pp=2-op"),
]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_parity_with_activation_checkpointing(pool2, strategy):
    got = pool2.run(run_par3d, strategy=strategy, devices=2, model=DEEP)[0]
    assert_parity(got, reference())


def test_parity_full_checkpointing_in_3d(pool8):
    strategy = dict(pp=2, dp_shard=2, tp=2, activation_checkpointing="full")
    got = pool8.run(run_par3d, strategy=strategy, devices=8, model=DEEP, timeout=600)[0]
    assert_parity(got, reference())


# ---------------------------------------------------------------- memory falls, FLOPs rise


class StepProbe(L.Callback):
    """For the third training step: the peak bytes saved for backward, and the FLOPs counted by FlopCounterMode."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        from lightning_par3d.memory.meters import SavedTensorMeter

        if idx == 2:
            self.meter = SavedTensorMeter().__enter__()
            self.flops = FlopCounterMode(display=False)
            self.flops.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == 2:
            self.flops.__exit__(None, None, None)
            self.meter.__exit__(None, None, None)
            self.result = {"activations": self.meter.peak, "flops": self.flops.get_total_flops()}


def probe_job(strategy: dict) -> dict:
    from examples.data import ShakespeareDataModule
    from examples.gpt import GPTModule
    from lightning_par3d import Par3DStrategy
    from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, trainer_kwargs

    L.seed_everything(0, verbose=False)
    probe = StepProbe()
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    trainer = L.Trainer(devices=2, strategy=par3d, callbacks=[probe], **trainer_kwargs(max_steps=3))
    data = ShakespeareDataModule(batch_size=GLOBAL_BATCH // par3d.layout.dp, **DATA)
    trainer.fit(GPTModule(**{**MODEL, **DEEP}), data)
    return probe.result


@pytest.mark.parametrize("layout", [dict(dp_shard=2), dict(tp=2), dict(pp=2)], ids=["dp_shard=2", "tp=2", "pp=2"])
def test_checkpointing_trades_memory_for_recompute(pool2, layout):
    """``full`` keeps at most half the activations and recomputes every block's forward (more FLOPs);
    ``selective`` (every 2nd block) sits in between. ``op`` caches the matmul and collective outputs, so it
    recomputes no FLOPs (FlopCounterMode counts matmuls and attention) and keeps more than ``full``; whether it
    keeps less than no checkpointing depends on the model (here it saves at dp and tp, not at pp=2)."""
    got = {
        mode: pool2.run(probe_job, strategy={**layout, "activation_checkpointing": mode})
        for mode in ("none", "full", "selective", "op")
    }
    for rank in range(2):
        none, full, selective, op = (got[m][rank] for m in ("none", "full", "selective", "op"))
        assert full["activations"] <= 0.5 * none["activations"], (full, none)
        assert full["activations"] < selective["activations"] < none["activations"]
        assert op["activations"] > full["activations"]  # the cached matmul outputs are counted
        assert full["flops"] > 1.15 * none["flops"], (full, none)
        assert none["flops"] < selective["flops"] < full["flops"]
        assert op["flops"] == none["flops"]
