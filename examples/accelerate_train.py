"""Train the bundled models with par3d from an Accelerate loop, configured by the same Hydra files as the Lightning
app (``conf/``: model, data and strategy; Lightning's trainer and callback groups are not used here).

    accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py strategy.tp=2
    accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py strategy.pp=2 strategy.tp=2
    accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py model=hf_llama
    accelerate launch --config_file conf/accelerate/gpu8.yaml examples/accelerate_train.py strategy.tp=2 steps=1000

The loop is a plain Accelerate loop; ``Par3DAccelerator(par3d=...)`` is the one changed line, and
``accelerator.train_step`` runs forward and backward at any layout, the pipeline schedule included.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, so that `examples.*` targets import

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from examples.hf_llama import logits_of
from lightning_par3d import Par3DConfig, quiet_known_upstream_warnings
from lightning_par3d.accelerate import Par3DAccelerator
from lightning_par3d.integrations.hydra_schema import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
quiet_known_upstream_warnings()  # Lightning's known noise (docs/api.md, "The console")


def load_config(overrides: list[str]) -> DictConfig:
    """``conf/accelerate_train.yaml`` (the Lightning app's model, data and strategy groups, and the loop's own
    settings) with the command line's overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("accelerate_train", overrides=overrides)


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the model's logits (a transformers ``ModelOutput`` or a tensor)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def par3d_config(cfg: DictConfig, module: Any) -> Par3DConfig:
    """The strategy group as a ``Par3DConfig``, with the example module's plan (a dict, or ``"auto"`` for a
    transformers model's own)."""
    fields: dict[str, Any] = OmegaConf.to_container(cfg.strategy, resolve=True)  # type: ignore[assignment]
    fields.pop("_target_", None)
    if not fields.get("tp_plan"):
        fields["tp_plan"] = type(module).tp_plan
    path = cfg.model.get("pretrained_path")
    if path:
        fields.update(init="pretrained", pretrained_path=path)
    return Par3DConfig(**fields)


def main(cfg: DictConfig) -> dict[str, float]:
    module = instantiate(cfg.model)  # the LightningModule of the Lightning app: here only its model, plan and lr
    accelerator = Par3DAccelerator(
        par3d=par3d_config(cfg, module),
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.accumulate,
    )
    torch.manual_seed(cfg.seed)
    with accelerator.init_empty_weights():  # real on process 0, meta elsewhere: nobody else holds a full copy
        module.configure_model()
    model = module.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.lr, weight_decay=cfg.model.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    data = instantiate(cfg.data)
    data.setup()
    train = DataLoader(data.train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(data.val_set, batch_size=cfg.data.batch_size, drop_last=True)
    model, optimizer, train, val, scheduler = accelerator.prepare(model, optimizer, train, val, scheduler)
    accelerator.print(accelerator.engine.describe())

    metrics: dict[str, float] = {}
    bar = tqdm(total=cfg.steps, desc="train", disable=not accelerator.is_main_process)
    step = 0
    while step < cfg.steps:
        for x, y in train:
            with accelerator.accumulate(model):
                loss = accelerator.train_step(model, x, y, loss_fn)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            metrics["train_loss"] = accelerator.reduce(loss.detach(), "mean").item()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                metrics.update(evaluate(accelerator, model, val))
                bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", val_loss=f"{metrics['val_loss']:.3f}")
            if step == cfg.steps:
                break
    bar.close()
    if cfg.save_to:
        accelerator.save_state(cfg.save_to)
    accelerator.print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    accelerator.end_training()
    return metrics


def evaluate(accelerator: Par3DAccelerator, model: Any, loader: DataLoader) -> dict[str, float]:
    """Mean validation loss over every validation batch, each counted once (``gather_for_metrics`` gathers over the
    data-parallel ranks only, from the last pipeline stage), and its perplexity."""
    losses = []
    for x, y in loader:
        loss = accelerator.eval_step(model, x, y, loss_fn)
        losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
    val_loss = torch.cat(losses).mean().item()
    return {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}


if __name__ == "__main__":
    main(load_config(sys.argv[1:]))
