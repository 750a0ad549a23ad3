"""Activation checkpointing of the model's blocks, with torch's own checkpoint API.

=============  ======================================================================================================
``none``       every activation is kept for backward.
``full``       every block keeps only its input; its forward runs again during backward.
``selective``  every ``ac_every``-th block (the 1st, the ``1 + ac_every``-th, …) is checkpointed as in ``full``.
``op``         every block runs under selective activation checkpointing (``create_selective_checkpoint_contexts``):
               the outputs of matrix multiplications, attention and tensor-parallel collectives are saved, every
               other op (norms, activations, adds, dropout) is recomputed. Less recompute than ``full``, and no
               collective runs twice.
=============  ======================================================================================================

Blocks are the modules ``ac_blocks`` names (a class name, or a module-name pattern as in ``fsdp_blocks``), or by
default the members of the model's containers of repeated blocks. A checkpointed block stays the same object under
the same name: its class gains a ``forward`` that calls the original one through
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so state dicts, tensor-parallel plans and FSDP2 units
are unaffected. :func:`~lightning_par3d.compose.parallelize` applies it after tensor parallelism and before
FSDP2, torchtitan's order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par3d.config import AC_MODES
from lightning_par3d.utils.model_changes import set_attribute, swap_class
from lightning_par3d.utils.patterns import find_modules, repeated_members
from lightning_par3d.utils.torch_private import functional_collective_ops

CACHE_OBSERVERS: list[Callable[[list[Any]], None]] = []
"""Called with the outputs that ``op`` mode caches for backward, as they are cached (outside autograd's saved
tensors, so saved-tensor hooks do not see them). Memory meters register here while they measure."""


def _save_list() -> set[Any]:
    """Ops whose outputs ``op`` mode saves: matmuls, attention kernels and the functional collectives."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = functional_collective_ops()
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"):
        if hasattr(c10d, name):
            ops.add(getattr(c10d, name).default)
    return ops


def _op_policy(save: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op not in save:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute and CACHE_OBSERVERS:  # kept until backward in checkpointing's own cache
        output = getattr(ctx, "op_output", None)
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        for observe in CACHE_OBSERVERS:
            observe(outputs)
    return CheckpointPolicy.MUST_SAVE


def _op_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_op_policy, _save_list()))


class _Checkpointed(nn.Module):
    """Mixed into a block's class: its forward runs under non-reentrant activation checkpointing."""

    _par3d_ac_op_level: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        # Two calls rather than a context_fn chosen at run time: torch.compile traces checkpoint's context_fn only
        # when it is a plain function of ours (a compiled block, compile=True), not torch's own noop_context_fn.
        if self._par3d_ac_op_level:
            return checkpoint(super().forward, *args, use_reentrant=False, context_fn=_op_context, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


def find_ac_blocks(module: nn.Module, target: str | None) -> list[nn.Module]:
    """The blocks to checkpoint: modules of class ``target``, else modules whose name matches the pattern
    ``target``, else (``target`` None) the members of every container of repeated blocks."""
    if target is None:
        return [block for sub in module.modules() for block in repeated_members(sub)]
    by_class = [sub for sub in module.modules() if type(sub).__name__ == target]
    return by_class or [sub for _, sub in find_modules(module, target)]


def apply_activation_checkpointing(
    module: nn.Module,
    mode: str,
    target: str | None = None,
    every: int = 2,
    blocks: list[nn.Module] | None = None,
    first_index: int = 0,
) -> int:
    """Checkpoints the blocks of ``module`` in place by ``mode`` (see the module docstring); returns how many blocks
    are checkpointed. Raises ``ValueError`` when ``target`` names no module (and a mode other than ``none`` is set).

    ``blocks`` (with ``target`` None) are the blocks to consider instead of the members of ``module``'s containers
    of repeated blocks: a pipeline stage passes its own, which may be a single block (pp=4 over 4 blocks), that no
    container of two or more would find. ``first_index`` is the position of the first of them among the whole
    model's blocks, so that ``selective`` checkpoints the same blocks at every number of stages."""
    if mode == "none":
        return 0
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not a mode. Allowed: {', '.join(map(repr, AC_MODES))}.")
    found = blocks if blocks is not None and target is None else find_ac_blocks(module, target)
    if not found and target is not None:
        raise ValueError(
            f"ac_blocks={target!r} names no module class and matches no module name of {type(module).__name__}. "
            "Give a block class name ('Block') or a module-name pattern ('transformer.h.*')."
        )
    offset = first_index if blocks is not None and target is None else 0
    chosen = [b for i, b in enumerate(found) if (i + offset) % every == 0] if mode == "selective" else found
    for block in chosen:
        checkpoint_module(block, op_level=mode == "op")
    return len(chosen)


def checkpoint_module(block: nn.Module, op_level: bool = False) -> None:
    """Makes ``block``'s forward run under activation checkpointing (``op_level``: selective, per op), keeping
    the block the same object under the same name."""
    swap_class(block, _Checkpointed, "Checkpointed")
    set_attribute(block, "_par3d_ac_op_level", op_level)
