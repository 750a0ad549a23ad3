"""``layout="auto"``: the layout chosen at launch, on the job's own ranks, by the planner.

:func:`choose_at_launch` runs on every rank once the default process group exists and before any mesh:

1. the machine: every rank measures the job's devices and links at once (:func:`~lightning_par3d.planning.
   calibrate.calibrate_job`), or ``plan_machine`` names a profile;
2. rank 0 plans (:func:`~lightning_par3d.planning.plan`) in a fresh interpreter of its own: the planner simulates
   every rank over torch's fake process group, which cannot live beside the job's real one in this process;
3. rank 0 prints the top of the table and why it chose, and sends the choice (or the planner's error) to every
   rank, which raises the same error or trains with the same layout.

What is searched and what stays: the sizes and settings of :data:`~lightning_par3d.planning.candidates.FIXED_KEYS`
that the user set away from their defaults are pinned; the rest of the configuration (the plan, split points,
``init``, timeouts) is the user's, unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.config import Par3DConfig, changed_settings
from lightning_par3d.planning.machine import Machine, format_bytes, machine_profile, parse_bytes

SHOWN = 5
"""Fitting layouts printed at launch (the whole table is ``lightning_par3d.plan``'s)."""


def fixed_settings(config: Par3DConfig) -> dict[str, Any]:
    """The sizes and settings the user pinned: those the planner may search that differ from their defaults."""
    from lightning_par3d.planning.candidates import FIXED_KEYS

    settings = {name: getattr(config, name) for name in FIXED_KEYS}
    return {name: settings[name] for name in changed_settings(settings)}


def check_before_launch(config: Par3DConfig, world_size: int) -> None:
    """The checks of a ``layout="auto"`` configuration that need no process: the pinned sizes against the world
    size, the profile's name, the memory's form. Raises ``ValueError`` naming the value and the fix."""
    from lightning_par3d.planning.candidates import check_fixed

    check_fixed(fixed_settings(config), world_size)
    if config.plan_machine is not None:
        machine_profile(config.plan_machine)
    if config.plan_device_memory is not None:
        parse_bytes(config.plan_device_memory)


def batch_shape(config: Par3DConfig, loader: Any, where: str) -> tuple[int, int]:
    """``(samples per data-parallel rank, tokens per sample)`` of a training batch: ``config.plan_batch`` if given,
    else a ``DataLoader``'s ``batch_size`` and the last dimension of its dataset's first sample (its first tensor,
    in a tuple, list or dict). ``where`` names the loader's source in the error raised when neither tells."""
    if config.plan_batch is not None:
        rank_batch, seq_len = config.plan_batch
        return int(rank_batch), int(seq_len)
    size: Any = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    sample = _first_tensor(dataset[0]) if size and dataset is not None and hasattr(dataset, "__getitem__") else None
    if sample is None or sample.dim() == 0 or not isinstance(size, int):
        raise ValueError(
            f"layout='auto' needs the shape of a training batch to plan, and {where} does not tell it (a DataLoader "
            f"with a batch_size over a dataset whose samples hold a tensor; got {type(loader).__name__}). Give it: "
            "plan_batch=[samples per data-parallel rank, sequence length]."
        )
    return int(size), int(sample.shape[-1])


def _first_tensor(sample: Any) -> torch.Tensor | None:
    if isinstance(sample, torch.Tensor):
        return sample
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    return next((found for v in values if (found := _first_tensor(v)) is not None), None)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: what the planner builds from,
    without a second copy of real weights (the module may hold them, on rank 0)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def surrogate_loss(outputs: Any, *targets: Any) -> torch.Tensor:
    """What the planner runs a plain model's backward from, when it has no loss function of its own (Fabric and
    Accelerate take one per step): cross-entropy of the outputs' logits against integer targets of their shape
    (a language model's loss, whose log-softmax the memory estimate must count), else the outputs' mean."""
    logits = getattr(outputs, "logits", outputs)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    target = targets[0] if targets else None
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.shape == logits.shape[:-1]:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten().to(logits.device))
    return logits.float().mean()


def device_memory(device: torch.device, local_ranks: int) -> int:
    """A device's memory: a GPU's total, or on CPUs the machine's memory shared by its ``local_ranks``."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical // max(local_ranks, 1))


def choose_at_launch(
    config: Par3DConfig,
    module: nn.Module | None,
    *,
    world_size: int,
    devices_per_node: int,
    rank_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    measure: Callable[[], Machine],
) -> Par3DConfig:
    """The configuration to train with: ``config`` with the layout the planner found fastest (see the module
    docstring). Every rank calls it; ``module`` (the LightningModule before ``configure_model``, or a factory) is
    needed on rank 0 only; ``measure()`` measures the job's machine on every rank at once. Raises the planner's
    ``ValueError`` on every rank where no layout can run."""
    machine = config.plan_machine if config.plan_machine is not None else measure()
    memory = config.plan_device_memory or device_memory(device, devices_per_node)
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        answer[0] = _plan_on_rank_zero(
            config, module, world_size, devices_per_node, memory, rank_batch, seq_len, precision, machine
        )
    dist.broadcast_object_list(answer, src=0, device=device if device.type == "cuda" else None)
    outcome, value = answer[0]
    if outcome == "error":
        raise ValueError(value)
    return dataclasses.replace(config, layout=None, plan_machine=None, plan_device_memory=None, plan_batch=None,
                               dp=None, **value)  # fmt: skip


def _plan_on_rank_zero(
    config: Par3DConfig,
    module: Any,
    world_size: int,
    devices_per_node: int,
    memory: int | str,
    rank_batch: int,
    seq_len: int,
    precision: str,
    machine: Machine | str,
) -> tuple[str, Any]:
    """``("ok", the chosen sizes and settings)`` or ``("error", the message)``, after printing the choice."""
    from lightning_par3d.planning.planner import plan
    from lightning_par3d.utils.fresh_interpreter import call

    if module is None:
        return "error", "layout='auto': rank 0 has no copy of the model to plan with (an integration error)."
    base = dataclasses.replace(config, layout=None, plan_machine=None, plan_device_memory=None, plan_batch=None)
    loss_fn = None if callable(getattr(module, "training_step", None)) else surrogate_loss
    try:
        table = call(
            plan, module, world_size, devices_per_node, memory, rank_batch=rank_batch, seq_len=seq_len,
            precision=precision, machine=machine, fixed=fixed_settings(config), base=base, loss_fn=loss_fn,
            what="the layout plan (layout='auto')", timeout_s=max(60.0, config.timeout_s - 30),
        )  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as error:
        return "error", f"layout='auto' found no layout to train with: {error}"
    print(describe_choice(table), flush=True)
    return "ok", table.best.strategy_arguments()


def describe_choice(table: Any) -> str:
    """What rank 0 prints: the choice and why, and the top of the table."""
    best = table.best
    fitting = table.fitting
    reason = f"the fastest predicted per sample of the {len(fitting)} layouts that fit"
    if len(fitting) > 1:
        second = fitting[1]
        per_sample = [row.time.total / (row.samples or 1) for row in (best, second)]
        reason += f"; the next, {second.describe()}, is {per_sample[1] / per_sample[0] - 1:+.0%} per sample"
    assert best.time is not None and best.memory is not None
    head = (
        f"par3d layout='auto': chose {best.describe()} on {table.world_size} ranks: {reason}. Predicted step "
        f"{best.time.total * 1e3:,.1f} ms ({best.samples_per_s:,.1f} samples/s), {format_bytes(best.memory.peak)} "
        f"per rank of {format_bytes(table.device_memory)}."
    )
    rows = table.to_markdown(top=SHOWN).split("\n\nRejected layouts")[0]
    pinned = "Par3DStrategy(" + ", ".join(f"{k}={v!r}" for k, v in best.strategy_arguments().items()) + ")"
    return f"{head}\n{rows}\nTo pin this layout: {pinned}"
