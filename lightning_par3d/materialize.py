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

import torch
from torch import nn


@contextmanager
def build_context(init: str, rank: int) -> Iterator[None]:
    """Where ``configure_model`` builds: real CPU tensors on rank 0 with ``init="rank0"``, meta otherwise."""
    device = "cpu" if init == "rank0" and rank == 0 else "meta"
    with torch.device(device):
        yield


@dataclass
class Rank0State:
    """The full, real weights captured on rank 0 (empty on other ranks), including non-persistent buffers that a
    state dict leaves out (causal masks, rotary tables)."""

    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    extra_buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def captured(self) -> bool:
        return bool(self.state_dict) or bool(self.extra_buffers)


def has_real_tensors(module: nn.Module) -> bool:
    return any(not t.is_meta for t in (*module.parameters(), *module.buffers()))


def capture_rank0_state(module: nn.Module, rank: int) -> Rank0State:
    """Copies rank 0's real weights aside and moves ``module`` to meta on every rank."""
    state = Rank0State()
    if rank == 0 and has_real_tensors(module):
        state.state_dict = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        state.extra_buffers = {
            name: buf.detach().cpu().clone() for name, buf in _non_persistent_buffers(module) if not buf.is_meta
        }
    module.to("meta")
    return state


def _non_persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, sub in module.named_modules():
        for name in sub._non_persistent_buffers_set:
            buf = sub._buffers.get(name)
            if buf is not None:
                yield (f"{prefix}.{name}" if prefix else name), buf


def materialize(
    module: nn.Module, device: torch.device, state: Rank0State, source_is_rank0: bool, strict: bool = True
) -> None:
    """Allocates the (sharded) module on ``device`` and fills it.

    ``source_is_rank0``: every rank takes its shards of rank 0's captured weights (a collective: all ranks must call
    it). Otherwise each module's ``reset_parameters()`` initialises the local shards.
    """
    module.to_empty(device=device)
    if source_is_rank0:
        _load_from_rank0(module, state, strict)
    else:
        reset_parameters(module)


def _load_from_rank0(module: nn.Module, state: Rank0State, strict: bool = True) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    # strict=False under pipelining: each rank holds only its stages' entries of rank 0's full state dict.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, dict(state.state_dict), options=options)
    # Non-persistent buffers go as one object: ranks may hold different ones (pipeline stages).
    box: list[object] = [state.extra_buffers if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    extra: dict[str, torch.Tensor] = box[0]  # type: ignore[assignment]
    for name, buf in _non_persistent_buffers(module):
        if name in extra:
            (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(extra[name])


def reset_parameters(module: nn.Module) -> None:
    """Calls ``reset_parameters()`` on every submodule that owns parameters or buffers and defines it."""
    missing = set()
    for sub in module.modules():
        if not any(True for _ in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
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
    import torch.distributed as dist

    states: list[object] = [torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])  # type: ignore[arg-type]
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states[1])  # type: ignore[arg-type]
