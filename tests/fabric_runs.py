"""Fabric jobs that more than one test module runs in the pool."""

from __future__ import annotations

import lightning as L
import torch

from examples.gpt import GPT_TP_PLAN
from tests.constants import MODEL, SEED

FABRIC_MODEL = {k: v for k, v in MODEL.items() if k not in ("lr", "eps")}
"""The example GPT's model arguments (``GPTConfig``), without the optimizer's."""


def fabric_checkpoint_job(strategy: dict, path: str) -> dict:
    """Trains one step, saves model + optimizer + a counter, loads them into a fresh model and optimizer, and
    reports whether every local shard and every optimizer state tensor came back exactly."""
    from examples.fabric_train import gpt_loss
    from examples.gpt import GPT, GPTConfig
    from lightning_par3d import Par3DFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=Par3DFabricStrategy(tp_plan=GPT_TP_PLAN, **strategy))
    fabric.launch()

    def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        fabric.seed_everything(seed)
        with fabric.init_module():
            model = GPT(GPTConfig(**{**FABRIC_MODEL, "n_layer": 4}))
        model = fabric.setup_module(model)
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    model, optimizer = fresh(SEED)
    x = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    fabric.strategy.train_step(model, x, x.roll(1, 1), gpt_loss)
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})

    model2, optimizer2 = fresh(SEED + 1)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(path, state)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params_equal = all(
        torch.equal(local(a), local(b)) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    states = _per_parameter_state(optimizer, model), _per_parameter_state(optimizer2, model2)
    optim_equal = all(
        torch.equal(local(s1[k]), local(s2[k])) for s1, s2 in zip(*states, strict=True) for k in ("exp_avg", "step")
    )
    return {"params": params_equal, "optimizer": optim_equal, "step": state["step"]}


def _per_parameter_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[dict]:
    """The optimizer state of each parameter in order; a ZeRO wrapper's is that of this rank's rows."""
    from lightning_par3d.zero.optimizer import zero_optimizers

    zero = zero_optimizers([optimizer])
    if zero:
        return [zero[0].inner.state[t] for group in zero[0].inner.param_groups for t in group["params"]]
    return [optimizer.state[p] for p in model.parameters()]
