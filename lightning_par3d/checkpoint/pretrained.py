"""Hugging Face weights in and out: a ``save_pretrained`` directory loaded straight into each rank's shards, and the
trained model written back as one.

**In** (:func:`load_pretrained`, ``Par3DConfig(init="pretrained")``): the model is built with its parameters on the
meta device on every rank, parallelized, and allocated as shards; then torch's DCP ``HuggingFaceStorageReader``
fills each rank's shards from the safetensors files (one file or sharded), reading only the slices the rank holds:
no rank ever holds the whole model. The keys are the transformers model's own state-dict names (where the model
sits inside a LightningModule, its attribute path is added). A tied output embedding, which ``save_pretrained``
stores once, shares the input embedding's parameter and is read through it. The dtype converts on the way (a bf16
checkpoint into fp32 parameters).

**Out** (:func:`save_pretrained`): the whole model's state is gathered on rank 0 (each parameter over its own mesh,
the pipeline stages merged), put into a fresh transformers model of the same config (built on meta, the weights
assigned), and written by transformers' own ``save_pretrained``: safetensors, ``config.json``, generation config,
tied weights once. :func:`convert_checkpoint` does the same offline from a par3d checkpoint directory.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.checkpoint.expert_files import per_expert_sources, read_fused, renamed_in_files
from lightning_par3d.checkpoint.peft_files import (
    adapter_keys,
    adapters_of,
    base_key,
    init_fresh_adapters,
    save_adapters,
)
from lightning_par3d.parallel.packed_shards import contiguous_copies, copy_back
from lightning_par3d.utils.patterns import find_transformers_model


def _transformers_model(module: nn.Module) -> tuple[str, nn.Module]:
    found = find_transformers_model(module)
    if found is None:
        raise ValueError(
            f"{type(module).__name__} holds no Hugging Face transformers model; pretrained loading and "
            "save_pretrained export need one (a PreTrainedModel, e.g. from AutoModelForCausalLM.from_config)."
        )
    return found


def _strip(prefix: str, names: Iterable[str]) -> dict[str, str]:
    """{model-relative name: name in the module} for the names under ``prefix``."""
    head = f"{prefix}." if prefix else ""
    return {name[len(head) :]: name for name in names if name.startswith(head)}


def pretrained_path(module: nn.Module, configured: str | None) -> str:
    """The directory to load: the configured one, else the one the transformers model's config came from."""
    path = configured or getattr(getattr(_transformers_model(module)[1], "config", None), "_name_or_path", "")
    if not path or not Path(path).is_dir():
        raise ValueError(
            f"init='pretrained' needs a local save_pretrained directory: pretrained_path={configured!r}, and the "
            f"transformers model's config names {path!r}. Set pretrained_path to the directory (downloaded "
            "checkpoints: pass their local snapshot directory)."
        )
    return str(path)


def load_pretrained(module: nn.Module, path: str, adapter_path: str | None = None) -> None:
    """Fills ``module``'s (sharded, materialized) parameters from the safetensors files in ``path``; every rank
    reads only its own slices. A collective: every rank must call it. Raises the same ``ValueError`` on every rank
    for weights the directory lacks or holds in another shape.

    A ``peft`` model's base comes from ``path`` (its ``base_layer`` weights under the plain model's names), its
    adapters from ``adapter_path`` (peft's ``save_pretrained`` directory), or fresh
    (:func:`~lightning_par3d.checkpoint.peft_files.init_fresh_adapters`) without one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    prefix, _ = _transformers_model(module)
    state = get_model_state_dict(module)
    adapters = adapter_keys(module)
    names = {base_key(key): name for key, name in _strip(prefix, state).items() if name not in adapters}
    tied = {base_key(key) for key in _tied_names(module, prefix)}
    _read_slices(module, path, state, names, tied)
    if not adapters_of(module):
        return
    if adapter_path is None:
        init_fresh_adapters(module)
        return
    if adapters_of(module) != ["default"]:
        raise ValueError(
            f"adapter_path={adapter_path!r}: par3d reads one adapter named 'default' (peft's own name for the first); "
            f"the model has {adapters_of(module)}."
        )
    _read_slices(module, adapter_path, state, {key: name for name, key in adapters.items()}, set())


def _read_slices(module: nn.Module, path: str, state: dict[str, Any], names: dict[str, str], tied: set[str]) -> None:
    """Reads ``names`` ({file key: name in ``module``}) of ``state`` from the safetensors files in ``path``, each
    rank its own slices, and sets them into ``module``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    wanted = {key: state[name] for key, name in names.items() if key in saved or key not in tied}
    missing = [key for key in wanted if key not in saved]
    hf_model = _transformers_model(module)[1]
    # A mixture of experts saved expert by expert (fused as the model holds them), and module names the model's
    # conversion mapping renames (Mixtral's block_sparse_moe): what from_pretrained reads, read here too.
    experts = per_expert_sources(hf_model, missing, set(saved)) if missing else {}
    renamed = renamed_in_files(hf_model, [key for key in missing if key not in experts], set(saved))
    _agree_on_problems(
        _problems(path, {k: v for k, v in wanted.items() if k not in experts and k not in renamed}, saved)
    )
    direct = {renamed.get(key, key): value for key, value in wanted.items() if key not in experts}
    swapped = contiguous_copies(direct)  # packed projections' interleaved shards, as contiguous blocks
    dcp.load(direct, storage_reader=HuggingFaceStorageReader(path))
    copy_back(swapped)
    if experts:
        read_fused(path, wanted, experts)
    set_model_state_dict(
        module, {names[key]: value for key, value in wanted.items()}, options=StateDictOptions(strict=False)
    )


def _tied_names(module: nn.Module, prefix: str) -> set[str]:
    """Model-relative names of parameters that another name of the same model also holds (the tied copy)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
    return set(_strip(prefix, tied))


def _problems(path: str, wanted: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    missing = [key for key in wanted if key not in saved]
    shapes = [
        f"{key}: file {tuple(saved[key].size)}, model {tuple(value.shape)}"
        for key, value in wanted.items()
        if key in saved and tuple(saved[key].size) != tuple(value.shape)
    ]
    problems = []
    per_expert = [
        key for key in missing if key.endswith(_FUSED_EXPERTS) and f"{key.rsplit('.', 1)[0]}.0." in _prefixes(saved)
    ]
    if per_expert:
        problems.append(
            f"{path} stores each expert apart (e.g. {per_expert[0].rsplit('.', 1)[0]}.0.*.weight), where the model "
            f"holds them fused ({per_expert[0]}), and the model's conversion mapping fuses them otherwise than par3d "
            "reads (experts stacked on dim 0, components side by side on dim 1). Use init='rank0' (rank 0 loads the "
            "model with from_pretrained, which fuses them, and the weights are broadcast), or a directory par3d's "
            "SavePretrained or `par3d export-hf` wrote (fused experts)."
        )
        missing = [key for key in missing if key not in per_expert]
    if missing:
        problems.append(f"{len(missing)} weights of the model are not in {path} (e.g. {', '.join(missing[:4])}).")
    if shapes:
        problems.append(f"{len(shapes)} weights have other shapes in {path} (e.g. {'; '.join(shapes[:3])}).")
    return problems


_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
"""A transformers mixture-of-experts model's fused expert weights (one 3-D tensor per layer)."""


def _prefixes(saved: dict[str, Any]) -> set[str]:
    """Every dotted prefix of the saved keys, with its trailing dot (``a.b.`` of ``a.b.c``)."""
    found: set[str] = set()
    for key in saved:
        parts = key.split(".")
        found.update(".".join(parts[:i]) + "." for i in range(1, len(parts)))
    return found


def _agree_on_problems(problems: list[str]) -> None:
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        problems = list(dict.fromkeys(p for rank in everyone for p in rank))
    if problems:
        raise ValueError("Cannot load the pretrained weights:\n" + "\n".join(f"  - {p}" for p in problems))


def save_pretrained(module: nn.Module, full_state: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """Writes the transformers model inside ``module`` as a ``save_pretrained`` directory, from its whole,
    unsharded state (``full_state``, keyed as in ``module``); call it on one rank. Returns the directory. A ``peft``
    model's adapters are written as peft writes them (:func:`~lightning_par3d.checkpoint.peft_files.save_adapters`),
    its base not (it is the pretrained one)."""
    if adapters_of(module):
        return save_adapters(module, full_state, directory)
    prefix, model = _transformers_model(module)
    return write_pretrained(
        model.config, {key: full_state[name] for key, name in _strip(prefix, full_state).items()}, directory
    )


def write_pretrained(config: Any, weights: dict[str, torch.Tensor], directory: str | Path) -> Path:
    """A fresh transformers causal LM of ``config`` holding ``weights``, written by ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the output embedding takes the input embedding's (now real) parameter again
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise ValueError(
            f"The weights do not fit a {type(model).__name__} of this config: missing {still_meta[:4]}, unexpected "
            f"{list(unexpected)[:4]}."
        )
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def read_checkpoint_model(path: str | Path, key: str = "state_dict") -> dict[str, torch.Tensor]:
    """The whole model of a par3d checkpoint directory (any layout), as full tensors in this process, without a
    process group and without unpickling anything but DCP's metadata classes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_par3d.checkpoint.dcp import resolve_checkpoint
    from lightning_par3d.checkpoint.safe_reading import load_shards, read_metadata

    path = resolve_checkpoint(Path(path))
    head = f"{key}."
    tensors = {
        name[len(head) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in read_metadata(path).state_dict_metadata.items()
        if name.startswith(head) and isinstance(meta, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"{path} has no '{key}' entries: pass the key the model was saved under (Fabric: 'model').")
    with warnings.catch_warnings():  # that it reads in this one process is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_shards({key: tensors}, path, no_dist=True)
    return tensors


def convert_checkpoint(
    checkpoint: str | Path, config_dir: str | Path, out: str | Path, key: str = "state_dict"
) -> Path:
    """A par3d checkpoint directory of a transformers model → a ``save_pretrained`` directory. ``config_dir`` holds
    the model's ``config.json`` (a ``save_pretrained`` or hub snapshot directory); the model's place inside the
    checkpoint (``model.`` in a LightningModule holding it as ``self.model``) is found from the names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    state = read_checkpoint_model(checkpoint, key)
    with torch.device("meta"):
        expected = list(AutoModelForCausalLM.from_config(config).state_dict())
    anchor = expected[-1]
    found = [name for name in state if name == anchor or name.endswith(f".{anchor}")]
    if not found:
        raise ValueError(f"{checkpoint} holds no '{anchor}' of a model of {config_dir}: is it this model's checkpoint?")
    prefix = found[0][: -len(anchor)].rstrip(".")
    return write_pretrained(config, {key_: state[name] for key_, name in _strip(prefix, state).items()}, out)
