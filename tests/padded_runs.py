"""Padded, variable-length data and the runs on it that more than one test module uses: the Shakespeare byte windows
cut to different real lengths and padded back to the block (left or right), with ``-100`` labels on the pads, for an
unmodified transformers Llama.

Two kinds of module are trained on them: :class:`PaddedLM`, whose ``training_step`` calls the model with the mask and
its declared ``pipeline_loss`` on the labels (the shape every layout takes, pp included), and :class:`OwnLossLM`,
which passes ``labels=`` to the transformers model and returns its ``.loss`` (what most Hugging Face code does; not
pipelined). The single-process reference trains the same module on one device, on the same samples."""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from examples.data import ByteWindows, ShakespeareDataModule
from examples.hf_llama import CausalLMModule
from tests.constants import DATA, GLOBAL_BATCH, SEED
from tests.gpt_runs import LossRecorder, ReferenceData, full_state, trainer_kwargs
from tests.hf_runs import TINY

PAD = 0
"""The pad token id (byte 0 does not occur in the text)."""
MIN_REAL = 6
"""The shortest real length of a padded row (of 32)."""


def real_length(index: int, block_size: int) -> int:
    """How many real tokens sample ``index`` keeps: spread over ``MIN_REAL … block_size`` (some rows unpadded)."""
    return MIN_REAL + (index * 11) % (block_size - MIN_REAL + 1)


class PaddedWindows(Dataset):
    """Each byte window cut to :func:`real_length` real tokens and padded back to the block (pads on the ``side``
    given): ``{"input_ids", "attention_mask", "labels"}``, with ``-100`` labels on the pads; ``side="packed"``: the
    window as two packed documents instead (:func:`packed_row`). ``own_labels``: the labels
    a transformers model shifts itself (the input ids, ``-100`` on the pads), else the next byte of each position."""

    def __init__(self, windows: ByteWindows, side: str, own_labels: bool = False) -> None:
        self.windows, self.side, self.own_labels = windows, side, own_labels

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.windows[index]
        n = real_length(index, len(x))
        if self.side == "packed":
            return packed_row(x, y, min(n, len(x) - MIN_REAL), self.own_labels)
        real = slice(len(x) - n, len(x)) if self.side == "left" else slice(0, n)
        ids, mask, labels = torch.full_like(x, PAD), torch.zeros_like(x), torch.full_like(y, -100)
        ids[real], mask[real], labels[real] = x[:n], 1, (x if self.own_labels else y)[:n]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_row(x: torch.Tensor, y: torch.Tensor, first: int, own_labels: bool) -> dict[str, torch.Tensor]:
    """A window as two packed documents, the first ``first`` tokens long: ``position_ids`` restart at the second,
    and no target crosses from one document into the next (``-100``)."""
    positions = torch.cat([torch.arange(first), torch.arange(len(x) - first)])
    labels = (x if own_labels else y).clone()
    if own_labels:
        labels[first] = -100  # the model shifts: position first - 1 would predict the second document's first token
    else:
        labels[first - 1] = -100
    return {"input_ids": x, "position_ids": positions, "labels": labels}


class PaddedData(ShakespeareDataModule):
    """The Shakespeare windows, padded (:class:`PaddedWindows`)."""

    def __init__(self, side: str, own_labels: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.side, self.own_labels = side, own_labels

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set = PaddedWindows(self.train_set, self.side, self.own_labels)  # type: ignore[assignment]


class PaddedReferenceData(PaddedData, ReferenceData):
    """The padded windows in the single-process order (:class:`tests.gpt_runs.ReferenceData`'s sampler)."""


class PaddedLM(CausalLMModule):
    """Padded fine-tuning as a user writes it: the mask to the model, ``-100`` labels to the example's loss (a
    token-mean cross entropy with ``ignore_index=-100``, the module's ``pipeline_loss``)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        given = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
        if "position_ids" in batch:  # packed rows: transformers masks the documents apart without a KV cache
            given["use_cache"] = False
        outputs = self.model(batch["input_ids"], **given)
        return self.loss_fn(outputs, batch["labels"])


class OwnLossLM(CausalLMModule):
    """Hugging Face's own way: ``labels=`` to the model, whose ``loss_function`` shifts them and returns the token
    mean; no ``pipeline_loss`` declared."""

    pipeline_loss = None  # type: ignore[assignment]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        assert self.model is not None
        output = self.model(**batch)
        self.log("val_loss", output.loss, sync_dist=True)
        if getattr(output, "aux_loss", None) is not None:  # (a mixture of experts adding its router's loss)
            self.log("val_aux", output.aux_loss, sync_dist=True)
        return output.loss


# ---------------------------------------------------------------- Lightning runs


def validate_own_loss(model: dict[str, Any], strategy: dict[str, Any] | None = None, devices: int = 1,
                      side: str = "right") -> dict[str, float]:  # fmt: skip
    """:class:`OwnLossLM`'s ``val_loss`` (and ``val_aux``, a router's loss) over the first two global batches of the
    padded training windows, forward only; one process without ``strategy``."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    lm = OwnLossLM(**{**TINY, **model})
    par3d = Par3DStrategy(**{"timeout_s": 120, **strategy}) if strategy is not None else None
    windows = Subset(_padded_set(side, own_labels=True), range(2 * GLOBAL_BATCH))
    kwargs = trainer_kwargs(limit_val_batches=None)
    trainer = L.Trainer(devices=devices, **({"strategy": par3d} if par3d is not None else {}), **kwargs)
    dp = par3d.layout.dp if par3d is not None else 1  # (the layout is known once the Trainer gave the world size)
    results = trainer.validate(lm, DataLoader(windows, batch_size=GLOBAL_BATCH // dp), verbose=False)
    return {k: float(v) for k, v in results[0].items()}


def run_reference(
    side: str,
    module: type[CausalLMModule] = PaddedLM,
    accumulate: int = 1,
    max_steps: int = 4,
    model: dict[str, Any] | None = None,
    **trainer: Any,
) -> dict[str, Any]:
    """One process, Lightning's default strategy, the token mean of each step's whole global batch: one batch of
    ``GLOBAL_BATCH × accumulate`` samples a step (what the par3d run reads over its window). ``losses``: per step.
    ``model``: the module's arguments other than :data:`~tests.hf_runs.TINY`'s."""
    L.seed_everything(SEED, verbose=False)
    recorder = LossRecorder()
    kwargs = trainer_kwargs(max_steps=max_steps, **trainer)
    lm = module(**{**TINY, **(model or {})})
    data = PaddedReferenceData(side, own_labels=module is OwnLossLM, batch_size=GLOBAL_BATCH * accumulate, **DATA)
    L.Trainer(devices=1, callbacks=[recorder], **kwargs).fit(lm, data)
    return {"losses": recorder.losses, "params": full_state(lm)}


def run_par3d(
    strategy: dict[str, Any],
    devices: int,
    side: str,
    module: type[CausalLMModule] = PaddedLM,
    accumulate: int = 1,
    max_steps: int = 4,
    model: dict[str, Any] | None = None,
    **trainer: Any,
) -> dict[str, Any]:
    """One par3d run inside a pool worker, ``GLOBAL_BATCH`` samples a batch over the data-parallel ranks and
    ``accumulate`` batches a step. ``losses``: per step, the sum over the window's batches of the batch loss
    averaged over the data-parallel ranks (Lightning divided each by the accumulation)."""
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    par3d = Par3DStrategy(**{"timeout_s": 120, **strategy})
    recorder = LossRecorder()
    kwargs = trainer_kwargs(max_steps=max_steps, accumulate_grad_batches=accumulate, **trainer)
    trainer_ = L.Trainer(devices=devices, strategy=par3d, callbacks=[recorder], **kwargs)
    lm = module(**{**TINY, **(model or {})})
    data = PaddedData(side, own_labels=module is OwnLossLM, batch_size=GLOBAL_BATCH // par3d.layout.dp, **DATA)
    trainer_.fit(lm, data)
    steps = torch.tensor(recorder.losses).reshape(-1, accumulate).sum(1)
    return {"losses": steps.tolist(), "params": full_state(lm)}


# ---------------------------------------------------------------- Fabric and Accelerate loops


def _order() -> torch.Tensor:
    """The samples' order of every loop below: one seeded permutation of the training windows."""
    data = ShakespeareDataModule(**DATA)
    data.setup()
    return torch.randperm(len(data.train_set), generator=torch.Generator().manual_seed(SEED))


def _padded_set(side: str, own_labels: bool) -> PaddedWindows:
    data = ShakespeareDataModule(**DATA)
    data.setup()
    return PaddedWindows(data.train_set, side, own_labels)  # type: ignore[arg-type]


def _rank_samples(dp: int, dp_rank: int) -> list[int]:
    """Data-parallel rank ``dp_rank``'s samples, in order: its ``GLOBAL_BATCH / dp`` of each global batch."""
    order, per_rank = _order().tolist(), GLOBAL_BATCH // dp
    return [i for start in range(0, len(order), GLOBAL_BATCH) for i in order[start + dp_rank * per_rank :][:per_rank]]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=TINY["lr"], weight_decay=0.1, betas=(0.9, 0.95), eps=TINY["eps"])


def _hf_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(CausalLMModule(**TINY).model_config())


def epochs(loader: Any, batches: int) -> Any:
    """The first ``batches`` batches of ``loader`` read epoch after epoch (the same order each epoch)."""
    return itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), batches)


def loss_of(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The token mean over the labels that are not ``-100`` (``PaddedLM``'s loss, for a loop)."""
    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def loop_reference(
    side: str, own_loss: bool = False, accumulate: int = 2, steps: int = 4, clip: float | None = None
) -> dict[str, Any]:
    """One process, plain torch: each step the token mean of its whole global batch (``GLOBAL_BATCH × accumulate``
    samples in the loops' order)."""
    torch.manual_seed(SEED)
    model = _hf_model()
    optimizer = _optimizer(model)
    loader = DataLoader(Subset(_padded_set(side, own_loss), _order().tolist()), GLOBAL_BATCH * accumulate)
    losses = []
    for batch in epochs(loader, steps):
        if own_loss:
            loss = model(**batch).loss
        else:
            loss = loss_of(model(batch["input_ids"], attention_mask=batch["attention_mask"]), batch["labels"])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_state(model)}


def fabric_loop(
    strategy: dict[str, Any], side: str, accumulate: int = 2, steps: int = 4, clip: float | None = None
) -> dict[str, Any]:
    """The Fabric loop at any layout: ``fabric.strategy.accumulate_grad_batches``, the loader through
    ``setup_dataloaders``, ``train_step`` with a token-mean loss, clipping on the window's last batch."""
    from lightning_par3d import Par3DFabricStrategy

    fabric = L.Fabric(
        accelerator="cpu", devices=4, strategy=Par3DFabricStrategy(tp_plan="auto", timeout_s=120, **strategy)
    )
    fabric.launch()
    fabric.strategy.accumulate_grad_batches = accumulate
    torch.manual_seed(SEED)
    with fabric.init_module():
        model = _hf_model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(_optimizer(model))
    engine = fabric.strategy.engine
    samples = Subset(_padded_set(side, False), _rank_samples(engine.dp_size, engine.dp_rank))
    loader = DataLoader(samples, GLOBAL_BATCH // engine.dp_size)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    losses, window = [], 0.0
    for i, batch in enumerate(epochs(loader, steps * accumulate)):
        last = (i + 1) % accumulate == 0
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with fabric.no_backward_sync(model, enabled=not last):
            loss = fabric.strategy.train_step(model, inputs, batch["labels"], loss_of)
        window += fabric.all_reduce(loss.detach(), reduce_op="mean").item() / accumulate
        if last:
            if clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(window)
            window = 0.0
    params = full_state(model)  # under pp the model is the pipeline host of the model, its "trunk"
    return {"losses": losses, "params": params and {k.removeprefix("trunk."): v for k, v in params.items()}}


def accelerate_loop(
    strategy: dict[str, Any], side: str, accumulate: int = 2, steps: int = 4, clip: float | None = None
) -> dict[str, Any]:
    """Hugging Face's own Accelerate loop, unchanged: ``labels=`` to the model, ``accelerator.backward(outputs.loss)``
    inside ``accumulate()``, clipping where Accelerate syncs."""
    from accelerate.state import AcceleratorState, GradientState

    from lightning_par3d import Par3DConfig
    from lightning_par3d.accelerate import Par3DAccelerator

    AcceleratorState._reset_state(True)  # one Accelerator per job in these long-lived workers
    GradientState._reset_state()
    accelerator = Par3DAccelerator(
        par3d=Par3DConfig(tp_plan="auto", timeout_s=120, **strategy), gradient_accumulation_steps=accumulate
    )
    torch.manual_seed(SEED)
    with accelerator.init_empty_weights():
        model = _hf_model()
    optimizer = _optimizer(model)
    samples = Subset(_padded_set(side, True), _order().tolist())
    loader = DataLoader(samples, GLOBAL_BATCH // accelerator.dp_size)  # Accelerate hands every dp-th batch out
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, window = [], 0.0
    for i, batch in enumerate(epochs(loader, steps * accumulate)):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        window += accelerator.reduce(loss.detach(), "mean").item() / accumulate
        if (i + 1) % accumulate == 0:
            losses.append(window)
            window = 0.0
    return {"losses": losses, "params": full_state(accelerator.unwrap_model(model))}
