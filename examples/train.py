"""Train the bundled GPT with par3d, configured by Hydra (``conf/``).

    python examples/train.py experiment=demo                  # dp=2 × tp=2 × pp=2 on 8 CPU processes
    python examples/train.py strategy.tp=2 trainer.devices=2  # any Par3DConfig field from the command line
    python examples/train.py -m strategy.dp_shard=1,2 strategy.tp=2 trainer.devices=4 strategy.dp_replicate=2,1
    python examples/train.py experiment=demo mode=estimate    # each rank's memory, before launching anything

Lightning launches the other ranks itself (re-running this command); under torchrun or SLURM each rank runs it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, so that `examples.*` targets import

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

import lightning_par3d  # noqa: F401  (registers "par3d")
from lightning_par3d.integrations.hydra import register_configs
from lightning_par3d.memory.estimate import MemoryEstimate, estimate_memory

register_configs()
# Known upstream noise, silenced here in the example app (never in the library), once per rank otherwise:
# FSDP2 warns about any view its root returns, in case user code then modifies it in place (this example never does);
# Lightning 2.6 still builds torch's deprecated pytree LeafSpec.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


def build_trainer(cfg: DictConfig) -> L.Trainer:
    """The Trainer with the par3d strategy, callbacks and logger of ``cfg``."""
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    logger = instantiate(cfg.logger) if cfg.logger else False
    strategy = instantiate(cfg.strategy, _convert_="all", **pretrained_init(cfg))
    return instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=logger)


def pretrained_init(cfg: DictConfig) -> dict[str, Any]:
    """With ``model.pretrained_path`` (``model=hf_llama``), par3d reads the checkpoint's weights into each rank's
    shards: ``strategy.init=pretrained`` from that directory."""
    path = cfg.model.get("pretrained_path")
    return {"init": "pretrained", "pretrained_path": path} if path else {}


def train(cfg: DictConfig) -> dict[str, float]:
    """Fits the model and returns the final logged metrics."""
    L.seed_everything(cfg.seed, workers=True)
    trainer = build_trainer(cfg)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    trainer.fit(model, data, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    return metrics


def estimate(cfg: DictConfig) -> MemoryEstimate:
    """``mode=estimate``: each rank's memory for the configured model, layout, batch and precision, computed in
    this process (fake tensors, a fake process group) before any rank is launched."""
    strategy = instantiate(cfg.strategy, _convert_="all")
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    batch = (cfg.data.batch_size, cfg.data.block_size)
    precision = str(cfg.trainer.get("precision", "32-true"))
    result = estimate_memory(instantiate(cfg.model), strategy.config, world_size, batch, precision=precision)
    print(result)
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Any:
    if cfg.mode == "estimate":
        return estimate(cfg).peak
    if cfg.mode != "train":
        raise ValueError(f"mode={cfg.mode!r} is not a mode. Allowed: 'train', 'estimate'.")
    return train(cfg).get("val_loss")


if __name__ == "__main__":
    main()
