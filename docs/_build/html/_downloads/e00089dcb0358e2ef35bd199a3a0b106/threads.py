"""CPU threads per rank: par3d's rule, applied on every rank whoever launched it.

A rank that trains on the CPU gets ``cores // (2 × local processes)`` intra-op threads (at least 1), or every core
when it is the only process on the node, and ``OMP_NUM_THREADS`` is exported with that number so that processes the
rank starts inherit it; a user's ``OMP_NUM_THREADS`` is left as it is (torch read it at import). The Trainer and
Fabric strategies apply it before Lightning's launcher starts the other local ranks
(:mod:`lightning_par3d.integrations.lightning_shared`); ``Par3DAccelerator`` applies it with the local process count
torchrun, ``accelerate launch`` or SLURM give, so the same script gets the same threads under every launcher.

Why half the fair share, not Lightning's ``cores // local processes``: every rank also runs gloo's transport
threads, the Python thread and the data loading, and ranks that fill every core with compute threads fight those for
the cores. Measured on 16 cores with 4 CPU ranks (``benchmarks/bench_gpu.py --part threads``, the example GPT,
2026-11-26): at 4 threads a rank (the fair share) dp_shard=4 took 372 and 400 ms a step in two runs, against 112–138
ms at 1 or 2 threads, and dp2×tp2 456 ms against 152 ms at 2; Lightning's own launcher, which gives its rule to
rank 0 only (4, 16, 16, 16 threads), took 183–354 ms (docs/benchmarks.md). With every core per rank (torch's
default), pure data parallelism on 4 CPU ranks ran 5× slower than Lightning's DDP. On 2 cores the rule gives 1
thread a rank, as Lightning's does.
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
    """par3d's rule: every available core for a rank alone on its node; otherwise half of each rank's share of the
    cores (see the module docstring), at least one."""
    if local_processes < 1:
        raise ValueError(f"local_processes must be at least 1, got {local_processes}.")
    if local_processes == 1:
        return cpus_available()
    return max(1, cpus_available() // (2 * local_processes))


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
    """Applies par3d's rule to this process unless the user set ``OMP_NUM_THREADS``; returns the thread count in
    effect. Exports ``OMP_NUM_THREADS``, so that processes this rank starts (and Lightning's launcher, which then
    leaves the count alone) keep it."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = threads_per_rank(local_processes)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    return torch.get_num_threads()
