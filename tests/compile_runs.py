"""Compiled par3d runs in a pool worker, with torch's own count of the graphs dynamo compiled after each step."""

from __future__ import annotations

from typing import Any

import lightning as L

from tests import hf_runs
from tests.gpt_runs import run_par3d


class GraphCounter(L.Callback):
    """Dynamo's count of distinct compiled graphs at the end of every training batch: a count that grows after the
    first step is a recompilation."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        from torch._dynamo.utils import counters

        self.graphs.append(int(counters["stats"]["unique_graphs"]))


def run_compiled(strategy: dict[str, Any], devices: int, transformers: bool = False, **kwargs: Any) -> dict[str, Any]:
    """:func:`~tests.gpt_runs.run_par3d` (``transformers``: :func:`~tests.hf_runs.run_par3d`, the tiny Llama) with
    ``strategy``, dynamo's caches and counters cleared before and after (a pool worker serves many tests: nothing
    compiled here outlives the run); the result adds ``graphs``, the count after each step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = GraphCounter()
    try:
        run = hf_runs.run_par3d if transformers else run_par3d
        result = run(strategy=strategy, devices=devices, extra_callbacks=[counter], **kwargs)
    finally:
        torch._dynamo.reset()
        counters.clear()
    return {**result, "graphs": counter.graphs}
