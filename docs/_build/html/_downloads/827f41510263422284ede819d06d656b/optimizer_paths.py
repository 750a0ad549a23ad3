"""Optimizer implementation paths that a parallelized model's parameters can take.

Under tensor parallelism without FSDP (``tp`` or ``pp × tp`` with ``dp_shard == 1``) a module holds two kinds of
parameters: the sharded weights are DTensors, and those the plan leaves alone (norms, often embeddings) are plain
tensors. torch's multi-tensor optimizer paths group parameters by device and dtype only, so one ``foreach`` or
``fused`` call receives both kinds, and DTensor refuses it ("got mixed torch.Tensor and DTensor") at the first
``optimizer.step()``. ``foreach`` is what torch's Adam, AdamW, SGD and the others choose by default on CUDA, so a
plain ``AdamW(model.parameters())`` fails there.

:func:`use_per_tensor_path_where_mixed` runs such a group on the per-tensor path instead (``foreach=False``), which
computes the same update (the single-process parity tests use that path on CPU), and keeps it so after a
``load_state_dict`` (which restores each group's saved options). ``fused=True`` asks for a kernel that cannot take the
group, so it is refused before training with what to do.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.optim import Optimizer


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def use_per_tensor_path_where_mixed(optimizer: Optimizer, names: Mapping[torch.Tensor, str]) -> list[str]:
    """Sets ``foreach=False`` on each parameter group of ``optimizer`` that mixes DTensor and plain parameters;
    returns a line for each such group where the user asked for ``foreach=True`` (the default, ``None``, lets torch
    choose, and this is the choice that works). Raises ``ValueError`` for a mixed group with ``fused=True``, naming a
    plain parameter and the fixes."""
    asked = []
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        sharded = [p for p in params if _is_dtensor(p)]
        plain = [p for p in params if not _is_dtensor(p)]
        if not sharded or not plain:
            continue
        example = names.get(plain[0], f"a tensor of shape {tuple(plain[0].shape)}")
        if group.get("fused"):
            raise ValueError(
                f"{type(optimizer).__name__}(fused=True): parameter group {index} holds {len(sharded)} tensor-parallel "
                f"(DTensor) parameters and {len(plain)} plain ones (such as {example!r}), and torch's fused kernel "
                "cannot take both in one call. Pass fused=False (par3d then runs the group on the per-tensor path), "
                "put the plain parameters in a group of their own, or shard every parameter (dp_shard > 1)."
            )
        if "foreach" not in group:
            continue
        if group["foreach"]:
            asked.append(
                f"{type(optimizer).__name__}(foreach=True): group {index} holds {len(sharded)} DTensor and "
                f"{len(plain)} plain parameters (such as {example!r}), which torch's foreach path cannot take in one "
                "call; the group runs the per-tensor path"
            )
        group["foreach"] = False
    if not getattr(optimizer, "_par3d_path_hook", False):  # a checkpoint's saved options would undo it on load

        def after_load(loaded: Optimizer) -> None:
            use_per_tensor_path_where_mixed(loaded, names)

        optimizer.register_load_state_dict_post_hook(after_load)
        optimizer._par3d_path_hook = True  # type: ignore[attr-defined]
    return asked
