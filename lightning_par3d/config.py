"""The par3d configuration: one typed dataclass and one validation pass.

Everything here is plain Python. :func:`resolve_layout` runs before any process group exists (in the strategy's
constructor and again when the world size is known, before the launcher starts processes), so a bad setting fails
in the launching process with a message that names the value, what is allowed, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_par3d.pipeline_split import SCHEDULE_NAMES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from lightning_par3d.tensor_parallel_styles import STYLE_NAMES

INIT_MODES = ("rank0", "meta")


@dataclass
class Par3DConfig:
    """Every setting of the par3d strategy.

    The mesh has four named dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. Their
    product must equal the world size (``devices × num_nodes``). Tensor-parallel peers are adjacent ranks, so with
    ``devices`` per node a ``tp`` that divides ``devices`` keeps tensor parallelism inside a node.
    """

    dp_replicate: int = 1
    """Model replicas in the data-parallel group (HSDP's outer dimension). Gradients are all-reduced across
    replicas. With ``dp_shard=1`` this is plain replicated data parallel (DDP semantics)."""

    dp_shard: int | str = "auto"
    """Ranks that shard parameters, gradients and optimizer state with FSDP2 ``fully_shard``. ``"auto"`` gives
    this dimension every rank that the other sizes leave: ``world_size / (pp × dp_replicate × tp)``."""

    dp: int | None = None
    """Shorthand for the whole data-parallel size ``dp_replicate × dp_shard``. With ``dp_shard="auto"`` it sets
    ``dp_shard = dp / dp_replicate``; with an explicit ``dp_shard`` it must agree with the product."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split each planned layer (DTensor). 1 means disabled."""

    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a contiguous part of the model's blocks. 1 means disabled.
    Needs the LightningModule to declare ``pipeline_trunk`` and ``pipeline_loss`` (see lightning_par3d.pipeline)."""

    pipeline_schedule: str = "1f1b"
    """The torch.distributed.pipelining schedule: ``gpipe``, ``1f1b`` (one stage per rank),
    ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble`` (``virtual_stages`` per rank),
    ``zbv_zero_bubble``, ``dualpipev`` (two stages per rank in a V)."""

    microbatches: int = 4
    """Microbatches per batch under pp > 1; the per-rank batch size must be a multiple of it."""

    virtual_stages: int = 1
    """Model chunks (stages) per pipeline rank: 1 for ``gpipe``/``1f1b``, 2 for the V schedules, any for the
    looped and interleaved ones."""

    split_points: list[str] = field(default_factory=list)
    """Block names where stages 2, 3, … begin (``["transformer.h.2"]``). Empty: split the blocks automatically,
    balancing parameter counts with the embedding on the first stage and the head on the last."""

    tp_plan: dict[str, str] = field(default_factory=dict)
    """When not empty, replaces the LightningModule's ``tp_plan``: module-name pattern → style. A ``*`` stands for
    one name segment (``"h.*.mlp.c_fc"``). Patterns match whole trailing segments of a module's full name, so a
    Hugging Face ``base_model_tp_plan`` works unchanged. Styles: see :data:`STYLE_NAMES`."""

    fsdp_blocks: str | None = None
    """Module-name pattern of the blocks that FSDP2 wraps one by one before the root (``"transformer.h.*"``).
    None wraps each member of every ``nn.ModuleList``/``nn.ModuleDict`` of repeated same-typed blocks."""

    reshard_after_forward: bool | None = None
    """FSDP2: free the gathered parameters of each block after its forward and gather again for backward (ZeRO-3
    behaviour). False keeps them gathered from forward to backward: more memory, fewer all-gathers. None: True,
    except under pp > 1, where parameters stay gathered across the microbatches of a step."""

    init: str = "rank0"
    """How the model built on the meta device gets its weights. ``"rank0"``: rank 0 builds the real model on CPU
    from the seed (the exact weights a single process gets) and every rank receives only its shards by broadcast;
    no other rank ever holds a full copy. ``"meta"``: no rank builds a full copy; each rank initialises its own
    shards with the modules' ``reset_parameters()``. Faster for huge models, but the values differ from a
    single-process run."""

    seed: int | None = None
    """If set, every rank is seeded with it right before ``configure_model``. None keeps the seed of
    ``lightning.seed_everything``."""

    timeout_s: float = 1800.0
    """Timeout in seconds of every collective. A rank that waits longer raises instead of hanging."""

    def __post_init__(self) -> None:
        # Hydra hands over DictConfig nodes; keep plain Python types inside the config.
        if not isinstance(self.tp_plan, dict):
            self.tp_plan = dict(self.tp_plan.items()) if self.tp_plan else {}
        if not isinstance(self.split_points, list):
            self.split_points = list(self.split_points)


@dataclass(frozen=True)
class Layout:
    """The resolved sizes of the four mesh dimensions, outermost first."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The whole data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def __str__(self) -> str:
        return f"pp={self.pp} × dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard} × tp={self.tp}"


@dataclass
class _Errors:
    messages: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.messages.append(message)

    def raise_if_any(self) -> None:
        if self.messages:
            lines = "\n".join(f"  - {m}" for m in self.messages)
            raise ValueError(f"Invalid par3d configuration:\n{lines}")


def _check_positive_int(errors: _Errors, name: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        errors.add(f"{name}={value!r} must be a positive integer ({meaning}). Use 1 to disable it.")


def _check_static(config: Par3DConfig, errors: _Errors) -> None:
    """Checks that need no world size."""
    _check_positive_int(errors, "tp", config.tp, "tensor-parallel degree")
    _check_positive_int(errors, "pp", config.pp, "pipeline-parallel degree")
    _check_positive_int(errors, "dp_replicate", config.dp_replicate, "data-parallel replicas")
    if config.dp_shard != "auto":
        _check_positive_int(errors, "dp_shard", config.dp_shard, "data-parallel shard size, or 'auto'")
    if config.dp is not None:
        _check_positive_int(errors, "dp", config.dp, "whole data-parallel size")
    _check_pipeline(config, errors)
    if config.init not in INIT_MODES:
        errors.add(f"init={config.init!r} is not an init mode. Allowed: {', '.join(map(repr, INIT_MODES))}.")
    if not isinstance(config.timeout_s, (int, float)) or config.timeout_s <= 0:
        errors.add(f"timeout_s={config.timeout_s!r} must be a positive number of seconds.")
    for pattern, style in (config.tp_plan or {}).items():
        if style not in STYLE_NAMES:
            errors.add(
                f"tp_plan[{pattern!r}]={style!r} is not a tensor-parallel style. "
                f"Allowed: {', '.join(map(repr, STYLE_NAMES))}."
            )


def _check_pipeline(config: Par3DConfig, errors: _Errors) -> None:
    name, m, v, pp = config.pipeline_schedule, config.microbatches, config.virtual_stages, config.pp
    if name not in SCHEDULE_NAMES:
        errors.add(f"pipeline_schedule={name!r} is not a schedule. Allowed: {', '.join(map(repr, SCHEDULE_NAMES))}.")
    _check_positive_int(errors, "microbatches", m, "microbatches per batch under pp")
    _check_positive_int(errors, "virtual_stages", v, "stages per pipeline rank")
    if errors.messages or not isinstance(pp, int) or pp == 1:
        return
    if name in SINGLE_STAGE_SCHEDULES and v != 1:
        errors.add(
            f"pipeline_schedule={name!r} runs one stage per rank, but virtual_stages={v}. Set virtual_stages=1, or "
            "use interleaved_1f1b, looped_bfs or interleaved_zero_bubble for several stages per rank."
        )
    if name in V_SCHEDULES and v != 2:
        errors.add(
            f"pipeline_schedule={name!r} is a V schedule: it needs exactly 2 stages per rank, but virtual_stages={v}."
            " Set virtual_stages=2."
        )
    stages = pp * v
    if name in ("1f1b", *V_SCHEDULES) and m < stages:
        errors.add(
            f"microbatches={m} is fewer than the {stages} pipeline stages that {name!r} needs at least. "
            f"Raise microbatches to {stages} or more (more microbatches also shrink the bubble)."
        )
    if name in ("interleaved_1f1b", "interleaved_zero_bubble") and m >= pp and m % (m // pp):
        errors.add(
            f"microbatches={m}: {name!r} runs microbatches in rounds of pp={pp}, so microbatches must be a multiple "
            f"of {m // pp}. Use a multiple of pp, e.g. {pp * max(1, m // pp)}."
        )


def _resolve_dp_shard(config: Par3DConfig, world_size: int, errors: _Errors) -> int:
    fixed = config.pp * config.dp_replicate * config.tp
    if config.dp_shard != "auto":
        return int(config.dp_shard)
    if config.dp is not None:
        if config.dp % config.dp_replicate:
            errors.add(
                f"dp={config.dp} is not divisible by dp_replicate={config.dp_replicate}. "
                "Choose dp as a multiple of dp_replicate."
            )
            return 1
        return config.dp // config.dp_replicate
    if world_size % fixed:
        errors.add(
            f"dp_shard='auto' needs the world size ({world_size}) to be divisible by "
            f"pp × dp_replicate × tp = {config.pp} × {config.dp_replicate} × {config.tp} = {fixed}. "
            f"Choose sizes whose product divides {world_size}, or change devices/num_nodes."
        )
        return 1
    return world_size // fixed


def resolve_layout(config: Par3DConfig, world_size: int | None = None) -> Layout | None:
    """Validates ``config`` and returns the mesh sizes for ``world_size``.

    All problems are collected and raised together as one ``ValueError`` that lists each bad value, what is
    allowed and the fix. Without a world size only the world-independent checks run and None is returned.
    """
    errors = _Errors()
    _check_static(config, errors)
    if world_size is None or errors.messages:
        errors.raise_if_any()
        return None
    dp_shard = _resolve_dp_shard(config, world_size, errors)
    layout = Layout(pp=config.pp, dp_replicate=config.dp_replicate, dp_shard=dp_shard, tp=config.tp)
    if config.dp is not None and layout.dp != config.dp:
        errors.add(
            f"dp={config.dp} disagrees with dp_replicate × dp_shard = {layout.dp_replicate} × {layout.dp_shard} "
            f"= {layout.dp}. Set only one of them, or make them agree."
        )
    if not errors.messages and layout.world_size != world_size:
        errors.add(
            f"pp × dp_replicate × dp_shard × tp = {layout.pp} × {layout.dp_replicate} × {layout.dp_shard} × "
            f"{layout.tp} = {layout.world_size}, but the world size (devices × num_nodes) is {world_size}. "
            f"Change the sizes so that their product is {world_size}, or set dp_shard='auto'."
        )
    errors.raise_if_any()
    return layout
