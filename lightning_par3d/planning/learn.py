"""What measured layouts teach the cost model: one factor per bucket, fitted to the steps ``layout="auto"`` measured.

The cost model predicts a step in four buckets (compute, tensor-parallel and data-parallel communication, the
pipeline's bubble; :class:`~lightning_par3d.planning.cost.StepTime`). Where it is wrong on a machine, it is wrong by
bucket: gloo's collectives on cores that also compute, DTensor's per-op work, a schedule's bookkeeping. The candidates
``layout="auto"`` measures differ in exactly these buckets (they are of different kinds: pp, tp, data-parallel
engine), so their measured steps say how much each bucket really costs on this job's machine, for this model.

:func:`bucket_factors` fits factors ``f`` that make ``Σ_b f_b · predicted_b`` the measured steps. First a common
scale ``s``, the measured total over the predicted total (a profile's figures for another machine, a machine busier
than at its calibration: every bucket alike); then, by least squares relative to each step, a factor ``g_b`` per
bucket on top of it, pulled towards 1 (the model as it is) with weight :data:`PRIOR_WEIGHT`, since three
measurements cannot pin four factors alone and a bucket no measured layout has much of keeps its share;
``f_b = s · g_b``. :func:`relearned`
re-predicts the other layouts with them: a layout of a kind nobody measured that the factors put ahead of the
fastest measured one is the one more worth measuring (:func:`worth_measuring`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_par3d.planning.cost import BUCKETS, StepTime

PRIOR_WEIGHT = 0.02
"""How strongly each factor is held at 1, against a measured step missed by its whole length (relative least
squares): a factor moves only as far as the measurements need, and one no measurement sees stays at 1."""
FACTOR_RANGE = (0.25, 4.0)
"""The per-bucket factors ``g`` are kept in this range: a measurement of a few steps cannot say that one bucket
costs nothing, or ten times its share."""
MIN_GAIN = 0.05
"""The least relearned gain (a share of the fastest measured step) for which one more layout is measured."""


def buckets_of(time: StepTime) -> tuple[float, float, float, float]:
    """A predicted step's buckets (its slowest pipeline rank's)."""
    return (time.compute, time.tp_comm, time.dp_comm, time.bubble)


def bucket_factors(
    predicted: Sequence[Sequence[float]], measured: Sequence[float], prior: float = PRIOR_WEIGHT
) -> tuple[float, ...]:
    """The factor per bucket that takes the ``predicted`` buckets of each measured layout nearest its ``measured``
    step (see the module docstring); all 1 where nothing was measured."""
    if not measured:
        return (1.0,) * len(BUCKETS)
    scale = sum(measured) / max(sum(sum(buckets) for buckets in predicted), 1e-30)
    rows = [[scale * value / step for value in buckets] for buckets, step in zip(predicted, measured, strict=True)]
    targets = [1.0] * len(rows)
    for i in range(len(BUCKETS)):  # the prior: sqrt(prior) · (f_i − 1) = 0
        rows.append([prior**0.5 if j == i else 0.0 for j in range(len(BUCKETS))])
        targets.append(prior**0.5)
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    low, high = FACTOR_RANGE
    return tuple(scale * min(max(g, low), high) for g in solution)


def relearned(buckets: Sequence[float], factors: Sequence[float]) -> float:
    """A layout's step re-predicted with the learned ``factors``."""
    return sum(value * factor for value, factor in zip(buckets, factors, strict=True))


def worth_measuring(
    measured: Sequence[tuple[Sequence[float], float]], others: Sequence[Sequence[float]]
) -> tuple[int | None, tuple[float, ...]]:
    """Which of ``others`` (predicted buckets of layouts not measured) is worth measuring after ``measured``
    ((predicted buckets, measured step) each): the one the learned factors predict fastest, where that beats the
    fastest measured step by :data:`MIN_GAIN` or more (None: none); and the factors."""
    factors = bucket_factors([b for b, _ in measured], [m for _, m in measured])
    if not others or not measured:
        return None, factors
    best_measured = min(m for _, m in measured)
    steps = [relearned(b, factors) for b in others]
    index = min(range(len(steps)), key=steps.__getitem__)
    return (index if steps[index] < best_measured * (1 - MIN_GAIN) else None), factors
