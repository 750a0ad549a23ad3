"""``layout="auto"`` with ``measure=k``: the k layouts the planner predicts fastest, each trained for a few steps in
the job's own processes, and the fastest measured kept.

The planner ranks layouts well but its first choice is not always the fastest (the cost model does not see every
contention of a machine). NeMo's AutoConfigurator and DeepSpeed's autotuner pick well by running candidates; par3d
runs only the few its model puts on top, on the job's own ranks, with the user's own model class, optimizer and a
batch of the user's own data, each candidate at the batch split that keeps the global batch
(:class:`~lightning_par3d.planning.at_launch.BatchSplit`).

Measuring leaves no trace on the run: each candidate trains a fresh copy of the model (the module before
``configure_model``, built at the candidate's layout with ``init="meta"``: every rank initializes its own shards, so
nothing moves from rank 0), with its own optimizer; the batch is read from a fresh iterator of the training
dataloader; every random generator (torch's CPU and accelerator ones, Python's, NumPy's) is put back as it was. The
run itself then starts from what it would have had without measuring: its weights, optimizer, random state,
dataloader position and Lightning's counters. The candidates' process groups stay (the chosen one's serve the run,
as a mesh of the same shape is shared); the others are a few idle groups until the end of the job.

What the candidates measured teaches the cost model (:mod:`~lightning_par3d.planning.learn`): a factor per bucket
that re-predicts the other fitting layouts rank 0 sent beside them; one those factors put ahead of the fastest
measured (by 5 %) is measured too (:func:`measure_learned`).

A step's time is the slowest rank's: ``accumulate`` forward and backward passes and one optimizer step, the first
``warmup`` steps dropped, the median of the rest. A candidate that fails to run alike on every rank (a model whose
``training_step`` needs a Trainer, say) stops measuring: rank 0 says why, and the run takes the planner's first
choice. A candidate that fails on some ranks only ends the job, naming the rank and the cause (its peers may be
waiting in the candidate's collectives; falling back would leave them waiting until ``timeout_s``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par3d.config import Par3DConfig
from lightning_par3d.distributed import faults
from lightning_par3d.distributed.agree import same_refusal
from lightning_par3d.planning.at_launch import (
    BatchSplit,
    Candidate,
    candidate_from,
    choose_at_launch,
    global_batch_of,
    measure_count,
)
from lightning_par3d.planning.layout_record import job_record, keep, rank0_reads

STEPS = 3
"""Measured steps per candidate (after ``WARMUP``)."""
WARMUP = 1
"""Steps per candidate left out of its time (the first step allocates, and under pp infers the stages' shapes)."""


@dataclasses.dataclass(frozen=True)
class MeasureWith:
    """What measuring needs on every rank: the model before ``configure_model`` (a meta copy: a LightningModule,
    or a plain module with ``loss_fn(outputs, *targets)``), one batch of the training dataloader as it gives it
    (``batch_size`` samples of the loader, resized to each candidate's per-rank batch), and the file where measured
    choices are kept (None: not kept)."""

    module: nn.Module
    batch: Any
    loss_fn: Callable[..., Tensor] | None = None
    cache: Path | None = None


StepTime = Callable[[Candidate, MeasureWith, str, torch.device], list[float]]
"""How a candidate's steps are timed (every rank at once): each measured step in seconds, the slowest rank's. The
engine's :func:`~lightning_par3d.engine.trial.measure_step` trains the candidate on a fresh copy of the model; the
planner cannot build an engine itself (it lies below the engine), so the engine hands it this function."""


def choose(
    config: Par3DConfig,
    module: nn.Module | None,
    sample: MeasureWith | None,
    *,
    world_size: int,
    devices_per_node: int,
    rank_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    calibrate: Callable[[], Any],
    accumulate: int | None,
    step_time: StepTime,
) -> Candidate:
    """The layout to train with (every rank): the choice measured before for the same job (:func:`job_record`: the
    model's class, parameters and config, world, global batch, sequence, precision, devices, pinned settings) where
    ``sample.cache`` keeps one; else the
    planner's ``measure`` fastest (:func:`~lightning_par3d.planning.at_launch.choose_at_launch`), measured here
    where ``sample`` is given (and the choice kept), else its fastest."""
    if sample is None and config.measure:
        raise ValueError(
            f"layout='auto' with measure={config.measure}, but there is no batch to measure with here (Fabric sets "
            "the model up before any dataloader). Set measure=0 (or leave it unset), or measure the layouts yourself "
            "and pin the fastest."
        )
    count = measure_count(config) if sample is not None else 1
    global_batch = global_batch_of(config, rank_batch, world_size, accumulate or 1)
    record = job_record(config, sample.module, world_size, global_batch, seq_len, precision, device) if sample else {}
    kept = rank0_reads(sample.cache, record) if sample is not None and sample.cache is not None and count > 1 else None
    if kept is not None and sample is not None:
        if dist.get_rank() == 0:
            print(
                f"par3d layout='auto': {kept['name']}, measured fastest for this job before (kept in "
                f"{sample.cache}, {kept['when']}): not measuring again. Delete that entry to measure anew.",
                flush=True,
            )  # fmt: skip
        return candidate_from(config, kept["arguments"], BatchSplit(global_batch, *kept["split"]), 0.0, kept["name"])
    found = choose_at_launch(
        config, module, world_size=world_size, devices_per_node=devices_per_node, rank_batch=rank_batch,
        seq_len=seq_len, precision=precision, device=device, measure=calibrate, accumulate=accumulate, count=count,
    )  # fmt: skip
    candidates = [c for c in found if not c.reserve]
    if sample is None or len(candidates) == 1:
        return candidates[0]
    best, times = pick_measured(candidates, sample, precision, device, step_time)
    if times is not None:
        reserve = [c for c in found if c.reserve]
        best = measure_learned(candidates, times, best, reserve, sample, precision, device, step_time)
    if times is not None and sample.cache is not None and dist.get_rank() == 0:
        keep(
            sample.cache,
            record,
            candidates[best],
            [(c.name, c.predicted_s, t) for c, t in zip(candidates, times, strict=True)],
        )
    return candidates[best]


def pick_measured(
    candidates: list[Candidate], sample: MeasureWith, precision: str, device: torch.device, step_time: StepTime
) -> tuple[int, list[float] | None]:
    """Measures ``candidates`` (every rank at once) and returns the index of the fastest and every candidate's
    median step; rank 0 prints each one's predicted step and measured median and spread, and what measuring cost.
    Where the two fastest medians are closer than either's spread (:func:`too_close`), both are measured again, in
    the other order, and judged on all their steps. Falls back to 0 (the planner's first, and no times) where every
    rank refused a candidate alike; a failure on some ranks only ends the job (:func:`measure_or_refuse`)."""
    states = _rng_states()
    started = time.perf_counter()
    samples: list[list[float]] = []
    step = faults.run_key(f"measure{next(_MEASURING)}")
    try:
        for index, candidate in enumerate(candidates):
            took = measure_or_refuse(candidate, sample, precision, device, f"{step}/{index}", step_time)
            if took is None:
                if dist.get_rank() == 0:
                    print(
                        f"par3d layout='auto': training the planner's first choice, {candidates[0].name}.", flush=True
                    )
                return 0, None
            samples.append(took)
        again = too_close(samples)
        for index in reversed(again):  # the other order: a drift of the machine weighs on both alike
            more = measure_or_refuse(candidates[index], sample, precision, device, f"{step}/again{index}", step_time)
            if more is not None:
                samples[index] = samples[index] + more
    finally:
        _restore_rng(states)
    times = [statistics.median(s) for s in samples]
    best = min(range(len(times)), key=times.__getitem__)
    if dist.get_rank() == 0:
        print(describe_measured(candidates, samples, best, time.perf_counter() - started, again), flush=True)
    return best, times


def spread(steps: list[float]) -> float:
    """How far a candidate's measured steps spread: the slowest less the fastest."""
    return max(steps) - min(steps)


def too_close(samples: list[list[float]]) -> list[int]:
    """The two fastest candidates (by median, fastest first) where their medians are closer than the larger of their
    spreads (:func:`spread`), so that one measuring cannot tell them apart; else none."""
    if len(samples) < 2:
        return []
    first, second = sorted(range(len(samples)), key=lambda i: statistics.median(samples[i]))[:2]
    gap = statistics.median(samples[second]) - statistics.median(samples[first])
    return [first, second] if gap < max(spread(samples[first]), spread(samples[second])) else []


_MEASURING = itertools.count()
"""This process's measurings: each one's keys in the job's store are its own (every rank counts alike)."""
AGREE_S = 10.0
"""How long a rank whose candidate failed waits for the other ranks to say whether theirs failed alike (at most half
the timeout, so that it says why before its peers' collectives time out). Ranks that refuse alike do so at the same
point of the same code, within a fraction of a second of each other."""


def measure_or_refuse(
    candidate: Candidate, sample: MeasureWith, precision: str, device: torch.device, key: str, step_time: StepTime
) -> list[float] | None:
    """``candidate``'s ``step_time``; None where every rank raised the same error (a refusal that holds on
    every rank, such as a ``training_step`` that needs a Trainer: rank 0 says why, and measuring stops cleanly).
    Where it failed on some ranks only, or differently, the peers of a failed rank may be waiting in the
    candidate's collectives: the failed rank raises ``RuntimeError`` naming itself and the cause at once (within
    :data:`AGREE_S`, or half the timeout if shorter), which ends the job through the front-end's failure handling,
    instead of falling back while its peers wait until ``timeout_s``."""
    error: Exception | None = None
    try:
        took = step_time(candidate, sample, precision, device)
    except Exception as raised:
        error = raised
    rank, world = dist.get_rank(), dist.get_world_size()
    wait_s = min(AGREE_S, candidate.config.timeout_s / 2)
    if same_refusal(key, rank, world, error, wait_s):
        if rank == 0:
            print(
                f"par3d layout='auto': measuring {candidate.name} was refused alike on every rank "
                f"({type(error).__name__}: {error}); measuring stops.",
                flush=True,
            )
        return None
    if error is not None:
        raise RuntimeError(
            f"layout='auto': measuring {candidate.name} failed on rank {rank} ({type(error).__name__}: {error}), and "
            "not alike on every rank: the other ranks may be waiting in its collectives. Ending the job."
        ) from error
    return took


def measure_learned(
    candidates: list[Candidate],
    times: list[float],
    best: int,
    reserve: list[Candidate],
    sample: MeasureWith,
    precision: str,
    device: torch.device,
    step_time: StepTime,
) -> int:
    """What the measured ``candidates`` teach: the factor per bucket that takes their predictions to their measured
    ``times`` (:func:`~lightning_par3d.planning.learn.worth_measuring`); where those factors put a ``reserve``
    layout ahead of the fastest measured, it is measured too (appended to ``candidates`` and ``times``). Returns the
    index of the fastest measured. Rank 0 decides, and prints what it learned."""
    from lightning_par3d.planning.learn import BUCKETS, relearned, worth_measuring

    decision: list[Any] = [None, ()]
    if dist.get_rank() == 0:
        measured = [(c.buckets, t) for c, t in zip(candidates, times, strict=True)]
        decision[:] = worth_measuring(measured, [c.buckets for c in reserve])
    dist.broadcast_object_list(decision, src=0, device=device if device.type == "cuda" else None)
    index, factors = decision
    if index is None:
        return best
    extra = reserve[index]
    states = _rng_states()
    started = time.perf_counter()
    try:
        key = faults.run_key(f"measure{next(_MEASURING)}")
        steps = measure_or_refuse(extra, sample, precision, device, key, step_time)
    finally:
        _restore_rng(states)
    if steps is None:  # refused alike on every rank: the run goes on with the fastest measured
        return best
    took = statistics.median(steps)
    candidates.append(extra)
    times.append(took)
    fastest = min(range(len(times)), key=times.__getitem__)
    if dist.get_rank() == 0:
        learned = ", ".join(f"{name} ×{f:.2f}" for name, f in zip(BUCKETS, factors, strict=True))
        print(
            f"par3d layout='auto': the measured steps put the cost model's buckets at {learned} of its prediction; "
            f"with them {extra.name} (predicted {extra.predicted_s * 1e3:,.1f} ms) comes to "
            f"{relearned(extra.buckets, factors) * 1e3:,.1f} ms, so it was measured too: {took * 1e3:,.1f} ms "
            f"(measuring it took {time.perf_counter() - started:.1f} s more); training {candidates[fastest].name}.",
            flush=True,
        )
    return fastest


def describe_measured(
    candidates: list[Candidate], samples: list[list[float]], best: int, cost_s: float, again: Sequence[int] = ()
) -> str:
    """What rank 0 prints: each candidate's predicted step, its measured median and spread (slowest less fastest
    step), the choice, what was measured again, and the time measuring took."""
    times = [statistics.median(s) for s in samples]
    rows = [
        f"| {i + 1} | {c.name} | {c.predicted_s * 1e3:,.1f} | {t * 1e3:,.1f} | {spread(s) * 1e3:,.1f} | {len(s)} |"
        f"{' chosen' if i == best else ''}"
        for i, (c, t, s) in enumerate(zip(candidates, times, samples, strict=True))
    ]
    note = "" if best == 0 else f" (the planner's first choice measured {times[0] / times[best]:.2f}×)"
    close = (
        f" #{again[0] + 1} and #{again[1] + 1} were closer than their spread: both measured again, in the other order."
        if again
        else ""
    )
    return (
        f"par3d layout='auto': measured {len(candidates)} layouts, the first choice and the fastest predicted at each "
        f"other pipeline size, engine and ZeRO stage, and tensor-parallel size, {STEPS} steps each after {WARMUP} "
        f"(measuring took {cost_s:.1f} s); training {candidates[best].name}{note}.{close}\n"
        "| # | layout | predicted ms/step | measured ms/step (median) | spread (ms) | steps | |\n"
        "|---:|---|---:|---:|---:|---:|---|\n" + "\n".join(rows)
    )


CACHE_NAME = "par3d_auto_layout.json"
"""The file, in the run's directory, where measured choices are kept."""


def measure_with(
    config: Any,
    module: nn.Module,
    loader: Any,
    loss_fn: Callable[..., Tensor] | None = None,
    directory: str | Path | None = None,
) -> MeasureWith | None:
    """What to measure with at launch (every rank): the module before ``configure_model`` (a meta copy), the first
    batch of the training ``loader``, and :data:`CACHE_NAME` in ``directory`` (None: nothing kept); None where
    ``measure=0`` or there is no loader."""
    if config.measure == 0 or loader is None:
        return None
    cache = Path(directory) / CACHE_NAME if directory is not None else None
    return MeasureWith(copy.deepcopy(module), first_batch(loader), loss_fn, cache)


def first_batch(loader: Any) -> Any:
    """A batch of ``loader``'s data that reading leaves no trace of: its dataset's first ``batch_size`` samples
    through its own ``collate_fn`` (no sampler, so no shuffling generator moves, no worker starts); for an iterable
    dataset, the first batch of a fresh iterator, with the global random generators put back as they were."""
    dataset, size = getattr(loader, "dataset", None), getattr(loader, "batch_size", None)
    collate = getattr(loader, "collate_fn", None)
    if dataset is not None and hasattr(dataset, "__getitem__") and isinstance(size, int) and callable(collate):
        try:
            return collate([dataset[i] for i in range(min(size, len(dataset)))])
        except (TypeError, NotImplementedError):
            pass  # no len() or no indexing: read it as an iterable
    states = _rng_states()
    try:
        return next(iter(loader))
    finally:
        _restore_rng(states)


def resized(batch: Any, size: int) -> Any:
    """``batch`` with every tensor's first dimension made ``size`` (rows repeated or cut), in the same structure."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0 or batch.shape[0] == size:
            return batch
        repeats = -(-size // batch.shape[0])
        return batch.repeat(repeats, *([1] * (batch.dim() - 1)))[:size]
    if isinstance(batch, dict):
        return type(batch)({k: resized(v, size) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(resized(v, size) for v in batch)
    return batch


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return states


def _restore_rng(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
