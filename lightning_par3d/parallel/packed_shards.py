"""DTensors whose local shard is not one contiguous block of the whole tensor, and the honest copies DCP needs.

A packed projection (``packed_colwise``: ``gate_up_proj`` = [gate; up]) keeps, on tensor-parallel rank ``r``, its
part of every component, [gate_r; up_r]: torch's ``_StridedShard`` placement on the ``tp`` mesh dimension.
``full_tensor()``, ``redistribute`` and ``distribute_tensor`` understand it, but torch's checkpoint code describes
each rank's shard by one offset and one size (a contiguous block), and so does the rank-0 broadcast of
``set_model_state_dict(broadcast_from_rank0=True)``: both would read and write the wrong rows.

So every path that moves such a tensor through DCP goes through :func:`contiguous_copies`, which swaps each one in a
state dict for a copy redistributed to plain ``Shard`` placements (contiguous blocks, which DCP describes
correctly, so a checkpoint is the same at every layout), and :func:`copy_back`, which redistributes what was loaded
into the original parameters. The rank-0 broadcast of the initial weights sends them whole and cuts them with
``distribute_tensor`` (:func:`scatter_from_rank0`). FSDP2's own ``_StridedShard`` on the data-parallel dimension (FSDP
over a tensor-parallel ``Shard(0)``) is contiguous and left alone.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from lightning_par3d.utils.torch_private import strided_shard


def is_packed_shard(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor with a ``_StridedShard`` placement on its ``tp`` mesh dimension."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return any(
        isinstance(placement, strided_shard()) and name == "tp"
        for placement, name in zip(tensor.placements, names, strict=False)
    )


def _contiguous(tensor: Any) -> Any:
    from torch.distributed.tensor import Shard

    strided = strided_shard()
    plain = [Shard(p.dim) if isinstance(p, strided) else p for p in tensor.placements]
    with torch.no_grad():
        return tensor.detach().redistribute(tensor.device_mesh, plain)


Swapped = list[tuple[MutableMapping[str, Any], str, Any]]
"""(the dict, the key, the original tensor) of each swapped entry."""


def contiguous_copies(state: MutableMapping[str, Any]) -> Swapped:
    """Replaces, in place and in nested dicts too, each interleaved DTensor of ``state`` by a contiguous copy
    (a collective of its mesh: every rank must call it with the same keys). Returns what :func:`copy_back` needs."""
    swapped: Swapped = []
    for key, value in list(state.items()):
        if isinstance(value, MutableMapping):
            swapped += contiguous_copies(value)
        elif is_packed_shard(value):
            state[key] = _contiguous(value)
            swapped.append((state, key, value))
    return swapped


def copy_back(swapped: Swapped) -> None:
    """Redistributes each loaded contiguous copy into its original tensor's placements, copies it into the original
    tensor, and puts the original back into its dict."""
    for container, key, original in swapped:
        loaded = container[key]
        with torch.no_grad():
            original.to_local().copy_(loaded.redistribute(original.device_mesh, original.placements).to_local())
        container[key] = original


def put_back(swapped: Swapped) -> None:
    """Puts the original tensors back without copying (after saving)."""
    for container, key, original in swapped:
        container[key] = original


def scatter_from_rank0(interleaved: dict[str, Any], full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fills each interleaved DTensor of ``interleaved`` (name → parameter) with its shards of rank 0's ``full``
    state dict (which matters on rank 0 only). A collective of the whole world: every rank calls it, with the
    interleaved parameters it holds, which differ between pipeline stages. ``device``: where the broadcast runs
    (the accelerator under NCCL; the parameters may be offloaded to the CPU).

    The names every rank holds are gathered; rank 0 broadcasts each tensor in turn, and each rank that holds it cuts
    its own shards with ``distribute_tensor`` (no further communication: it knows the strided layout). A stage's
    mesh need not contain rank 0, so a scatter over the parameter's own mesh from its first rank would send what
    that rank never read. One tensor at a time is whole on each rank (a layer's experts, for a mixture of experts)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    here = {name: (tuple(param.shape), param.dtype) for name, param in interleaved.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, here)
    wanted = {name: meta for held in everyone for name, meta in held.items()}
    for name in sorted(wanted):
        shape, dtype = wanted[name]
        if dist.get_rank() == 0:
            whole = full[name].to(device=device, dtype=dtype).contiguous()
        else:
            whole = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(whole, src=0)
        param = interleaved.get(name)
        if param is not None:
            with torch.no_grad():
                shards = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shards.to_local())  # (to the CPU, where offloaded)


def fsdp_shard_placement(param: Any) -> Any:
    """FSDP2's ``shard_placement_fn``: ``Shard(0)`` (None: FSDP2's default) for every parameter but interleaved ones,
    which FSDP2 shards on another dim, so that the two placements stay independent and every layout path above
    describes them truly. (FSDP2 would split the interleaved dim again and describe the result as a
    ``_StridedShard`` that does not match what it holds.) A one-dimensional interleaved parameter (a packed
    projection's bias) has no other dim and is refused."""
    from torch.distributed.tensor import Shard

    if not is_packed_shard(param):
        return None
    strided = strided_shard()
    dims = {p.dim for p in param.placements if isinstance(p, strided)}
    free = [d for d in range(param.ndim) if d not in dims]
    if not free:
        raise ValueError(
            f"A packed projection's parameter of shape {tuple(param.shape)} (a bias) cannot also be sharded by FSDP2 "
            "(dp_shard > 1): it has no second dim. Use 'colwise_gather_output' for that module, or zero_stage 1/2."
        )
    return Shard(free[-1])
