"""The timings behind :func:`~lightning_par3d.planning.calibrate.calibrate`: what every process measures, at the
same time as the others (so that processes sharing cores measure their share), and the slowest rank's figure of each.

* **matmul throughput**: square matmuls (``2n³`` FLOPs each) in fp32 and bf16 for about ``seconds`` each;
* **time per op**: a small MLP's forward and backward, whose arithmetic is negligible, divided by its aten op count
  (counted as the planner's probe counts them, so the two agree); and an in-place op on a small DTensor sharded over
  the processes (no communication: its own dispatch only);
* **a tensor-parallel module's own cost**: a small MLP parallelized as torch's ``ColwiseParallel`` then
  ``RowwiseParallel`` over a mesh of the rank alone (the DTensor work without communication), against the same MLP
  plain, per module, in forward and in backward;
* **the zero-bubble split's cost per backward op**: a small stack's backward as torch's ``stage_backward`` runs it
  and as its zero-bubble schedules split it (``stage_backward_input``, then ``stage_backward_weight``), the
  difference over the backward's aten ops;
* **memory bandwidth**: copies of a 16 MiB tensor (each reads and writes it);
* **collectives**: all-reduce, all-gather, reduce-scatter and all-to-all of :data:`COLLECTIVE_SIZES` (the median of
  a few);
* **a pipeline step**: torch's ``Schedule1F1B`` over pairs of ranks (the whole world where it is odd), each stage a
  tiny ``Linear``, :data:`PIPELINE_MICROBATCHES` microbatches.

Comparisons run their cases in turn (:func:`alternating_medians`), so that a busy moment of a shared machine slows
each alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_SIZES = (4 * 2**10, 64 * 2**10, 1 * 2**20, 4 * 2**20)
"""Bytes per collective measured (the whole tensor: the reduced one, or the gathered output)."""
PIPELINE_MICROBATCHES = 8
"""Microbatches of the do-nothing pipeline whose step prices a schedule action."""
PIPELINE_WIDTH = 8
"""Features of the do-nothing pipeline's ``Linear`` stages (one sample per microbatch)."""


def measure(n: int, device: torch.device, seconds: float, mesh: Any, groups: Any) -> dict[str, Any]:
    """Every figure of the module docstring, the slowest rank's, on every rank (each rank of the ``n`` must call it
    at once; ``mesh`` is a 1-D mesh of them all, ``groups(ranks)`` the process group of some of them)."""
    start = time.perf_counter()
    figures: dict[str, Any] = {
        "fp32_flops": _slowest(_matmul_flops(torch.float32, device, seconds), device, minimum=True),
        "bf16_flops": _slowest(_matmul_flops(torch.bfloat16, device, seconds / 2), device, minimum=True),
        "op_s": _slowest(_op_seconds(device, seconds), device),
        "dtensor_op_s": _slowest(_dtensor_op_seconds(mesh, n, device, seconds / 2), device),
        "split_backward_op_s": _slowest(_split_backward_op_seconds(device, seconds / 2), device),
    }
    forward_s, backward_s = _tp_module_seconds(n, device, seconds / 2, groups)
    figures |= {
        "tp_module_forward_s": _slowest(forward_s, device),
        "tp_module_backward_s": _slowest(backward_s, device),
        "memory_bandwidth": _slowest(_memory_bandwidth(device, seconds / 2), device, minimum=True),
    }
    collectives = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for size in COLLECTIVE_SIZES:
            collectives.append((kind, float(size), _slowest(_collective_seconds(kind, size, n, device), device)))
    pp, step_s, stage_ops = _pipeline_step(n, device, groups)
    figures["pipeline"] = (pp, _slowest(step_s, device))
    figures["pipeline_stage_ops"] = stage_ops
    figures["measuring_s"] = time.perf_counter() - start
    figures["collectives"] = collectives
    return figures


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(value: float, device: torch.device, minimum: bool = False) -> float:
    """The slowest rank's figure: the largest time, or the smallest throughput."""
    t = torch.tensor([-value if minimum else value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(-t.item() if minimum else t.item())


def _timed(run: Any, seconds: float, device: torch.device) -> tuple[int, float]:
    """Runs ``run()`` (after one warm-up) until ``seconds`` have passed; (calls, elapsed)."""
    run()
    _sync(device)
    dist.barrier()
    calls, start = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls, elapsed


def _matmul_flops(dtype: torch.dtype, device: torch.device, seconds: float) -> float:
    size = 1024 if device.type == "cuda" else 256
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    calls, elapsed = _timed(lambda: a @ b, seconds, device)
    return 2 * size**3 * calls / elapsed


def _op_seconds(device: torch.device, seconds: float) -> float:
    from torch import nn

    from lightning_par3d.planning.probe import count_ops

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 8)).to(device)
    x = torch.randn(2, 8, device=device)

    def step() -> None:
        model(x).sum().backward()

    _, ops = count_ops(step)
    calls, elapsed = _timed(step, seconds, device)
    return elapsed / calls / ops


def _tp_module_seconds(n: int, device: torch.device, seconds: float, groups: Any) -> tuple[float, float]:
    """What a tensor-parallel module costs beyond its plain ops, in forward and in backward: a small MLP's two
    ``Linear`` layers parallelized as torch's ``ColwiseParallel`` then ``RowwiseParallel`` over a mesh of this rank
    alone (so no collective moves anything: the DTensor work only: the input wrapped, the layer's ops dispatched on
    DTensors, the output redistributed and unwrapped, and their autograd functions), against the same MLP plain,
    per module."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    alone = [groups([rank]) for rank in range(n)]  # every rank makes every group, in the same order
    mesh = DeviceMesh.from_group(alone[dist.get_rank()], device.type)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)

    plain, parallel = mlp(), mlp()
    parallelize_module(parallel, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 8, 16, device=device)
    median = alternating_medians(
        {
            "plain_forward": lambda: plain(x),
            "parallel_forward": lambda: parallel(x),
            "plain_step": lambda: plain(x).sum().backward(),
            "parallel_step": lambda: parallel(x).sum().backward(),
        },
        seconds,
        device,
    )
    plain.zero_grad(set_to_none=True)
    parallel.zero_grad(set_to_none=True)
    forward = max(median["parallel_forward"] - median["plain_forward"], 0.0) / 2
    step = max(median["parallel_step"] - median["plain_step"], 0.0) / 2
    return forward, max(step - forward, 0.0)


def _split_backward_op_seconds(device: torch.device, seconds: float) -> float:
    """What torch's zero-bubble schedules add per backward op by splitting a stage's backward in two: the same
    small stack's forward and backward timed with torch's ``stage_backward`` and with ``stage_backward_input`` then
    ``stage_backward_weight`` (which walk the autograd graph in Python to find the weight gradients' inputs, and
    keep it for the second pass), the difference over the backward's aten ops (counted as the probe counts them)."""
    from torch import nn

    from lightning_par3d.planning.probe import count_ops
    from lightning_par3d.utils.torch_private import split_backward

    stage_backward, stage_backward_input, stage_backward_weight = split_backward()

    layers = [m for _ in range(4) for m in (nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))]
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(2, 8, device=device)

    def forward() -> tuple[Any, Any]:
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        return inputs, out

    def whole() -> None:
        inputs, out = forward()
        stage_backward([out], [torch.ones_like(out)], [inputs])

    def split() -> None:
        inputs, out = forward()
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [inputs], model.parameters())
        stage_backward_weight(model.parameters(), groups)

    _, out = forward()
    _, ops = count_ops(lambda: out.backward(torch.ones_like(out)))
    median = alternating_medians({"whole": whole, "split": split}, seconds, device)
    model.zero_grad(set_to_none=True)
    return max(median["split"] - median["whole"], 0.0) / ops


def alternating_medians(runs: dict[str, Callable[[], Any]], seconds: float, device: torch.device) -> dict[str, float]:
    """Each run's median time, the runs called in turn (after one warm-up each: DTensor's sharding caches) until
    ``seconds`` have passed, so that a busy moment of a shared machine slows each alike (every rank starts at once)."""
    for run in runs.values():
        run()
    _sync(device)
    dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in runs}
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            _sync(device)
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(taken) for name, taken in times.items()}


def _dtensor_op_seconds(mesh: Any, n: int, device: torch.device, seconds: float) -> float:
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = distribute_tensor(torch.zeros(16 * n, device=device), mesh, [Shard(0)])
    calls, elapsed = _timed(lambda: shard.mul_(1.0), seconds, device)
    return elapsed / calls


def _memory_bandwidth(device: torch.device, seconds: float) -> float:
    source = torch.empty(4 * 2**20, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    calls, elapsed = _timed(lambda: target.copy_(source), seconds, device)
    return 2 * source.numel() * 4 * calls / elapsed


def _pipeline_step(n: int, device: torch.device, groups: Any, steps: int = 5) -> tuple[int, float, float]:
    """(stages, median seconds per step, ops per action) of ``Schedule1F1B`` over pairs of ranks (the whole world
    where ``n`` is odd), each stage a ``Linear`` of :data:`PIPELINE_WIDTH` features, one sample per microbatch."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_par3d.planning.probe import count_ops

    pp = 2 if n % 2 == 0 else n
    rank = dist.get_rank()
    group, index = None, 0
    for first in range(0, n, pp):  # every rank makes every group, in the same order
        ranks = list(range(first, first + pp))
        made = groups(ranks)
        if rank in ranks:
            group, index = made, ranks.index(rank)
    module = nn.Linear(PIPELINE_WIDTH, PIPELINE_WIDTH).to(device)
    stage = PipelineStage(module, index, pp, device, group=group)
    schedule = Schedule1F1B(stage, n_microbatches=PIPELINE_MICROBATCHES, loss_fn=lambda out, _target: out.sum())
    x = torch.randn(PIPELINE_MICROBATCHES, PIPELINE_WIDTH, device=device)
    _, ops = count_ops(lambda: module(x[:1]).sum().backward())

    def step() -> None:
        if index == 0:
            schedule.step(x)
        elif index == pp - 1:
            schedule.step(target=x)
        else:
            schedule.step()

    return pp, _median_seconds(step, steps, device), ops / 2  # the first, untimed, infers the stages' shapes


def _median_seconds(run: Any, repeats: int, device: torch.device) -> float:
    """The median time of ``run()`` over ``repeats`` calls after one untimed, every rank starting each at once."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective_seconds(kind: str, size: int, n: int, device: torch.device, repeats: int = 5) -> float:
    if kind == "all_reduce":
        tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)

        def run() -> None:
            dist.all_reduce(tensor)

    elif kind == "reduce_scatter":  # as par3d's ZeRO calls it (zero/buckets.py): one flat input, this rank's chunk out
        flat = torch.zeros(size // 4 // n * n, dtype=torch.float32, device=device)
        mine = torch.empty(size // 4 // n, dtype=torch.float32, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.12

        def run() -> None:
            scatter(mine, flat)

    elif kind == "all_to_all":  # as expert parallelism sends its tokens: one buffer, a chunk to each rank
        send_buffer = torch.zeros(size // 4 // n * n, dtype=torch.float32, device=device)
        received = torch.empty_like(send_buffer)

        def run() -> None:
            dist.all_to_all_single(received, send_buffer)

    else:
        chunk = torch.zeros(size // 4 // n, dtype=torch.float32, device=device)
        parts = [torch.empty_like(chunk) for _ in range(n)]

        def run() -> None:
            dist.all_gather(parts, chunk)

    return _median_seconds(run, repeats, device)
