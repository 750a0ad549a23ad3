"""What the run's measured step says each change would do: the planning services (the machine's calibration, the
advice's predictions) called with the run's figures."""

from __future__ import annotations

from typing import Any

from lightning_par3d.callbacks.bottleneck.findings import ReportContext


def calibrate_if_advising(engine: Any, advising: bool) -> Any:
    """The job's machine, measured by every rank at once (:meth:`Par3DEngine.calibrate
    <lightning_par3d.engine.Par3DEngine.calibrate>`), where the report advises; None otherwise."""
    return engine.placement.calibrate() if advising and engine is not None else None


def advise_from_run(
    engine: Any, module: Any, machine: Any, measured_step: Any, context: ReportContext, extra: dict[str, Any]
) -> tuple[list[Any], str | None]:
    """Rank 0: each change's predicted step (:func:`lightning_par3d.planning.advice.advise`, in a fresh
    interpreter), or why there is none."""
    from lightning_par3d.planning.advice import advise
    from lightning_par3d.planning.at_launch import device_memory
    from lightning_par3d.utils.fresh_interpreter import call

    shape = extra.get("input_shape")
    if module is None or shape is None or len(shape) < 2:
        return [], "no copy of the model or no token batch to predict with"
    layout = context.layout
    try:
        advice = call(
            advise, module, engine.config, layout.world_size, context.devices_per_node,
            device_memory(engine.device, context.devices_per_node), measured_step,
            rank_batch=int(shape[0]), seq_len=int(shape[-1]), precision=engine.precision, machine=machine,
            num_workers=context.num_workers, what="the bottleneck report's advice",
        )  # fmt: skip
    except Exception as error:  # the report stands without its predictions
        return [], f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return advice, None


def measured(everyone: list[dict[str, Any]]) -> Any:
    """The run's step as :mod:`lightning_par3d.planning.advice` reads it: every bucket averaged over the ranks, in
    seconds; the noise from the spread of the sampled steps."""
    from lightning_par3d.planning.advice import Measured

    n = len(everyone)

    def mean(*names: str) -> float:
        return sum(r["step"].buckets.get(name, 0.0) for r in everyone for name in names) / n / 1e6

    step = sum(r["step"].cycle_us for r in everyone) / n / 1e6
    accounted = mean("forward", "backward", "optimizer", "tp_comm", "dp_comm", "pipeline")
    cycles = [sum(c) / n / 1e6 for c in zip(*(r["cycles"] for r in everyone), strict=False)]
    noise = (max(cycles) - min(cycles)) / (sum(cycles) / len(cycles)) if len(cycles) > 1 else 0.0
    return Measured(
        step=step,
        compute=mean("forward", "backward", "optimizer"),
        tp_comm=mean("tp_comm"),
        dp_comm=mean("dp_comm"),
        bubble=mean("pipeline"),
        other=max(step - accounted, 0.0),
        dataloader=mean("dataloader"),
        noise=noise,
    )
