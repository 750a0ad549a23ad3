"""Training loops of the example GPT through ``Par3DAccelerator``, and the single-process loop they are compared with.

Same seed, same global batch: the loader shuffles with a seeded generator, and ``Par3DAccelerator`` hands each
data-parallel rank every ``dp``-th batch of ``GLOBAL_BATCH // dp`` samples, so that each optimizer step of both loops
sees the same samples.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import DataLoader

from examples.data import ShakespeareDataModule
from examples.fabric_train import gpt_loss
from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
from tests.gpt_runs import GLOBAL_BATCH, MODEL, SEED, full_state

GPT_MODEL = {k: v for k, v in MODEL.items() if k not in ("lr", "eps")}
# 96 training windows: 12 global batches, so that 6 steps × 2 accumulated batches stay within one epoch.
ACCELERATE_DATA = dict(block_size=32, max_bytes=96 * 32 + 1, val_fraction=0.0)


def _data(batch_size: int) -> DataLoader:
    data = ShakespeareDataModule(**ACCELERATE_DATA)
    data.setup()
    generator = torch.Generator().manual_seed(SEED)
    return DataLoader(data.train_set, batch_size, shuffle=True, generator=generator)


def _optimizer(params: Any, **options: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=MODEL["lr"], weight_decay=0.1, betas=(0.9, 0.95), eps=MODEL["eps"], **options)


def single_process_loop(
    steps: int = 6,
    accumulate: int = 1,
    clip: float | None = None,
    n_layer: int = 2,
    skip: int = 0,
    global_batch: int = GLOBAL_BATCH,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The reference: one process, plain torch; per-batch losses and the final parameters. ``batches``: the global
    batches to read, instead of the seeded loader's."""
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**{**GPT_MODEL, "n_layer": n_layer}))
    optimizer = _optimizer(model.parameters())
    losses = []
    source = batches if batches is not None else _data(global_batch)
    for i, (x, y) in enumerate(itertools.islice(source, steps * accumulate)):
        loss = gpt_loss(model(x), y)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses[skip * accumulate :], "params": full_state(model)}


def _accelerator(strategy: dict[str, Any], **kwargs: Any) -> Any:
    from accelerate.state import AcceleratorState, GradientState

    from lightning_par3d import Par3DConfig
    from lightning_par3d.accelerate import Par3DAccelerator

    AcceleratorState._reset_state(True)  # one Accelerator per job in these long-lived workers
    GradientState._reset_state()
    return Par3DAccelerator(par3d=Par3DConfig(tp_plan=GPT_TP_PLAN, timeout_s=120, **strategy), **kwargs)


def accelerate_loop(
    strategy: dict[str, Any],
    steps: int = 6,
    accumulate: int = 1,
    clip: float | None = None,
    n_layer: int = 2,
    mixed_precision: str = "no",
    save_to: str | None = None,
    load_from: str | None = None,
    start: int = 0,
    plain_backward: bool = False,
    optimizer_options: dict[str, Any] | None = None,
    rank_batch: int | None = None,
) -> dict[str, Any]:
    """The loop of the README through ``Par3DAccelerator``: batches ``start`` to ``steps`` (× ``accumulate``),
    optionally loading a ``save_state`` checkpoint first and saving one at the end; ``optimizer_options`` go to
    AdamW. Each data-parallel rank reads ``GLOBAL_BATCH / dp`` samples a step, or ``rank_batch`` (``layout="auto"``,
    whose dp is chosen in ``prepare``); the result's ``dp`` is the one trained."""
    accelerator = _accelerator(strategy, gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision)
    torch.manual_seed(SEED)
    with accelerator.init_empty_weights():
        model = GPT(GPTConfig(**{**GPT_MODEL, "n_layer": n_layer}))
    # before prepare, as Accelerate scripts do: it follows the shards
    optimizer = _optimizer(model.parameters(), **(optimizer_options or {}))
    loader = _data(rank_batch or GLOBAL_BATCH // accelerator.dp_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if load_from is not None:
        accelerator.load_state(load_from)
    losses = []
    for x, y in itertools.islice(loader, start * accumulate, steps * accumulate):
        with accelerator.accumulate(model):
            if plain_backward:
                loss = gpt_loss(model(x), y)
                accelerator.backward(loss)
            else:
                loss = accelerator.train_step(model, x, y, gpt_loss)
            if clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    if save_to is not None:
        accelerator.save_state(save_to)
    return {"losses": losses, "params": full_state(accelerator.unwrap_model(model)), "dp": accelerator.dp_size}


def _fabric_gpt(strategy: dict[str, Any], **optimizer_options: Any) -> tuple[Any, Any, Any]:
    """Fabric on 4 ranks with ``Par3DFabricStrategy(**strategy)``, launched, and the seeded GPT and its optimizer
    set up."""
    import lightning as L

    from lightning_par3d import Par3DFabricStrategy

    fabric = L.Fabric(
        accelerator="cpu", devices=4, strategy=Par3DFabricStrategy(tp_plan=GPT_TP_PLAN, timeout_s=120, **strategy)
    )
    fabric.launch()
    torch.manual_seed(SEED)
    with fabric.init_module():
        model = GPT(GPTConfig(**GPT_MODEL))
    model = fabric.setup_module(model)
    return fabric, model, fabric.setup_optimizers(_optimizer(model.parameters(), **optimizer_options))


def fabric_loop(
    strategy: dict[str, Any],
    steps: int = 6,
    clip: float | None = None,
    optimizer_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`accelerate_loop`'s script under Lightning's Fabric with ``Par3DFabricStrategy``: the same model, seed,
    optimizer and batches (each data-parallel rank reads every ``dp``-th batch of the seeded loader, as
    ``Par3DAccelerator`` hands them out)."""
    fabric, model, optimizer = _fabric_gpt(strategy, **(optimizer_options or {}))
    engine = fabric.strategy.engine
    dp, dp_rank = engine.dp_size, engine.dp_rank
    losses = []
    for x, y in itertools.islice(_data(GLOBAL_BATCH // dp), dp_rank, steps * dp, dp):
        loss = fabric.strategy.train_step(model, x, y, gpt_loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    params = full_state(model)
    if params is not None:
        params = {k.removeprefix("trunk."): v for k, v in params.items()}
    return {"losses": losses, "params": params, "layout": engine.layout}


def fabric_loader_loop(strategy: dict[str, Any], batch_size: int, steps: int = 4) -> dict[str, Any]:
    """A Fabric loop that hands its DataLoader (``batch_size`` per rank, shuffled) to ``fabric.setup_dataloaders``,
    as Fabric users do: Fabric adds its distributed sampler, and under ``layout="auto"`` par3d re-makes the loader
    at the per-rank batch that keeps the global batch. Returns the batches the rank read, with its data-parallel
    rank and whether it is its dp group's first copy (tp rank 0, first pipeline stage)."""
    fabric, model, optimizer = _fabric_gpt(strategy)
    data = ShakespeareDataModule(**ACCELERATE_DATA)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_set, batch_size, shuffle=True))
    losses, read = [], []
    for x, y in itertools.islice(loader, steps):
        loss = fabric.strategy.train_step(model, x, y, gpt_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        read.append((x.clone(), y.clone()))
    engine = fabric.strategy.engine
    coords = engine.mesh.coords(fabric.global_rank)
    return {
        "losses": losses,
        "params": full_state(model),
        "read": read,
        "dp_rank": engine.dp_rank,
        "first_copy": coords.tp == 0 and coords.pp == 0,
    }
