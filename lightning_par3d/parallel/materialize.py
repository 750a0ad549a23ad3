"""Building the model without a full copy on every rank, then giving each rank exactly its shards.

With ``init="rank0"`` the LightningModule's ``configure_model`` runs for real on rank 0 (on CPU) and on the meta
device everywhere else. Rank 0 therefore draws from the seeded RNG exactly as a single process would, and its
weights are the single-process weights. :func:`capture_rank0_state` keeps those values and moves the module to
meta; the parallelisms are applied on meta; :func:`materialize` allocates each rank's shards and fills them from
rank 0 through ``torch.distributed.checkpoint``'s ``set_model_state_dict(..., broadcast_from_rank0=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.parallel.packed_shards import is_packed_shard, scatter_from_rank0
from lightning_par3d.parallel.ties import retie, tied_groups
from lightning_par3d.utils.patterns import is_transformers_model


@contextmanager
def build_context(init: str, rank: int) -> Iterator[None]:
    """Where the model is built: for real on the CPU on rank 0 with ``init="rank0"``; elsewhere (and with ``"meta"``
    and ``"pretrained"``) with every parameter on the meta device and buffers real (:func:`parameters_on_meta`)."""
    if init == "rank0" and rank == 0:
        with torch.device("cpu"):
            yield
    else:
        with parameters_on_meta():
            yield


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (no memory, no init compute:
    ``nn.Linear`` initializes its weight after registering it); buffers and every other tensor stay real. Unlike
    ``torch.device("meta")``, rotary tables and causal masks keep their values, and a torchmetrics metric built
    inside keeps real default states, which nothing could restore later."""
    register_parameter = nn.Module.register_parameter

    def parameter_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = param.to("meta")
            param = type(param)(meta, requires_grad=param.requires_grad) if not isinstance(meta, type(param)) else meta
        register_parameter(self, name, param)

    nn.Module.register_parameter = parameter_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]


@dataclass
class BuildState:
    """What the model held before it went to meta: rank 0's full, real weights (empty elsewhere, or when rank 0
    built on meta), and each rank's own real buffers, non-persistent ones included (causal masks, rotary tables),
    which a state dict leaves out."""

    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def captured(self) -> bool:
        """Whether this rank holds real weights to give the others."""
        return bool(self.state_dict)


def capture_rank0_state(module: nn.Module, rank: int) -> BuildState:
    """Copies rank 0's real weights (if it built them) and every rank's real buffers aside, and moves ``module`` to
    meta on every rank."""
    state = BuildState()
    params = list(module.parameters())
    if rank == 0 and params and not any(p.is_meta for p in params):
        state.state_dict = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state.buffers = {name: buf.detach().cpu().clone() for name, buf in _named_buffers(module) if not buf.is_meta}
    ties = tied_groups(module)
    module.to("meta")  # gives each module a parameter of its own: tie them again
    retie(module, ties)
    return state


def _named_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _non_persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, sub in module.named_modules():
        for name in sub._non_persistent_buffers_set:
            buf = sub._buffers.get(name)
            if buf is not None:
                yield (f"{prefix}.{name}" if prefix else name), buf


def materialize(module: nn.Module, device: torch.device, state: BuildState, source: str, strict: bool = True) -> None:
    """Allocates the (sharded) module on ``device`` and fills it from ``source``:

    * ``"rank0"``: every rank takes its shards of rank 0's captured weights and non-persistent buffers (a
      collective: all ranks must call it);
    * ``"reset"``: each module's ``reset_parameters()`` initialises the local shards; buffers are the rank's own;
    * ``"none"``: the rank's own buffers only; the parameters are left for the caller to fill (pretrained weights).
    """
    ties = tied_groups(module)
    module.to_empty(device=device)  # plain (not DTensor) parameters come back untied
    retie(module, ties)
    if source != "rank0":
        _copy_buffers(module, state.buffers)
    if source == "rank0":
        _load_from_rank0(module, state, strict)
    elif source == "reset":
        reset_parameters(module)


def _copy_buffers(module: nn.Module, buffers: dict[str, torch.Tensor], only_non_persistent: bool = False) -> None:
    from torch.distributed.tensor import DTensor

    named = _non_persistent_buffers(module) if only_non_persistent else _named_buffers(module)
    for name, buf in named:
        if name in buffers:
            (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(buffers[name])


def _load_from_rank0(module: nn.Module, state: BuildState, strict: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Interleaved shards (packed projections) are scattered by distribute_tensor, which knows their layout; DCP's
    # broadcast would give each rank a contiguous block (lightning_par3d.parallel.packed_shards).
    interleaved = {name: p for name, p in module.named_parameters() if is_packed_shard(p)}
    full: dict[str, Any] = {k: v for k, v in state.state_dict.items() if k not in interleaved}
    # strict=False under pipelining: each rank holds only its stages' entries of rank 0's full state dict.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict and not interleaved)
    set_model_state_dict(module, full, options=options)
    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    scatter_from_rank0(interleaved, state.state_dict, comm)
    # Non-persistent buffers go as one object: ranks may hold different ones (pipeline stages).
    box: list[object] = [state.buffers if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    _copy_buffers(module, box[0], only_non_persistent=True)  # type: ignore[arg-type]


def reset_parameters(module: nn.Module) -> None:
    """Calls ``reset_parameters()`` on every submodule that owns parameters and defines it; inside a Hugging Face
    transformers model, that model's own ``_init_weights`` on those that do not (its norms). Buffers are the rank's
    own (built real), not reset."""
    missing = set()
    owners: dict[int, Any] = {}
    for sub in module.modules():
        init_weights = getattr(sub, "_init_weights", None)
        if is_transformers_model(sub) and callable(init_weights):
            owners.update({id(inner): init_weights for inner in sub.modules()})
    for sub in module.modules():
        if not any(True for _ in sub.parameters(recurse=False)):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        elif id(sub) in owners:
            owners[id(sub)](sub)
        else:
            missing.add(type(sub).__name__)
    if missing:
        raise TypeError(
            f"init='meta' needs reset_parameters() on every module that owns parameters; missing on: "
            f"{', '.join(sorted(missing))}. Add it, or use init='rank0'."
        )


def sync_rng_from_rank0() -> None:
    """Gives every rank rank 0's RNG state, which only rank 0 advanced while building for real, so that later
    random draws (dropout, data order) agree across ranks and with a single process."""
    states: list[object] = [torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])  # type: ignore[arg-type]
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states[1])  # type: ignore[arg-type]
