"""Process-group setup shared by the Trainer and Fabric strategies."""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

from lightning_par3d.config import Layout
from lightning_par3d.mesh import Par3DMesh


def init_distributed(
    cluster_environment: ClusterEnvironment, device: torch.device, backend: str | None, timeout_s: float
) -> str:
    """Initializes the default process group (if nobody has) with the collective timeout; returns the backend."""
    backend = backend or _get_default_process_group_backend_for_device(device)
    _init_dist_connection(
        cluster_environment,
        backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type != "cpu" else None,
    )
    return backend


def build_mesh(layout: Layout, device: torch.device, backend: str, timeout_s: float) -> Par3DMesh:
    """The :class:`Par3DMesh` with its ``DeviceMesh``; every sub-group times out after ``timeout_s``."""
    return Par3DMesh.build(layout, device.type, backend, timedelta(seconds=timeout_s))
