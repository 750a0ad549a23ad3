"""A mixture-of-experts checkpoint that stores each expert apart, read into the model's fused expert shards.

transformers keeps a layer's experts fused, one 3-D tensor per weight (``experts.gate_up_proj``: ``(E, 2I, H)``,
the experts stacked and each one's gate and up rows concatenated; ``experts.down_proj``: ``(E, H, I)``), while its
``save_pretrained`` writes, and the Hub holds, each expert apart (``experts.0.gate_proj.weight`` …, or Mixtral's
``block_sparse_moe.experts.0.w1.weight``). Its ``from_pretrained`` fuses them by the model's conversion mapping
(``transformers.conversion_mapping``): ``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` puts
the components side by side, and renamings map the file's module names to the model's.

:func:`per_expert_sources` reads that same mapping, and :func:`read_fused` fills each rank's shard of a fused
tensor from the files: the shard is made one block of the whole tensor (a packed ``gate_up_proj``'s interleaved
shard through its contiguous copy, :mod:`~lightning_par3d.parallel.packed_shards`), and each expert's file tensor is
read only where it falls in that block, with safetensors' slices (only those bytes are read). A converter of
another form (any other operation, or more than one wildcard) is not read here and stays an error naming it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_par3d.parallel.packed_shards import contiguous_copies, copy_back

INDEX = "model.safetensors.index.json"
"""A sharded safetensors checkpoint's index: ``weight_map`` from each key to its file."""


@dataclass(frozen=True)
class PerExpert:
    """Where a fused expert tensor's parts are in the files: per component (concatenated along dim 1), the file key
    of each expert, ``*`` standing for its index."""

    components: tuple[str, ...]

    def key(self, component: int, expert: int) -> str:
        return self.components[component].replace("*", str(expert))


def per_expert_sources(hf_model: Any, missing: list[str], saved: set[str]) -> dict[str, PerExpert]:
    """For the model-relative keys in ``missing`` that the model's conversion mapping fuses from per-expert keys
    present in ``saved`` (every expert, every component), where those are."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers fuses nothing
        return {}
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if type(t).__name__ == "WeightRenaming"]
    found: dict[str, PerExpert] = {}
    for transform in transforms:
        if type(transform).__name__ != "WeightConverter" or not _stacks_experts(transform):
            continue
        target = transform.target_patterns[0].lstrip(".")
        for key in missing:
            if key not in found and (key == target or key.endswith("." + target)):
                prefix = key[: len(key) - len(target)]
                sources = _in_files(prefix, transform.source_patterns, renamings, saved, _experts(hf_model, key))
                if sources is not None:
                    found[key] = sources
    return found


def renamed_in_files(hf_model: Any, missing: list[str], saved: set[str]) -> dict[str, str]:
    """For the model-relative keys in ``missing`` that a renaming of the model's conversion mapping takes from
    another name in ``saved`` (Mixtral's ``block_sparse_moe.gate.weight`` for the model's ``mlp.gate.weight``):
    model key → file key."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return {}
    renamings = [t for t in get_model_conversion_mapping(hf_model) if type(t).__name__ == "WeightRenaming"]
    found = {}
    for key in missing:
        for spelled in _spellings(key, renamings)[1:]:
            if spelled in saved:
                found[key] = spelled
                break
    return found


def _spellings(name: str, renamings: list[Any]) -> list[str]:
    """``name`` as it is, then with each plain renaming taken back once (the file's module name for the model's)."""
    found = [name]
    for renaming in renamings:
        for source, target in zip(renaming.source_patterns, renaming.target_patterns, strict=False):
            if _plain(source) and _plain(target) and target in f".{name}":
                found.append(f".{name}".replace(target, source, 1)[1:])
    return found


def _stacks_experts(converter: Any) -> bool:
    """Whether ``converter`` stacks one wildcard's experts and concatenates its components on dim 1, nothing else."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    patterns = converter.source_patterns
    one_wildcard = all(p.count("*") == 1 for p in patterns) and len(converter.target_patterns) == 1
    return one_wildcard and ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def _experts(hf_model: Any, key: str) -> int:
    return int(hf_model.get_parameter(key).shape[0])


def _in_files(
    prefix: str, patterns: list[str], renamings: list[Any], saved: set[str], experts: int
) -> PerExpert | None:
    """The file keys of ``prefix`` + each source pattern, as they are or with a renaming taken back (the file's
    module name for the model's): the first spelling under which every expert of every component is saved."""
    for spelled in _spellings(prefix, renamings):
        components = tuple(spelled + p.lstrip(".") for p in patterns)
        candidate = PerExpert(components)
        if all(candidate.key(c, e) in saved for c in range(len(components)) for e in range(experts)):
            return candidate
    return None


def _plain(pattern: str) -> bool:
    return not any(ch in pattern for ch in "^$\\()[]?+{}|")


def read_fused(path: str, wanted: dict[str, Any], sources: dict[str, PerExpert]) -> None:
    """Fills ``wanted[key]`` (this rank's shard of each fused tensor, a DTensor or a plain tensor) from the
    per-expert tensors of the safetensors files in ``path``. A collective over each packed tensor's mesh (its
    contiguous copy): every rank holding the tensor calls it with the same keys, in the same order."""
    from safetensors import safe_open

    files = _files(Path(path))
    keys = sorted(sources)
    block = {key: wanted[key] for key in keys}
    swapped = contiguous_copies(block)  # an interleaved (packed) shard as the contiguous block it is redistributed to
    opened: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for key in keys:
            local, offsets = _local_block(block[key])
            if local.dim() != 3:
                raise ValueError(f"{key}: a fused expert tensor of {local.dim()} dimensions; par3d reads 3.")
            parts = sources[key].components
            per = block[key].shape[1] // len(parts)  # each component's rows
            for e in range(offsets[0], offsets[0] + local.shape[0]):
                for c in range(len(parts)):
                    lo, hi = max(offsets[1], c * per), min(offsets[1] + local.shape[1], (c + 1) * per)
                    if lo >= hi:
                        continue
                    name = sources[key].key(c, e)
                    if files[name] not in opened:  # each file opened once, closed when all are read
                        opened[files[name]] = stack.enter_context(safe_open(files[name], framework="pt"))
                    handle = opened[files[name]]
                    part = handle.get_slice(name)[lo - c * per : hi - c * per, offsets[2] : offsets[2] + local.shape[2]]
                    with torch.no_grad():
                        local[e - offsets[0], lo - offsets[1] : hi - offsets[1]].copy_(part)
    copy_back(swapped)


def _local_block(tensor: Any) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rank's block of ``tensor`` (contiguous in the whole tensor) and its offsets there."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    chunks = tensor.__create_chunk_list__()
    offsets = tuple(int(o) for o in chunks[0].offsets) if chunks else (0,) * tensor.dim()
    return tensor.to_local(), offsets


def _files(path: Path) -> dict[str, str]:
    """Each saved key's safetensors file in the directory ``path``."""
    index = path / INDEX
    if index.exists():
        return {key: str(path / name) for key, name in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({key: str(file) for key in handle.keys()})  # noqa: SIM118 (a safe_open handle, not a dict)
    return found
