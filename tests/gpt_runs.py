"""Training runs of the example GPT, shared by the single-process reference and the par3d jobs in the pool.

Same seed, same global batch: a par3d run with ``dp`` data-parallel ranks reads ``global_batch / dp`` samples per
rank through the DistributedSampler that Lightning injects (shuffled with the seed, split over dp ranks only). The
reference reads ``global_batch`` samples per step through a DistributedSampler over one replica with the same seed,
which yields the same permutation; so every optimizer step of both runs sees the same set of samples.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from tests.constants import DATA, GLOBAL_BATCH, MODEL, SEED


class LossRecorder(L.Callback):
    """Records each training batch's loss averaged over ranks (the data-parallel mean: tp peers hold equal values)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.local_losses: list[float] = []  # this rank's own value, as self.log and the progress bar see it

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.local_losses.append(outputs["loss"].item())
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


class StepRecorder(L.Callback):
    """Each optimizer step's loss (the data-parallel mean, summed over its accumulated batches, which Lightning has
    divided by the accumulation) and the input rows every rank read in it (a set: tensor-parallel and pipeline peers
    read the same rows), keyed by the step. :meth:`on_step_done` is called once a step's last batch is recorded."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}
        self._step = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step  # the optimizer step this batch is part of

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        import torch.distributed as dist

        loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
        rows: list[Any] = [None] * dist.get_world_size()
        inputs = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        dist.all_gather_object(rows, inputs.tolist())
        record = self.steps.setdefault(self._step, {"loss": 0.0, "rows": set()})
        record["loss"] += loss
        record["rows"].update(tuple(r) for rank_rows in rows for r in rank_rows)
        if trainer.global_step > self._step:  # the optimizer stepped on this batch
            self.on_step_done(trainer, self._step, record)

    def on_step_done(self, trainer: L.Trainer, step: int, record: dict[str, Any]) -> None:
        """Called once per optimizer step, after its last batch."""


class ReferenceData(ShakespeareDataModule):
    """The single-process data: the permutation a seeded DistributedSampler gives, read ``global_batch`` at a time."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(self.train_set, self.batch_size, sampler=sampler)


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's parameters on rank 0 (None elsewhere): each DTensor gathered over its own mesh (its tp and
    dp shards, by DTensor's ``full_tensor``), then the pipeline stages' entries merged on rank 0. (DCP's
    ``get_model_state_dict(full_state_dict=True)`` is not used here: it gathers on rank 0 only, which under
    pipelining holds the first stage alone.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    # clone(): full_tensor() may return an async collective result that only an op (not detach/cpu) waits for.
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().cpu()
        for k, v in module.state_dict().items()
    }
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size())]
    dist.gather_object(state, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered or []:
        merged.update(part)
    return merged


def run_reference(
    max_steps: int = 6,
    model: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    global_batch: int = GLOBAL_BATCH,
    build_on_cpu: bool = False,
    **trainer_overrides: Any,
) -> dict:
    """The single-process run (Lightning's default strategy on one CPU device): trained once per session for each
    distinct run (many modules compare with the same one), and handed out as a fresh dict of the same tensors.

    ``build_on_cpu`` builds the model (``configure_model``) on the CPU before ``fit``, as par3d's rank 0 builds it
    (``init="rank0"``), where Lightning's single-device strategy would build it on its device: on a GPU, CUDA's
    generator draws other numbers from the same seed."""
    spec = dict(max_steps=max_steps, model={**MODEL, **(model or {})}, data={**DATA, **(data or {})})
    if global_batch != GLOBAL_BATCH:
        spec["global_batch"] = global_batch
    if build_on_cpu:
        spec["build_on_cpu"] = True
    done = _train_reference(json.dumps({**spec, **trainer_overrides}, sort_keys=True))
    return {"losses": list(done["losses"]), "params": dict(done["params"])}


@functools.cache
def _train_reference(spec: str) -> dict:
    run = json.loads(spec)
    max_steps, model, data = run.pop("max_steps"), run.pop("model"), run.pop("data")
    global_batch = run.pop("global_batch", GLOBAL_BATCH)
    build_on_cpu = run.pop("build_on_cpu", False)
    L.seed_everything(SEED, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, callbacks=[recorder], **trainer_kwargs(max_steps=max_steps, **run))
    module = GPTModule(**model)
    if build_on_cpu:
        with torch.device("cpu"):
            module.configure_model()  # fit's own call then finds the model built
    trainer.fit(module, ReferenceData(batch_size=global_batch, **data))
    return {"losses": recorder.losses, "params": full_state(module)}


def run_par3d(
    strategy: dict[str, Any],
    devices: int,
    max_steps: int = 6,
    model: dict[str, Any] | None = None,
    ckpt_dir: str | None = None,
    resume_from: str | None = None,
    data: dict[str, Any] | None = None,
    global_seed: int = SEED,
    keep_module: bool = False,
    extra_callbacks: list[L.Callback] | None = None,
    rank_batch: int | None = None,
    torch_compile: dict[str, Any] | None = None,
    **trainer_overrides: Any,
) -> dict:
    """One par3d run inside a pool worker; ``strategy`` holds :class:`Par3DConfig` fields. ``keep_module`` adds the
    trained LightningModule to the result (for jobs that inspect it before returning). Each data-parallel rank reads
    ``GLOBAL_BATCH / dp`` samples a step, or ``rank_batch`` (``layout="auto"``, whose dp is chosen at launch); the
    result's ``layout`` is the one trained. ``torch_compile``: fit ``torch.compile(module, **torch_compile)``, as
    Lightning's docs show."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(global_seed, verbose=False)
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder, *(extra_callbacks or [])]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=-1))
    checkpointing = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    overrides = dict(max_steps=max_steps, enable_checkpointing=checkpointing, **trainer_overrides)
    trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=callbacks, **trainer_kwargs(**overrides))
    module = GPTModule(**{**MODEL, **(model or {})})
    batch_size = rank_batch if rank_batch is not None else GLOBAL_BATCH // par3d.layout.dp
    datamodule = ShakespeareDataModule(batch_size=batch_size, **{**DATA, **(data or {})})
    fitted = module if torch_compile is None else torch.compile(module, **torch_compile)
    trainer.fit(fitted, datamodule, ckpt_path=resume_from)
    saved = sorted(p.name for p in Path(ckpt_dir).iterdir()) if ckpt_dir and trainer.is_global_zero else None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result = {
        "losses": recorder.losses,
        "local_losses": recorder.local_losses,
        "metrics": metrics,
        "params": full_state(module),
        "saved": saved,
        "layout": par3d.layout,
    }
    return {**result, "module": module} if keep_module else result
