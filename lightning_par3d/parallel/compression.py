"""Gradient compression for pure replication, with torch's own DDP communication hooks.

=============  =====================================================================================================
``fp16``       ``default_hooks.fp16_compress_hook``: each gradient bucket is cast to float16 for the all-reduce and
               back; half the bytes on the wire, gradients rounded to 11 significant bits.
``bf16``       ``default_hooks.bf16_compress_hook``: the same with bfloat16 (8 significant bits, fp32's range).
``powersgd``   ``powerSGD_hook.powerSGD_hook``: each gradient matrix is sent as a rank-``r`` product ``P Qᵀ`` with
               error feedback (what the approximation missed is added to the next step's gradient); plain all-reduces
               for the first ``start_iter`` steps; tensors that would not shrink 2× go uncompressed.
=============  =====================================================================================================

Compression changes the numbers: the run no longer matches a single process to rounding (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_par3d.config import Par3DConfig


def check_compression_device(kind: str | None, device_type: str) -> None:
    """Raises ``ValueError`` for a compression torch does not offer on ``device_type``: its bf16 hook needs NCCL
    (CUDA) or XCCL (XPU)."""
    if kind == "bf16" and device_type not in ("cuda", "xpu"):
        raise ValueError(
            f"grad_compression='bf16' uses torch's bf16_compress_hook, which needs NCCL (CUDA) or XCCL (XPU); the "
            f"devices here are {device_type!r}. Use grad_compression='fp16' or 'powersgd', or train on GPUs."
        )


@dataclass(frozen=True)
class Compression:
    """A DDP gradient compression: ``kind`` is ``"fp16"``, ``"bf16"`` or ``"powersgd"``."""

    kind: str
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2

    def register(self, ddp: Any, group: Any) -> Any:
        """Registers the hook on ``ddp`` (communicating over ``group``); returns the hook's state, if any."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.kind == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
            return group
        if self.kind == "bf16":
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
            return group
        if self.kind == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            return state
        raise ValueError(f"Unknown gradient compression {self.kind!r}; allowed: 'fp16', 'bf16', 'powersgd'.")


def compression_of(config: Par3DConfig) -> Compression | None:
    """The DDP gradient compression ``config`` asks for (``grad_compression``), or None."""
    if config.grad_compression is None:
        return None
    return Compression(config.grad_compression, config.powersgd_rank, config.powersgd_start_iter)
