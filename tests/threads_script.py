"""Launches 2 CPU ranks as a user does and records each rank's CPU threads.

    python tests/threads_script.py OUT trainer|fabric par3d|ddp

runs ``Trainer(devices=2, strategy=...)`` (one training step of a linear model) or ``Fabric(devices=2,
strategy=...).launch()`` through Lightning's own subprocess launcher, and every rank writes ``OUT/rank<r>.json`` with
``torch.get_num_threads()`` and ``OMP_NUM_THREADS`` as that rank's own training code sees them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.constants import THREADS_RANKS as RANKS


def record(out: Path, rank: int) -> None:
    seen = {"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


class Linear(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(4, 1)

    def on_fit_start(self) -> None:
        record(self.out, self.global_rank)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def strategy(name: str, front: str) -> Any:
    if name == "ddp":
        return "ddp"
    from lightning_par3d import Par3DFabricStrategy, Par3DStrategy

    cls = Par3DStrategy if front == "trainer" else Par3DFabricStrategy
    return cls(dp_replicate=RANKS, dp_shard=1, timeout_s=120)


def main(out: Path, front: str, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if front == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=RANKS, strategy=strategy(name, front))
        fabric.launch()
        record(out, fabric.global_rank)
        fabric.barrier()
        return
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=strategy(name, front),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Linear(out), data)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
