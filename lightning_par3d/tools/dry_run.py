"""``dry_run(...)``: the whole training step of chosen ranks of an N-rank layout, each in a process of its own on
this machine, over torch's fake process group.

Each chosen rank runs in a fresh interpreter (:mod:`lightning_par3d.utils.fresh_interpreter`) that joins a fake world of
``world_size`` processes as that rank (``init_process_group("fake", rank=r, world_size=N)``: collectives and
pipeline sends move nothing and return at once). There it does what the rank of a real run does, through the same
engine:

1. the mesh of the layout, ``configure_model`` under the engine's build context, and ``Par3DEngine.parallelize``:
   the rank's own shards, real tensors, initialised by each module's ``reset_parameters`` (``init="rank0"`` would
   wait for rank 0's broadcast, which the fake world does not carry; ``init="pretrained"`` reads the rank's slices
   from the checkpoint as a run does);
2. the optimizers of ``configure_optimizers``, through ``Par3DEngine.setup_optimizers`` (ZeRO wrappers included);
3. ``steps`` training steps on the given batch: ``training_step`` (the pipeline schedule inside it under pp), the
   backward, the optimizer step;
4. the save plan of a sharded checkpoint of the model and optimizer state (``torch.distributed.checkpoint``'s
   ``DefaultSavePlanner``: what this rank would write), without writing anything.

It catches what the configuration checks cannot see: a shape that does not divide inside the model, code that
breaks under DTensor, a schedule that cannot be built; the error raised is the one the real run raises, with the
rank named. It measures the rank's memory as :class:`~lightning_par3d.callbacks.MemoryStats` measures a run's:
parameters, gradients and optimizer state counted from the rank's tensors before the optimizer step, activations as
the peak of what autograd saves, and on CUDA the allocator's peak.

The values the rank computes are not a real run's (its peers' shares never arrive), so losses are not reported as
training results; shapes, dtypes, memory and the code path are the real ones.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.distributed.fakeworld import collector_paused

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class DryRunRank:
    """What one rank did and held in the dry run, in bytes."""

    rank: int
    coordinates: dict[str, int]
    """The rank's place on each mesh dimension (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``)."""
    params: int
    grads: int
    optimizer: int
    activations_peak: int
    """The peak of the bytes autograd kept saved for backward in a step."""
    cuda_peak: int | None
    """``torch.cuda.max_memory_allocated`` on a GPU, else None."""
    saved_items: int
    """Entries in the rank's part of the checkpoint's save plan."""
    saved_bytes: int
    """Bytes this rank would write in a sharded checkpoint (model and optimizer state)."""
    seconds: float
    """The rank's steps, wall-clock (its build excluded)."""

    @property
    def peak(self) -> int:
        """Model state plus the activations' peak, as ``MemoryStats``' ``total_peak``."""
        return self.params + self.grads + self.optimizer + self.activations_peak


@dataclasses.dataclass(frozen=True)
class DryRun:
    """The dry run of chosen ranks of a layout."""

    layout: Layout
    ranks: list[DryRunRank]
    steps: int

    def __str__(self) -> str:
        def mib(n: int | None) -> str:
            return "-" if n is None else f"{n / MIB:,.1f}"

        header = ["rank", "pp", "dp_r", "dp_s", "tp", "params", "grads", "optim", "activ", "peak", "cuda peak", "saves"]
        lines = [
            f"par3d dry run: {self.layout} ({self.layout.world_size} ranks), {self.steps} step(s) of each rank below "
            "in a process of its own, over a fake process group. Memory in MiB.",
            "  ".join(f"{h:>9}" for h in header),
        ]
        for r in self.ranks:
            c = r.coordinates
            cells = [str(r.rank), *(str(c[d]) for d in ("pp", "dp_replicate", "dp_shard", "tp"))]
            cells += [mib(v) for v in (r.params, r.grads, r.optimizer, r.activations_peak, r.peak, r.cuda_peak)]
            cells.append(f"{r.saved_items} ({mib(r.saved_bytes)})")
            lines.append("  ".join(f"{cell:>9}" for cell in cells))
        return "\n".join(lines)


def default_ranks(layout: Layout) -> list[int]:
    """The first rank of every pipeline stage (pp is the mesh's outermost dimension)."""
    per_stage = layout.world_size // layout.pp
    return [p * per_stage for p in range(layout.pp)]


def dry_run(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    world_size: int,
    batch: Any,
    *,
    ranks: Sequence[int] | None = None,
    precision: str = "32-true",
    device: str = "cpu",
    steps: int = 1,
    loss_fn: Callable[..., Tensor] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    timeout_s: float = 600.0,
) -> DryRun:
    """Runs ``steps`` whole training steps of ``ranks`` (default: the first rank of every pipeline stage) of the
    layout ``config`` on ``world_size`` ranks, one fresh process per rank, here; see the module docstring.

    ``module`` is a LightningModule (not yet configured; its ``configure_model``, ``training_step`` and
    ``configure_optimizers`` run) or a factory of an ``nn.Module`` (then ``loss_fn(outputs, targets)``, ``batch`` is
    ``(inputs, targets)`` and ``optimizer(parameters)`` makes the optimizer, AdamW by default). ``batch`` is one
    data-parallel rank's batch, as its dataloader gives it (``global batch / dp`` samples). ``device`` is ``"cpu"``
    or ``"cuda"`` (one GPU plays each rank in turn).

    The configuration is checked here first (its usual errors). An error in a rank's run is raised again here, of
    its own type, with a note naming the rank.
    """
    from lightning_par3d.utils.fresh_interpreter import call

    layout = resolve_layout(config, world_size)
    assert layout is not None
    chosen = list(default_ranks(layout) if ranks is None else ranks)
    wrong = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if wrong or not chosen:
        raise ValueError(f"dry_run(ranks={list(chosen)!r}): give ranks from 0 to {world_size - 1} (world_size).")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"dry_run(steps={steps!r}): give 1 or more steps.")
    results = []
    for rank in chosen:
        try:
            arguments = (module, config, world_size, rank, batch, precision, device, steps, loss_fn, optimizer)
            what = f"the dry run of rank {rank} of {world_size}"
            results.append(call(run_rank, *arguments, what=what, timeout_s=timeout_s))
        except BaseException as error:
            error.add_note(f"par3d dry run: rank {rank} of {world_size} at {layout} failed.")
            raise
    return DryRun(layout, results, steps)


# ---------------------------------------------------------------- in the rank's own process


@collector_paused()  # planning makes millions of short-lived objects: see lightning_par3d.distributed.fakeworld
def run_rank(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    world_size: int,
    rank: int,
    batch: Any,
    precision: str,
    device_type: str,
    steps: int,
    loss_fn: Callable[..., Tensor] | None,
    optimizer: Callable[[Any], Any] | None,
) -> DryRunRank:
    """Rank ``rank`` of a fake world: build, step and plan the save, as the module docstring says. Call it in a
    process without a process group (``dry_run`` gives it a fresh one)."""
    from lightning_par3d.engine import Par3DEngine
    from lightning_par3d.engine.trial import module_optimizers, to_device
    from lightning_par3d.memory.meters import SavedTensorMeter, model_state_bytes

    dist.init_process_group("fake", rank=rank, world_size=world_size)
    _hear_no_objects()
    try:
        torch.manual_seed(config.seed if config.seed is not None else 0)
        run_config = dataclasses.replace(config, init="meta") if config.init == "rank0" else config
        engine = Par3DEngine(run_config, precision)
        engine.resolve(world_size, device_type)
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
        engine.setup(device, "fake")
        batch = to_device(batch, device)
        model, step = _build(engine, module, batch, loss_fn)
        optimizers = engine.setup_optimizers(module_optimizers(model, engine.module, optimizer))
        meter = SavedTensorMeter()
        state = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        for index in range(steps):
            with meter:
                step(batch, index)
            state = model_state_bytes(engine.module, optimizers)  # before the step: parameters, gradients, state
            for opt in optimizers:
                opt.step()
            state_after = model_state_bytes(engine.module, optimizers)  # the optimizer state the first step made
            state = dataclasses.replace(state, optimizer=max(state.optimizer, state_after.optimizer))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        items, nbytes = _save_plan(engine, optimizers)
        assert state is not None
        cuda_peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        coordinates = dataclasses.asdict(engine.mesh.coords(rank))
        return DryRunRank(
            rank, coordinates, state.params, state.grads, state.optimizer, meter.peak, cuda_peak, items, nbytes,
            seconds,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def _hear_no_objects() -> None:
    """In this process only: ``broadcast_object_list`` leaves every rank's objects as they are. Over the fake
    backend it would otherwise read a size no peer sent; where a run's ranks take rank 0's choice (its RNG state,
    whether it built the weights), a dry run's rank keeps its own, which under ``init="meta"`` is the same."""

    def keep_own(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
        return None

    dist.broadcast_object_list = keep_own


def _build(
    engine: Any, module: nn.Module | Callable[[], nn.Module], batch: Any, loss_fn: Callable[..., Tensor] | None
) -> tuple[nn.Module, Callable[[Any, int], None]]:
    """The parallelized model and the function that runs one step's forward and backward on a batch
    (:func:`~lightning_par3d.engine.trial.build_step`); under pp, the stages' shapes set from the batch first (the
    fake process group cannot carry those the stages exchange at a run's first step)."""
    from lightning_par3d.engine.trial import build_step
    from lightning_par3d.parallel.precision import built_in
    from lightning_par3d.pipeline.runner import STATIC_STAGE_IO
    from lightning_par3d.utils.torch_private import skip_pipeline_metadata_vote

    if isinstance(module, nn.Module) and engine.layout.pp > 1:
        with built_in(engine.precision):  # the stages' shapes and dtypes as the run's (bf16 under bf16-true)
            STATIC_STAGE_IO.update(stage_io(module, engine.config, engine.layout, batch))
        skip_pipeline_metadata_vote()
    return build_step(engine, module, loss_fn)


class _TrunkReached(Exception):
    """Raised by the hook that captures the trunk's inputs, to stop the meta forward there."""


def stage_io(module: nn.Module, config: Par3DConfig, layout: Layout, batch: Any) -> dict[int, Any]:
    """Every pipeline stage's example inputs and outputs for one microbatch, as meta tensors: the module is built
    on meta, its ``training_step`` runs on a meta microbatch up to the trunk (whose inputs are captured there), and
    the stages the run's own split makes run one after another from them."""
    from lightning_par3d.compose import sequence_shards
    from lightning_par3d.pipeline.trunk import declared_pipeline
    from lightning_par3d.planning.probe import build_meta, split

    root = build_meta(module)
    trunk = getattr(root, declared_pipeline(root).trunk)
    captured: list[tuple[Any, ...]] = []

    def capture(_module: nn.Module, args: tuple[Any, ...]) -> None:
        captured.append(args)
        raise _TrunkReached

    microbatch = _to_meta(batch, layout.microbatches)
    hook = trunk.register_forward_pre_hook(capture)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root.training_step(microbatch, 0)  # type: ignore[operator]
    except _TrunkReached:
        pass
    finally:
        hook.remove()
    if not captured:
        raise RuntimeError("The dry run could not find the pipeline trunk's inputs: training_step never called it.")
    io: dict[int, Any] = {}
    inputs = tuple(a for a in captured[0] if isinstance(a, Tensor))
    stages = split(module, config, layout).stages
    for index, stage in enumerate(stages):
        output = stage(*inputs)  # with autograd: torch marks what needs gradients from requires_grad
        outputs = output if isinstance(output, tuple) else (output,)
        if index < len(stages) - 1:  # sequence parallelism: a rank sends its sequence shard of the hidden states
            outputs = tuple(_sequence_shard(o, sequence_shards(config, layout)) for o in outputs)
        io[index] = (inputs, outputs)
        inputs = tuple(o.detach().requires_grad_(o.is_floating_point()) for o in outputs)
    return io


def _sequence_shard(t: Tensor, shards: int) -> Tensor:
    """One rank's share of hidden states (batch, sequence, hidden) split ``shards`` ways along the sequence."""
    if shards == 1 or t.dim() < 3:
        return t
    shard = torch.empty((t.shape[0], t.shape[1] // shards, *t.shape[2:]), dtype=t.dtype, device=t.device)
    return shard.requires_grad_(t.requires_grad)


def _to_meta(batch: Any, microbatches: int) -> Any:
    """``batch`` on meta, each tensor's first dimension divided into ``microbatches``."""
    if isinstance(batch, Tensor):
        shape = (batch.shape[0] // microbatches, *batch.shape[1:]) if batch.dim() else batch.shape
        return torch.empty(shape, dtype=batch.dtype, device="meta")
    if isinstance(batch, dict):
        return {k: _to_meta(v, microbatches) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_meta(v, microbatches) for v in batch)
    return batch


def _save_plan(engine: Any, optimizers: list[Any]) -> tuple[int, int]:
    """The entries and bytes of this rank's local save plan for the model and optimizer state (nothing written)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    state: dict[str, Any] = {"model": engine.model_state()}
    for index, opt in enumerate(optimizers):
        state[f"optimizer_{index}"] = engine.optimizer_state(opt)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, engine.rank == 0)
    plan = planner.create_local_plan()
    nbytes = 0
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        sizes = item.tensor_data.chunk.sizes
        numel = 1
        for size in sizes:
            numel *= int(size)
        nbytes += numel * item.tensor_data.properties.dtype.itemsize
    return len(plan.items), nbytes
