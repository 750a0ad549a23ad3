"""One reduction semantics behind every front-end: the Trainer's ``strategy.reduce`` (what ``self.log(...,
sync_dist=True)`` calls), Fabric's ``fabric.all_reduce`` / ``all_gather`` and ``Par3DAccelerator.reduce`` sum over
the data-parallel ranks, which read different samples. Tensor-parallel peers and pipeline stages read the same ones:
a sum over the whole world would count each of them tp × pp times. Each front-end counts the samples its ranks read
in a step and gets the global batch, one process's number, at dp2 × tp2 and pp2 × dp2."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.constants import GLOBAL_BATCH

LAYOUTS = [
    pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2"),
    pytest.param(dict(pp=2, dp_shard=2), id="pp2xdp2"),
]


def _counted(reduce: Any, gather: Any, dp: int) -> dict[str, Any]:
    """Every rank's samples of a step (``GLOBAL_BATCH / dp``), summed and averaged by the front-end's reduction; the
    gathered counts' length, where the front-end gathers."""
    mine = torch.tensor(float(GLOBAL_BATCH // dp))
    counted = {
        "sum": float(reduce(mine, "sum")),
        "mean": float(reduce(mine, "mean")),
        "max": float(reduce(mine, "max")),
    }
    if gather is not None:
        counted["gathered"] = len(gather(mine))
    return counted


def trainer_counts(strategy: dict) -> dict[str, Any]:
    from tests.gpt_runs import run_par3d

    module = run_par3d(strategy=strategy, devices=4, max_steps=1, keep_module=True)["module"]
    par3d = module.trainer.strategy
    return _counted(lambda t, op: par3d.reduce(t, reduce_op=op), None, par3d.engine.layout.dp)


def fabric_counts(strategy: dict) -> dict[str, Any]:
    from tests.accelerate_runs import _fabric_gpt

    fabric, _, _ = _fabric_gpt({**strategy, **({"microbatches": 2} if strategy.get("pp") else {})})
    return _counted(lambda t, op: fabric.all_reduce(t, reduce_op=op), fabric.all_gather, fabric.strategy.engine.dp_size)


def accelerate_counts(strategy: dict) -> dict[str, Any]:
    from examples.gpt import GPT, GPTConfig
    from tests.accelerate_runs import GPT_MODEL, _accelerator, _optimizer

    accelerator = _accelerator(strategy)
    with accelerator.init_empty_weights():
        model = GPT(GPTConfig(**GPT_MODEL))
    accelerator.prepare(model, _optimizer(model.parameters()))
    return _counted(lambda t, op: accelerator.reduce(t, op), accelerator.gather, accelerator.dp_size)


@pytest.mark.parametrize("strategy", LAYOUTS)
@pytest.mark.parametrize("front_end", [trainer_counts, fabric_counts, accelerate_counts], ids=lambda f: f.__name__)
def test_every_front_end_reduces_to_one_process_number(pool4, front_end, strategy):
    for counted in pool4.run(front_end, strategy=strategy):
        assert counted["sum"] == GLOBAL_BATCH, counted  # the global batch: each sample once
        assert counted["mean"] == counted["max"] == GLOBAL_BATCH / 2, counted  # dp = 2 at both layouts
        assert counted.get("gathered", 2) == 2, counted  # one entry per data-parallel rank
