"""CPU threads per rank: the rule Lightning's own strategies apply, for front-ends whose launcher does not.

Lightning's subprocess launcher gives every rank it runs in ``cores // local processes`` intra-op threads (at least
one) and exports ``OMP_NUM_THREADS`` with that number, unless the user set ``OMP_NUM_THREADS`` (then torch already
read it at import, and nothing changes). The Trainer and Fabric strategies get that from Lightning's launcher itself
(:mod:`lightning_par3d.integrations.trainer`); ``Par3DAccelerator`` calls :func:`set_threads_per_rank` here, so the
same script gets the same threads under ``accelerate launch``, torchrun or SLURM. Without it every one of N ranks on a
node runs with all the node's cores, and N ranks fight over them (measured: pure data parallelism on 4 CPU ranks 5×
slower than Lightning's DDP).
"""

from __future__ import annotations

import os
import re

import torch


def cpus_available() -> int:
    """The cores this process may run on (its affinity mask, as Lightning counts them), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(local_processes: int) -> int:
    """Lightning's rule: the available cores shared among the processes on this node, at least one each."""
    if local_processes < 1:
        raise ValueError(f"local_processes must be at least 1, got {local_processes}.")
    return max(1, cpus_available() // local_processes)


def local_processes_from_env() -> int:
    """How many ranks the launcher started on this node: torchrun's (and ``accelerate launch``'s)
    ``LOCAL_WORLD_SIZE``, else SLURM's tasks on this node (``SLURM_STEP_TASKS_PER_NODE`` or
    ``SLURM_NTASKS_PER_NODE``, first figure of forms like ``4(x2)``), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        match = re.match(r"\s*(\d+)", os.environ.get(name, ""))
        if match and int(match.group(1)) > 0:
            return int(match.group(1))
    return 1


def set_threads_per_rank(local_processes: int) -> int:
    """Applies Lightning's rule to this process unless the user set ``OMP_NUM_THREADS``; returns the thread count
    in effect. Exports ``OMP_NUM_THREADS`` as Lightning does, so processes this rank starts inherit it."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = threads_per_rank(local_processes)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    return torch.get_num_threads()
