"""``peft`` LoRA adapters in and out as peft has them.

A ``get_peft_model`` model inside the LightningModule names its parameters ``<peft>.base_model.model.<name>``: the
frozen base layer of an adapted ``nn.Linear`` is ``<layer>.base_layer.weight``, its adapters
``<layer>.lora_A.<adapter>.weight`` and ``<layer>.lora_B.<adapter>.weight``. On disk:

* the **base** is a transformers ``save_pretrained`` directory, keyed by the plain model's names
  (``<layer>.weight``): :func:`base_key` drops ``.base_layer``;
* the **adapters** are peft's ``save_pretrained`` directory (``adapter_model.safetensors`` and
  ``adapter_config.json``), keyed ``base_model.model.<layer>.lora_A.weight``: :func:`adapter_keys` drops the
  adapter's name, as peft's ``get_peft_model_state_dict`` does.

**Out** (:func:`save_adapters`): from the whole state gathered on rank 0, a fresh peft model of the same configs is
built on the meta device around a meta base, given the trained adapters, and written by peft's own
``save_pretrained``: ``PeftModel.from_pretrained(base, directory)`` loads it in one plain process.

**In**: :func:`lightning_par3d.checkpoint.pretrained.load_pretrained` reads the base from the pretrained directory
and the adapters from ``adapter_path``, each rank only its slices; without ``adapter_path`` the adapters start fresh
(:func:`init_fresh_adapters`).
"""

from __future__ import annotations

import copy
import math
import zlib
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.parallel.lora_plan import is_lora_layer
from lightning_par3d.utils.patterns import find_peft_model


def adapter_keys(module: nn.Module) -> dict[str, str]:
    """{name in ``module``: key in peft's ``adapter_model.safetensors``} for every adapter parameter this rank
    holds (under pp, its stages' only); empty for a module without a peft model."""
    found = find_peft_model(module)
    if found is None:
        return {}
    prefix, peft_model = found[0], cast(Any, found[1])
    head = f"{prefix}." if prefix else ""
    keys = {}
    for layer_name, layer in peft_model.named_modules():
        if not is_lora_layer(layer):
            continue
        for name, _ in layer.named_parameters():
            if name.startswith("base_layer."):
                continue
            kind, _adapter, *rest = name.split(".")
            keys[f"{head}{layer_name}.{name}"] = ".".join([layer_name, kind, *rest])  # the adapter's name dropped
    return keys


def adapters_of(module: nn.Module) -> list[str]:
    """The names of the adapters of the peft model in ``module`` (none without one)."""
    found = find_peft_model(module)
    return list(cast(Any, found[1]).peft_config) if found is not None else []


def base_key(name: str) -> str:
    """The plain transformers model's name of a parameter of a peft-wrapped model (``.base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def save_adapters(module: nn.Module, full_state: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """Writes the peft model inside ``module`` with peft's own ``save_pretrained``, from its whole, unsharded state
    (``full_state``, keyed as in ``module``); call it on one rank. Returns the directory."""
    found = find_peft_model(module)
    assert found is not None, "save_adapters needs a module holding a peft model"
    prefix, peft_model = found[0], cast(Any, found[1])
    head = f"{prefix}." if prefix else ""
    fresh = _meta_copy(peft_model)  # whole, where this rank's module may hold its pipeline stages only
    wanted = adapter_keys(fresh)
    missing = [name for name in wanted if head + name not in full_state]
    if missing:
        raise ValueError(f"The gathered state lacks {len(missing)} adapters of the model (e.g. {missing[:3]}).")
    fresh.load_state_dict({name: full_state[head + name] for name in wanted}, strict=False, assign=True)
    directory = Path(directory)
    fresh.save_pretrained(str(directory), selected_adapters=list(peft_model.peft_config), safe_serialization=True)
    return directory


def _meta_copy(peft_model: Any) -> Any:
    """A peft model of the same adapter configs around a fresh base of the same config, on the meta device."""
    from peft import get_peft_model

    base = peft_model.get_base_model()
    configs = {name: copy.deepcopy(config) for name, config in peft_model.peft_config.items()}
    with torch.device("meta"):
        fresh_base = type(base)._from_config(base.config)
        first, *others = configs
        fresh = get_peft_model(fresh_base, configs[first], adapter_name=first)
        for name in others:
            fresh.add_adapter(name, configs[name])
    return fresh


def init_fresh_adapters(module: nn.Module) -> None:
    """Gives this rank's shards of every adapter its starting values as peft draws them (``init_lora_weights``
    ``True``: ``lora_A`` Kaiming-uniform as ``nn.Linear``, ``"gaussian"``: normal with std ``1/r``; ``lora_B``
    zeros, so that the adapted model starts as its base). Each adapter is drawn whole from its own generator,
    seeded by rank 0's seed and the parameter's name: the same values on every rank and at every layout, with no
    collective beyond one seed broadcast (they are not the draws of a single process's ``get_peft_model``, which
    depend on everything drawn before: ``init="rank0"`` gives those)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    found = find_peft_model(module)
    if found is None:
        return
    seed = [torch.initial_seed()]
    if dist.is_initialized():
        dist.broadcast_object_list(seed, src=0)
    prefix, peft_model = found[0], cast(Any, found[1])
    head = f"{prefix}." if prefix else ""
    params = dict(module.named_parameters())
    for name in adapter_keys(module):
        kind, adapter = _split(name[len(head) :])
        config = peft_model.peft_config[adapter]
        param = params[name]
        whole = _drawn(kind, name, tuple(param.shape), config, seed[0])
        with torch.no_grad():
            if isinstance(param, DTensor):
                local = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(whole)


def _split(name: str) -> tuple[str, str]:
    """``<layer>.lora_A.<adapter>.weight`` → (``lora_A``, adapter)."""
    atoms = name.split(".")
    at = max(i for i, atom in enumerate(atoms) if atom.startswith("lora_"))
    return atoms[at], atoms[at + 1]


def _drawn(kind: str, name: str, shape: tuple[int, ...], config: Any, seed: int) -> torch.Tensor:
    init = getattr(config, "init_lora_weights", True)
    if kind == "lora_B" or name.endswith(".bias"):
        return torch.zeros(shape)
    if kind != "lora_A" or init not in (True, "gaussian"):
        raise ValueError(
            f"{name}: par3d starts fresh adapters on a pretrained base with peft's default (init_lora_weights=True) "
            f"or 'gaussian' LoRA initialization; this adapter has {kind} with init_lora_weights={init!r}. Start from "
            "saved adapters (adapter_path=...), or build the model on rank 0 (init='rank0'), where peft draws them."
        )
    generator = torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
    whole = torch.empty(shape)
    if init is True:  # nn.Linear's: Kaiming-uniform with a = √5, i.e. U(-1/√fan_in, 1/√fan_in)
        bound = 1 / math.sqrt(shape[1]) if len(shape) > 1 and shape[1] else 0.0
        return whole.uniform_(-bound, bound, generator=generator)
    return whole.normal_(0.0, 1 / shape[0], generator=generator)  # std 1/r
