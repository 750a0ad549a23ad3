"""Train the bundled GPT with ``Fabric(strategy="par3d")``: the same model and plan, in a plain training loop.

    python examples/fabric_train.py --devices 4 --dp-shard 2 --tp 2 --steps 50
    python examples/fabric_train.py --devices 4 --pp 2 --tp 2 --steps 50     # pipelined, same loop

Under par3d the step goes through ``fabric.strategy.train_step``, which runs forward and backward at any
layout (through the pipeline schedule when pp > 1), so the loop has no layout branches.

Fabric launches the other ranks itself; under torchrun each rank runs this file.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, so that `examples.*` imports

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from examples.data import ShakespeareDataModule
from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig


def fabric_train(
    fabric: L.Fabric,
    steps: int,
    global_batch: int,
    model: dict[str, Any],
    data: dict[str, Any],
    lr: float = 3e-3,
    eps: float = 1e-8,
    clip: float | None = None,
    seed: int = 1234,
) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Trains for ``steps`` AdamW steps on ``global_batch`` samples per step; returns the per-step mean losses, the
    model and the optimizer."""
    fabric.seed_everything(seed)
    with fabric.init_module():  # under par3d: real on rank 0 only, meta elsewhere
        gpt = GPT(GPTConfig(**model))
    gpt = fabric.setup_module(gpt)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(gpt.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), eps=eps)
    )

    datamodule = ShakespeareDataModule(**data)
    datamodule.setup()
    # Split data over data-parallel ranks only; tensor-parallel peers read the same batch.
    split = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    sampler = DistributedSampler(datamodule.train_set, shuffle=True, seed=seed, **split)
    loader = DataLoader(datamodule.train_set, global_batch // split["num_replicas"], sampler=sampler)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)

    losses = []
    batches = itertools.chain.from_iterable(_epochs(loader, sampler))
    par3d = hasattr(fabric.strategy, "train_step")
    for step, (x, y) in zip(range(steps), batches, strict=False):
        if par3d:
            loss = fabric.strategy.train_step(gpt, x, y, gpt_loss)  # forward + backward, any layout
        else:
            loss = gpt_loss(gpt(x), y)
            fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(gpt, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.print(f"step {step:4d}  loss {losses[-1]:.4f}")
    return losses, gpt, optimizer


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B·T, vocab) against (B·T,)


def _epochs(loader: DataLoader, sampler: DistributedSampler) -> Any:
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield loader


def main() -> None:
    import lightning_par3d  # noqa: F401  (registers "par3d")
    from lightning_par3d import Par3DFabricStrategy

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--dp-shard", default="auto")
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()
    dp_shard = args.dp_shard if args.dp_shard == "auto" else int(args.dp_shard)
    strategy = Par3DFabricStrategy(
        dp_shard=dp_shard, dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp, tp_plan=GPT_TP_PLAN
    )
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    model = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
    fabric_train(fabric, args.steps, args.global_batch, model, dict(block_size=64))


if __name__ == "__main__":
    main()
