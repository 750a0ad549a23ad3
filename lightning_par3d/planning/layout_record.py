"""The record of ``layout="auto"``'s measured choices (``par3d_auto_layout.json`` in the run's directory), keyed on
what decides a job's layout, so that a restart of the same job takes its choice without measuring again, and a job
that differs in any of it (another model of the same class, another world or batch) plans again and says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.config import Par3DConfig
from lightning_par3d.planning.at_launch import Candidate, fixed_settings, layout_arguments


def job_record(
    config: Par3DConfig,
    module: nn.Module,
    world_size: int,
    global_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
) -> dict[str, str]:
    """What decides a job's layout, field by field: the model (its class, a digest of its parameters' and buffers'
    names, shapes and dtypes, a digest of its config where it has one: a transformers ``config``, a
    LightningModule's ``hparams``), the world, the global batch, the sequence length, the precision, the devices (a
    GPU's name; a CPU's core count) and the settings the user pinned. A kept choice is reused only where every field
    is the same: a model with another ``n_layer`` or width, same class or not, is planned again."""
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu×{os.cpu_count()}"
    return {
        "model": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": _digest(
            [(name, tuple(t.shape), str(t.dtype)) for name, t in [*module.named_parameters(), *module.named_buffers()]]
        ),
        "config": _digest(_model_config(module)),
        "world": str(world_size),
        "global_batch": str(global_batch),
        "seq_len": str(seq_len),
        "precision": precision,
        "device": kind,
        "pinned": repr(sorted((k, repr(v)) for k, v in fixed_settings(config).items())),
    }


def _model_config(module: nn.Module) -> Any:
    """The model's own description, where it has one: the first transformers ``config`` in it (``to_dict``), and a
    LightningModule's ``hparams``."""
    found: dict[str, Any] = {}
    hparams = getattr(module, "hparams", None)
    if hparams:
        found["hparams"] = dict(hparams)
    for sub in module.modules():
        to_dict = getattr(getattr(sub, "config", None), "to_dict", None)
        if callable(to_dict):
            found["config"] = to_dict()
            break
    return found


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key(record: dict[str, str]) -> str:
    return json.dumps(record, sort_keys=True)


def rank0_reads(path: Path, record: dict[str, str]) -> dict[str, Any] | None:
    """Rank 0's kept choice for the job ``record`` (None: none; then rank 0 says why, where the file keeps choices
    of other jobs), on every rank."""
    found: list[Any] = [None]
    if dist.get_rank() == 0 and path.is_file():
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = {}  # unreadable: measure again, and write it anew
        found[0] = kept.get(_key(record))
        if found[0] is None and kept:
            print(f"par3d layout='auto': {why_not_kept(kept, record, path)}; planning again.", flush=True)
    dist.broadcast_object_list(found, src=0)
    return found[0]


def why_not_kept(kept: dict[str, Any], record: dict[str, str], path: Path) -> str:
    """Why none of the choices ``kept`` in ``path`` serves the job ``record``: what differs from the nearest one."""
    records: list[dict[str, str]] = [
        entry["job"] for entry in kept.values() if isinstance(entry, dict) and isinstance(entry.get("job"), dict)
    ]
    if not records:
        return f"the choices kept in {path} are from an earlier par3d that keyed them on the model's class only"
    nearest = min(records, key=lambda other: sum(other.get(k) != v for k, v in record.items()))
    differ = [k for k, v in record.items() if nearest.get(k) != v]
    shown = ", ".join(
        f"the model's {k}" if k in ("parameters", "config") else f"{k} {nearest.get(k)} → {record[k]}" for k in differ
    )
    return f"the choices kept in {path} are for other jobs: the nearest differs in {shown}"


def keep(path: Path, record: dict[str, str], best: Candidate, measured: list[tuple[str, float, float]]) -> None:
    """Rank 0 adds this job's measured choice, ``best`` (and each candidate's name, predicted and measured step), to
    ``path`` (written whole, then renamed into place)."""
    try:
        kept = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        kept = {}
    kept[_key(record)] = {
        "name": best.name,
        "arguments": layout_arguments(best.config),
        "split": [best.split.rank_batch, best.split.accumulate],
        "measured": [list(row) for row in measured],
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "job": record,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(kept, indent=1))
    partial.replace(path)
