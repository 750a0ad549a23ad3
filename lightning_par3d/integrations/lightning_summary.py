"""Lightning's model summary, true at every par3d layout.

Lightning's ``ModelSummary`` (``RichModelSummary`` where ``rich`` is installed) counts the parameters rank 0 holds,
and measures FLOPs only by running ``example_input_array`` through the model on rank 0 alone; without it, it prints
FLOPs of 0. Under par3d a DTensor already counts its whole tensor, but under pp rank 0 holds only the first stage
(the demo's summary said 21.9 K parameters of 42.8 K), and a forward on one rank of a sharded model would wait for
its peers for ever. So the Trainer strategy puts :class:`Par3DModelSummary` (or :class:`Par3DRichModelSummary`) in
the place of Lightning's: each row's parameters are summed over the pipeline stages (every rank counts its part;
rank 0 prints), and there is no FLOPs column or total (the bottleneck report measures the model's FLOPs on a meta
copy: :class:`~lightning_par3d.callbacks.BottleneckReport`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

from lightning_par3d.integrations.framework_private import format_summary_table

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")


@dataclass
class WholeModelSummary:
    """The summary's columns (without FLOPs) and totals, counted over every pipeline stage."""

    columns: list[tuple[str, list[str]]]
    total: int
    trainable: int
    size_mb: float
    modes: dict[str, int]


def whole_model_summary(trainer: pl.Trainer, module: pl.LightningModule, max_depth: int) -> WholeModelSummary:
    """Lightning's summary of ``module``, its parameter counts summed over the pipeline stages (a collective over the
    pp group: every rank must call it), with no FLOPs column and no forward of ``example_input_array``."""
    example = module.example_input_array
    module.example_input_array = None  # no forward on one rank of a sharded model
    try:
        summary = summarize(module, max_depth=max_depth)
    finally:
        module.example_input_array = example
    per_layer = list(summary.param_nums)
    counts = torch.tensor([*per_layer, summary.total_parameters, summary.trainable_parameters], dtype=torch.int64)
    group = _pipeline_group(trainer)
    if group is not None:
        dist.all_reduce(counts, group=group)
    *layers, total, trainable = (int(c) for c in counts.tolist())
    columns = [(name, values[: len(layers)]) for name, values in summary._get_summary_data() if name != "FLOPs"]
    columns = [(n, list(map(get_human_readable_count, layers)) if n == "Params" else v) for n, v in columns]
    leftover = total - sum(layers)  # parameters outside the rows (Lightning's own leftover row, recounted)
    if leftover > 0:
        cells = {" ": str(len(layers)), "Name": "other params", "Params": get_human_readable_count(leftover)}
        columns = [(n, [*v, cells.get(n, "n/a")]) for n, v in columns]
    per_param = summary.model_size / summary.total_parameters if summary.total_parameters else 0.0
    return WholeModelSummary(columns, total, trainable, total * per_param, summary.total_training_modes)


class Par3DModelSummary(ModelSummary):
    """``ModelSummary`` whose counts are the whole model's at any layout, without FLOPs."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth:
            return
        whole = whole_model_summary(trainer, pl_module, self._max_depth)
        if trainer.is_global_zero:
            self.print_summary(whole)

    def print_summary(self, whole: WholeModelSummary) -> None:
        table = format_summary_table(whole.total, whole.trainable, whole.size_mb, whole.modes, 0, *whole.columns)
        log.info("\n" + table.rsplit("\n", 1)[0])  # without Lightning's "Total Flops" line


class Par3DRichModelSummary(Par3DModelSummary, RichModelSummary):
    """``RichModelSummary`` whose counts are the whole model's at any layout, without FLOPs."""

    @override
    def print_summary(self, whole: WholeModelSummary) -> None:
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=self._summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in whole.columns:
            table.add_column(name, justify="right" if name == "Params" else "left", style="dim" if name == " " else "")
        for row in zip(*(values for _, values in whole.columns), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(whole.trainable)),
            ("Non-trainable params", get_human_readable_count(whole.total - whole.trainable)),
            ("Total params", get_human_readable_count(whole.total)),
            ("Total estimated model params size (MB)", get_formatted_model_size(whole.size_mb)),
            ("Modules in train mode", str(whole.modes["train"])),
            ("Modules in eval mode", str(whole.modes["eval"])),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)


def _pipeline_group(trainer: pl.Trainer) -> Any:
    """The pp process group of a pipelined par3d run, else None."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None or not engine.placement.is_set_up or engine.layout.pp == 1:
        return None
    return engine.mesh["pp"].get_group()


def use_par3d_summary(trainer: pl.Trainer) -> None:
    """Puts par3d's summary in the place of the trainer's own ``ModelSummary`` or ``RichModelSummary`` (the plain
    classes, which Lightning adds for ``enable_model_summary=True``), keeping its depth and options."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    for index, callback in enumerate(callbacks):
        kind = {ModelSummary: Par3DModelSummary, RichModelSummary: Par3DRichModelSummary}.get(type(callback))
        if kind is not None:
            callbacks[index] = kind(max_depth=callback._max_depth, **callback._summarize_kwargs)
