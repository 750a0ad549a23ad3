"""Measuring the machine the planner runs on: :func:`calibrate` gives a :class:`~lightning_par3d.planning.machine.
Machine` whose figures are this machine's, measured by ``world_size`` processes at once, as a run's ranks share it.

``torch.multiprocessing`` spawns the processes; they join one process group over ``backend`` (gloo on CPUs, NCCL
with one GPU each) and each times, at the same time as the others, what :mod:`~lightning_par3d.planning.timings`
lists. This module turns the timings into the machine's figures:

* the collectives' times are fitted by least squares, relative to each time, to the ring formulas of
  :mod:`~lightning_par3d.planning.cost` for a latency α per step and a bandwidth β; the reduce-scatters' median time
  over the fitted all-gather's of their size is the link's ``reduce_scatter_factor`` ρ (1 on NCCL, several on gloo,
  which runs it as more than a ring pass), and the all-to-alls' its ``all_to_all_factor``;
* the pipeline step gives the machine's ``pipeline_action_s``: the cost per action that makes the planner's own
  simulation of that schedule (:mod:`~lightning_par3d.planning.schedule_timing`, the stage's ops and the hops priced
  as the cost model prices them) last as long as the measured step;
* the rest are the machine's figures as measured (matmul FLOP/s, time per op and per DTensor op, a tensor-parallel
  module's own cost, the zero-bubble split's, memory bandwidth).

On one machine nothing crosses a network, so the link across nodes is the one within (give ``inter_node=`` for a
real network). It takes a few seconds beyond starting the processes (each imports torch).

:func:`calibrate_job` measures the same figures inside a running job, on its own ranks and process group (what
``layout="auto"`` plans with): every rank calls it at the same point; the random number generators are left as they
were, so the training that follows draws what it would have drawn.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_par3d.planning.machine import Link, Machine
from lightning_par3d.planning.timings import PIPELINE_MICROBATCHES, PIPELINE_WIDTH, measure


def calibrate(
    world_size: int | None = None,
    backend: str = "gloo",
    *,
    seconds: float = 0.3,
    inter_node: Link | None = None,
    timeout_s: float = 300.0,
) -> Machine:
    """This machine's figures, measured by ``world_size`` processes at once (default: the cores, 2 to 8); see the
    module docstring. ``backend="nccl"`` measures one GPU per process."""
    import torch.multiprocessing as mp

    cores = os.cpu_count() or 2
    n = world_size if world_size is not None else min(max(cores, 2), 8)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(
            f"calibrate(world_size={world_size!r}) needs 2 or more processes to measure collectives. Give the ranks "
            "that will share this machine (2 or more)."
        )
    if backend == "nccl" and torch.cuda.device_count() < n:
        raise ValueError(
            f"calibrate(world_size={n}, backend='nccl') needs {n} GPUs, and this machine has "
            f"{torch.cuda.device_count()}. Use fewer processes, or backend='gloo'."
        )
    started = time.perf_counter()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    # The workers' store, hosted here on a port the OS assigns and this process keeps bound until they are done (a
    # port found free and released first could be taken by another process before the workers bind it).
    store = dist.TCPStore(
        "127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    mp.start_processes(
        _worker,
        args=(n, store.port, backend, seconds, timeout_s, results),
        nprocs=n,
        join=True,
        start_method="spawn",
    )
    del store
    measured: dict[str, Any] = results.get()
    measured["calibration_s"] = time.perf_counter() - started
    return _machine(measured, n, backend, f"calibrated ({n} {backend} processes, {cores} cores)", inter_node)


def calibrate_job(
    device: torch.device, groups: Callable[[list[int]], Any], *, seconds: float = 0.3, inter_node: Link | None = None
) -> Machine:
    """The figures of the job this process is a rank of, measured by all its ranks at once over its default process
    group (every rank must call it at the same point); ``groups(ranks)`` is the job's process group of those global
    ranks (its cache: :func:`lightning_par3d.distributed.groups.group_of`), for the DTensor figure (every rank) and
    the pipeline's (pairs). The link measured is the world's: across nodes too, where the job spans several
    (``inter_node`` sets the network's apart)."""
    from torch.distributed.device_mesh import DeviceMesh

    started = time.perf_counter()
    n = dist.get_world_size()
    mesh = DeviceMesh.from_group(groups(list(range(n))), device.type)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        measured = measure(n, device, seconds, mesh, groups)
    measured["calibration_s"] = time.perf_counter() - started
    backend = str(dist.get_backend())
    name = f"measured at launch ({n} {backend} ranks, {os.cpu_count() or 1} cores per node)"
    return _machine(measured, n, backend, name, inter_node, lambda *fit: _fit_on_rank_zero(device, *fit))


def _fit_on_rank_zero(device: torch.device, *fit: Any) -> float:
    """:func:`pipeline_action_seconds` of ``fit``, computed by rank 0 in a fresh interpreter (it simulates torch's
    schedule over torch's fake process group, which cannot live beside the job's) and sent to every rank. Where it
    fails, rank 0 says why and every rank takes 0 (no cost per action: the model as it was), never waiting on it."""
    from lightning_par3d.utils.fresh_interpreter import call

    found = [0.0]
    if dist.get_rank() == 0:
        try:
            found[0] = call(pipeline_action_seconds, *fit, what="the calibration's pipeline fit", timeout_s=300.0)
        except Exception as error:  # sent as a value: the other ranks are waiting in the broadcast below
            print(f"par3d calibration: no cost per pipeline action ({type(error).__name__}: {error}).", flush=True)
    dist.broadcast_object_list(found, src=0, device=device if device.type == "cuda" else None)
    return float(found[0])


def _machine(
    measured: dict[str, Any],
    n: int,
    backend: str,
    name: str,
    inter_node: Link | None,
    fit_action: Callable[..., float] | None = None,
) -> Machine:
    """The machine of the figures ``measured``; ``fit_action`` computes :func:`pipeline_action_seconds` (where this
    process has no process group, that function itself)."""
    link = _fit_link(measured["collectives"], n)
    link = dataclasses.replace(
        link,
        reduce_scatter_factor=factor_over_all_gather("reduce_scatter", measured["collectives"], n, link),
        all_to_all_factor=factor_over_all_gather("all_to_all", measured["collectives"], n, link),
    )
    gpu = backend == "nccl"
    pp, step_s = measured["pipeline"]
    fit = fit_action or pipeline_action_seconds
    action_s = fit(step_s, pp, link, measured["op_s"], measured["pipeline_stage_ops"])
    figures = {k: v for k, v in measured.items() if k not in ("collectives", "pipeline")}
    return Machine(
        name=name,
        matmul_flops={"fp32": measured["fp32_flops"], "bf16": measured["bf16_flops"], "fp16": measured["bf16_flops"]},
        op_overhead_s=measured["op_s"],
        dtensor_op_overhead_s=measured["dtensor_op_s"],
        split_backward_op_s=measured["split_backward_op_s"],
        tp_module_s=(measured["tp_module_forward_s"], measured["tp_module_backward_s"]),
        memory_bandwidth=measured["memory_bandwidth"],
        pipeline_action_s=action_s,
        intra_node=link,
        inter_node=inter_node or link,
        async_kernels=gpu,
        overlap_communication=gpu,
        source=f"measured on this machine by {n} processes over {backend}",
        measurements={
            **figures,
            "alpha_s": link.latency_s,
            "beta_bytes_per_s": link.bandwidth,
            "reduce_scatter_factor": link.reduce_scatter_factor,
            "all_to_all_factor": link.all_to_all_factor,
            "pipeline_step_s": step_s,
            "pipeline_action_s": action_s,
        },
    )


def factor_over_all_gather(kind: str, samples: list[tuple[str, float, float]], n: int, link: Link) -> float:
    """The median, over the sizes measured, of a ``kind`` collective's time (a reduce-scatter, an all-to-all) over
    the fitted all-gather's of its size (1 where none was measured; never below 1)."""
    from lightning_par3d.planning.cost import all_gather

    ratios = [seconds / all_gather(size, n, link) for measured, size, seconds in samples if measured == kind]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def pipeline_action_seconds(step_s: float, pp: int, link: Link, op_s: float, stage_ops: float) -> float:
    """The cost per action that makes the planner's simulation of the calibration's pipeline (``Schedule1F1B``,
    ``pp`` stages, :data:`PIPELINE_MICROBATCHES` microbatches, ``stage_ops`` ops per action at ``op_s``, each hop
    priced by the cost model over ``link``) last ``step_s`` (0 where the simulation alone lasts that long)."""
    from lightning_par3d.pipeline.actions import pipeline_actions
    from lightning_par3d.planning.cost import COLLECTIVE_CPU_OPS, send
    from lightning_par3d.planning.schedule_timing import simulate

    actions = pipeline_actions("1f1b", pp, 1, PIPELINE_MICROBATCHES)
    hop = send(PIPELINE_WIDTH * 4, link) + COLLECTIVE_CPU_OPS * op_s

    def makespan(action_s: float) -> float:
        return max(simulate(actions, lambda _: stage_ops * op_s + action_s, lambda _s, _t: hop).end.values())

    low, high = 0.0, step_s
    if makespan(low) >= step_s:
        return 0.0
    for _ in range(60):  # the makespan grows with the action's cost: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if makespan(middle) < step_s else (low, middle)
    return (low + high) / 2


def _fit_link(samples: list[tuple[str, float, float]], n: int) -> Link:
    """α and β of the ring formulas, fitted to (collective, bytes, seconds) samples by least squares relative to
    each time."""
    coefficients = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n)}
    rows, targets = [], []
    samples = [sample for sample in samples if sample[0] in coefficients]
    for kind, size, seconds in samples:
        latency, volume = coefficients[kind]
        rows.append([latency / seconds, volume * size / seconds])
        targets.append([1.0])
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64))
    alpha, inverse_beta = (float(x) for x in solution.solution.flatten())
    if inverse_beta <= 0:  # latency-bound at every size measured: take the bandwidth of the largest
        kind, size, seconds = max(samples, key=lambda s: s[1])
        inverse_beta = seconds / (coefficients[kind][1] * size)
    return Link(latency_s=max(alpha, 0.0), bandwidth=1.0 / inverse_beta)


# ---------------------------------------------------------------- inside each process


def _worker(rank: int, n: int, port: int, backend: str, seconds: float, timeout_s: float, results: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timeout)  # the caller's
    dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        figures = measure(n, device, seconds, init_device_mesh(device.type, (n,)), lambda ranks: dist.new_group(ranks))
        if rank == 0:
            results.put(figures)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done, and the figures handed over: leave without the interpreter's teardown, where torch's C++ threads now and
    # then abort a finished worker ("terminate called without an active exception", seen under load).
    os._exit(0)
