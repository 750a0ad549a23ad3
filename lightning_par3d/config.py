"""The par3d configuration: one typed dataclass and one validation pass.

Everything here is plain Python. :func:`resolve_layout` runs before any process group exists (in the strategy's
constructor and again when the world size is known, before the launcher starts processes), so a bad setting fails
in the launching process with a message that names the value, what is allowed, and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from lightning_par3d.parallel.styles import STYLE_NAMES, unknown_style_message
from lightning_par3d.pipeline.schedules import (
    SCHEDULE_NAMES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    microbatch_problem,
    stage_indices,
    stage_owner,
    stages_per_rank,
)

AC_MODES = ("none", "full", "selective", "op")
"""Activation checkpointing modes (see :mod:`lightning_par3d.parallel.activation_checkpoint`)."""
INIT_MODES = ("rank0", "meta", "pretrained")
LAYOUT_MODES = (None, "auto")
"""``layout=``: the sizes as given (None), or chosen at launch (``"auto"``)."""
ZERO_STAGES = (0, 1, 2, 3)
COMPILE_OPTION_NAMES = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
"""The keywords of ``torch.compile`` that ``compile_options`` may set."""
GRAD_COMPRESSIONS = ("fp16", "bf16", "powersgd")


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
    """Ranks that shard model state among themselves: the ZeRO group, whose ``zero_stage`` says what is sharded.
    ``"auto"`` gives this dimension every rank that the other sizes leave: ``world_size / (pp × dp_replicate ×
    tp)``."""

    zero_stage: int | None = None
    """What the ``dp_shard`` ranks shard (ZeRO, Rajbhandari et al. 2019): 0 nothing (every ``dp_shard`` rank becomes a
    replica: DDP semantics); 1 optimizer state; 2 optimizer state and gradients; 3 everything (FSDP2 full shard).
    None: 3 when ``dp_shard > 1``, else 0. ``dp_replicate`` replicas always hold copies of their shard."""

    dp: int | None = None
    """Shorthand for the whole data-parallel size ``dp_replicate × dp_shard``. With ``dp_shard="auto"`` it sets
    ``dp_shard = dp / dp_replicate``; with an explicit ``dp_shard`` it must agree with the product."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split each planned layer (DTensor). 1 means disabled."""

    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a contiguous part of the model's blocks. 1 means disabled.
    Needs the model to declare ``pipeline_trunk`` and ``pipeline_loss`` (see lightning_par3d.pipeline.trunk)."""

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

    tp_plan: Any = field(default_factory=dict)
    """When not empty, replaces the model's ``tp_plan``: a dict of module-name pattern → style, or ``"auto"`` (the
    plan of the Hugging Face transformers model inside the module). A ``*`` stands for one name segment
    (``"h.*.mlp.c_fc"``). Patterns match whole trailing segments of a module's full name, so a transformers
    ``tp_plan`` or ``base_model_tp_plan`` works unchanged. Styles: see
    :mod:`lightning_par3d.parallel.styles`."""

    fsdp_blocks: str | None = None
    """Module-name pattern of the blocks that FSDP2 wraps one by one before the root (``"transformer.h.*"``).
    None wraps each member of every ``nn.ModuleList``/``nn.ModuleDict`` of repeated same-typed blocks."""

    reshard_after_forward: bool | None = None
    """FSDP2: free the gathered parameters of each block after its forward and gather again for backward (ZeRO-3
    behaviour). False keeps them gathered from forward to backward: more memory, fewer all-gathers. None: True,
    except under pp > 1, where parameters stay gathered across the microbatches of a step."""

    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of keeping them: ``"none"``, ``"full"`` (every block),
    ``"selective"`` (every ``ac_every``-th block), or ``"op"`` (every block, saving only matmul, attention and
    collective outputs). Applied after tensor parallelism and before FSDP2 (see
    lightning_par3d.parallel.activation_checkpoint)."""

    ac_every: int = 2
    """With ``activation_checkpointing="selective"``: checkpoint the 1st, the ``1 + ac_every``-th, … block."""

    ac_blocks: str | None = None
    """The blocks to checkpoint: a module class name (``"Block"``) or a module-name pattern (``"transformer.h.*"``).
    None: each member of the model's containers of repeated blocks."""

    compile: bool = False
    """Compile each repeated block (a transformer layer) in place with ``torch.compile``, after tensor parallelism
    and activation checkpointing and before FSDP2 (torchtitan's order), on every layout, pipeline stages included.
    Parameter and checkpoint names stay as they are, so a compiled run's checkpoint resumes eagerly and the other
    way round (see lightning_par3d.parallel.compile)."""

    compile_options: dict[str, Any] = field(default_factory=dict)
    """With ``compile=True``: keywords for ``torch.compile`` (``mode``, ``fullgraph``, ``dynamic``, ``backend``,
    ``options``). Empty: torch's defaults (the inductor backend)."""

    offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory between uses (FSDP2's ``CPUOffloadPolicy``):
    each block's parameters are copied to the device for its forward and backward, and the optimizer steps on the
    CPU. Needs ``zero_stage=3``."""

    grad_compression: str | None = None
    """Compress the gradient all-reduce of pure replication (DDP: ``zero_stage=0``, tp = pp = 1) with a DDP
    communication hook: ``"fp16"`` or ``"bf16"`` (gradients cast for the all-reduce), or ``"powersgd"`` (low-rank
    approximation with error feedback). None: full-precision all-reduce."""

    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank (``grad_compression="powersgd"``): higher is more exact and sends more."""

    powersgd_start_iter: int = 2
    """PowerSGD sends plain all-reduces for this many steps before compressing (torch needs at least 2 with error
    feedback)."""

    init: str = "rank0"
    """How the model built on the meta device gets its weights. ``"rank0"``: rank 0 builds the real model on CPU
    from the seed (the exact weights a single process gets) and every rank receives only its shards by broadcast;
    no other rank ever holds a full copy. ``"meta"``: no rank builds a full copy; each rank initialises its own
    shards with the modules' ``reset_parameters()``. Faster for huge models, but the values differ from a
    single-process run. ``"pretrained"``: no rank builds a full copy; each rank reads only its own slices of a
    Hugging Face ``save_pretrained`` directory (safetensors) into its shards (:mod:`lightning_par3d.checkpoint.hf`).
    """

    pretrained_path: str | None = None
    """With ``init="pretrained"``: the local ``save_pretrained`` directory to read. None: the directory the
    transformers model's config was loaded from (``AutoConfig.from_pretrained(path)``)."""

    seed: int | None = None
    """If set, every rank is seeded with it right before ``configure_model``. None keeps the seed of
    ``lightning.seed_everything``."""

    timeout_s: float = 1800.0
    """Timeout in seconds of every collective. A rank that waits longer raises instead of hanging."""

    layout: str | None = None
    """``"auto"``: choose the layout at launch. Every rank measures the job's devices and links at once, rank 0 ranks
    every layout of the world with :func:`lightning_par3d.plan` (memory per rank from the estimator, predicted time
    per sample) and every rank trains with the fastest that fits. Sizes and settings set here away from their
    defaults (``tp=2``, ``zero_stage=3``, ``pipeline_schedule="gpipe"``) stay fixed; the others are searched: the
    four sizes, the ZeRO stage, the pipeline schedule and microbatches, activation checkpointing. None: the sizes as
    given."""

    plan_machine: str | None = None
    """With ``layout="auto"``: a hardware profile to predict with (``lightning_par3d.planning.PROFILES``, e.g.
    ``"h100-sxm-8"``) instead of measuring the job's own devices at launch (None)."""

    plan_device_memory: int | str | None = None
    """With ``layout="auto"``: the memory of one device the layout must fit in, bytes or a size (``"40GiB"``).
    None: the device's own (a GPU's total memory; on CPUs the machine's memory shared by its local ranks)."""

    plan_batch: list[int] | None = None
    """With ``layout="auto"``: ``[samples per data-parallel rank, sequence length]`` of a training batch, which the
    planner sizes activations and time by. None: read at launch from the training dataloader (its ``batch_size``
    and the first sample's last dimension; Fabric, which has no dataloader then, needs it given)."""

    elastic: bool = False
    """Train on when the world size changes between launches (torchrun ``--nnodes=MIN:MAX``, or a restart at another
    size): the sizes set here stay where they still divide the world (``pp``, ``tp``), data parallelism takes the
    rest, and a run resumed from a checkpoint keeps the global batch (``accumulate_grad_batches`` adjusted) and the
    epoch's global sample order (:mod:`lightning_par3d.elastic`). The Trainer only, for now."""

    @classmethod
    def from_accelerate(cls, parallelism_config: Any, **fields: Any) -> Par3DConfig:
        """The par3d config of an Accelerate ``ParallelismConfig``: ``dp_replicate_size``, ``dp_shard_size`` and
        ``tp_size`` map onto ``dp_replicate``, ``dp_shard`` and ``tp``; ``fields`` add par3d's own (``pp=2``,
        ``zero_stage=1``, …). Context and sequence parallelism (``cp_size``, ``sp_size`` > 1) are refused."""
        refused = [
            f"{name}={getattr(parallelism_config, name)}"
            for name in ("cp_size", "sp_size")
            if (getattr(parallelism_config, name, 1) or 1) > 1
        ]
        if refused:
            raise ValueError(
                f"par3d does not support context or sequence parallelism yet ({', '.join(refused)}). Set them to 1; "
                "par3d offers pp, dp_replicate, dp_shard and tp."
            )
        mapped = {
            "dp_replicate": getattr(parallelism_config, "dp_replicate_size", None) or 1,
            "dp_shard": getattr(parallelism_config, "dp_shard_size", None) or 1,
            "tp": getattr(parallelism_config, "tp_size", None) or 1,
        }
        return cls(**{**mapped, **fields})

    def __post_init__(self) -> None:
        # Hydra hands over DictConfig nodes; keep plain Python types inside the config.
        if not isinstance(self.tp_plan, (dict, str)):
            self.tp_plan = dict(self.tp_plan.items()) if self.tp_plan else {}
        if not isinstance(self.split_points, list):
            self.split_points = list(self.split_points)
        if not isinstance(self.compile_options, dict) and hasattr(self.compile_options, "items"):
            self.compile_options = dict(self.compile_options.items())
        if self.plan_batch is not None and not isinstance(self.plan_batch, list):
            self.plan_batch = list(self.plan_batch)


def field_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`Par3DConfig` fields among a front-end's keyword parameters (its ``locals()``).

    The front-ends (``Par3DStrategy``, ``Par3DFabricStrategy``, ``Par3DAccelerator``) write every field out as a
    typed keyword with the field's default, so that IDEs, mypy and LightningCLI see them; a list or dict field
    defaults to None there, which stands for the field's own empty default (a fresh one per config, never shared), and
    is left out here. A field missing from ``values`` raises ``KeyError`` naming it."""
    return {
        f.name: values[f.name] for f in fields(Par3DConfig) if values[f.name] is not None or f.default is not MISSING
    }


def changed_settings(settings: Mapping[str, Any]) -> list[str]:
    """The names in ``settings`` whose values differ from the field's default: the settings a user passed."""
    defaults = Par3DConfig()
    return sorted(
        name
        for name, value in settings.items()
        if value != getattr(defaults, name) or type(value) is not type(getattr(defaults, name))
    )


def config_from(owner: str, config: Par3DConfig | None, values: Mapping[str, Any], name: str = "config") -> Par3DConfig:
    """The config of the front-end ``owner``, created with a ``Par3DConfig`` (its argument ``name``) or with the
    config's fields as keywords (``values``: see :func:`field_settings`), not both."""
    settings = field_settings(values)
    if config is None:
        return Par3DConfig(**settings)
    changed = changed_settings(settings)
    if changed:
        raise TypeError(
            f"Pass either a Par3DConfig or its fields to {owner}, not both (got {name} and {', '.join(changed)})."
        )
    return config


DATA_PARALLEL_ENGINES = ("none", "ddp", "fsdp", "zero")
"""What serves the data-parallel dimension: nothing (dp = 1), torch DDP (pure replication without tp or pp),
FSDP2 (ZeRO-3, HSDP, or replication under tp or pp as one unit), or par3d's ZeRO-1/2 optimizer wrapper."""


@dataclass(frozen=True)
class Layout:
    """A run's resolved layout: the sizes of the four mesh dimensions, outermost first, the ZeRO stage, the pipeline
    schedule, and every fact derived from them, computed here once and read by every layer."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero_stage: int | None = None
    """None: the default, 3 when ``dp_shard > 1`` else 0 (see :attr:`zero`)."""
    schedule: str = "1f1b"
    """The pipeline schedule (used under pp > 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank as configured (the V schedules always hold 2: see :attr:`stages_per_rank`)."""
    microbatches: int = 4
    """Microbatches per batch under pp > 1."""
    reshard_after_forward_setting: bool | None = None
    """The configured ``reshard_after_forward``; :attr:`reshard_after_forward` resolves its default."""

    @property
    def zero(self) -> int:
        """The ZeRO stage over ``dp_shard``."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 3 if self.dp_shard > 1 else 0

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The whole data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(pp, dp_replicate, dp_shard, tp)``: the mesh's shape."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    # ---------------------------------------------------------------- data parallel
    @property
    def data_parallel(self) -> str:
        """Which engine serves the data-parallel dimension: one of :data:`DATA_PARALLEL_ENGINES`."""
        if self.dp == 1:
            return "none"
        if self.zero in (1, 2):
            return "zero"
        if self.dp_shard == 1 and self.tp == 1 and self.pp == 1:
            return "ddp"
        return "fsdp"

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's ``reshard_after_forward``: as configured, else True, except under pp, where parameters stay
        gathered across the microbatches of a step."""
        if self.reshard_after_forward_setting is not None:
            return self.reshard_after_forward_setting
        return self.pp == 1

    # ---------------------------------------------------------------- pipeline
    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.schedule, self.virtual_stages) if self.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without pipelining)."""
        return self.pp * self.stages_per_rank

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The global stage indices pipeline rank ``pp_rank`` holds."""
        if self.pp == 1:
            return [0]
        return stage_indices(self.schedule, pp_rank, self.pp, self.virtual_stages)

    @property
    def last_stage_owner(self) -> int:
        """The pipeline rank that holds the last stage (where the loss and the outputs are)."""
        return stage_owner(self.schedule, self.n_stages - 1, self.pp) if self.pp > 1 else 0

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


def _check_init(config: Par3DConfig, errors: _Errors) -> None:
    if config.init not in INIT_MODES:
        errors.add(f"init={config.init!r} is not an init mode. Allowed: {', '.join(map(repr, INIT_MODES))}.")
    if config.pretrained_path is not None and config.init != "pretrained":
        errors.add(
            f"pretrained_path={config.pretrained_path!r} is set but init={config.init!r}: set init='pretrained' to "
            "load it, or drop pretrained_path."
        )


def _check_auto(config: Par3DConfig, errors: _Errors) -> None:
    if config.layout not in LAYOUT_MODES:
        errors.add(
            f"layout={config.layout!r} is not a layout mode. Allowed: None (the sizes as given) or 'auto' (chosen at "
            "launch by lightning_par3d.plan)."
        )
        return
    planning = {name: getattr(config, name) for name in ("plan_machine", "plan_device_memory", "plan_batch")}
    given = [f"{name}={value!r}" for name, value in planning.items() if value is not None]
    if config.layout is None and given:
        errors.add(
            f"{', '.join(given)} set, but layout=None: they tell layout='auto' how to plan. Set layout='auto', or "
            "drop them."
        )
    batch = config.plan_batch
    if batch is not None and (
        len(batch) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in batch)
    ):
        errors.add(
            f"plan_batch={batch!r} must be [samples per data-parallel rank, sequence length], two positive integers "
            "(e.g. [8, 2048])."
        )


def _check_static(config: Par3DConfig, errors: _Errors) -> None:
    """Checks that need no world size."""
    _check_auto(config, errors)
    _check_positive_int(errors, "tp", config.tp, "tensor-parallel degree")
    _check_positive_int(errors, "pp", config.pp, "pipeline-parallel degree")
    _check_positive_int(errors, "dp_replicate", config.dp_replicate, "data-parallel replicas")
    if config.dp_shard != "auto":
        _check_positive_int(errors, "dp_shard", config.dp_shard, "data-parallel shard size, or 'auto'")
    if config.dp is not None:
        _check_positive_int(errors, "dp", config.dp, "whole data-parallel size")
    _check_pipeline(config, errors)
    _check_init(config, errors)
    if not isinstance(config.timeout_s, (int, float)) or config.timeout_s <= 0:
        errors.add(f"timeout_s={config.timeout_s!r} must be a positive number of seconds.")
    _check_zero_static(config, errors)
    if config.activation_checkpointing not in AC_MODES:
        errors.add(
            f"activation_checkpointing={config.activation_checkpointing!r} is not a mode. Allowed: "
            f"{', '.join(map(repr, AC_MODES))}."
        )
    _check_positive_int(errors, "ac_every", config.ac_every, "checkpoint every n-th block under 'selective'")
    _check_compile(config, errors)
    if isinstance(config.tp_plan, dict):
        for pattern, style in config.tp_plan.items():
            if style not in STYLE_NAMES:
                errors.add(unknown_style_message(pattern, style))
    elif config.tp_plan != "auto":
        errors.add(
            f"tp_plan={config.tp_plan!r} must be a dict of module-name pattern → style, or 'auto' (the transformers "
            "model's own plan)."
        )


def _check_compile(config: Par3DConfig, errors: _Errors) -> None:
    if not isinstance(config.compile, bool):
        errors.add(f"compile={config.compile!r} must be True or False.")
    options = config.compile_options
    if not isinstance(options, dict):
        errors.add(
            f"compile_options={options!r} must be a dict of torch.compile keywords ({', '.join(COMPILE_OPTION_NAMES)})."
        )
        return
    unknown = sorted(set(options) - set(COMPILE_OPTION_NAMES))
    if unknown:
        errors.add(
            f"compile_options has {', '.join(map(repr, unknown))}, which torch.compile does not take. Allowed: "
            f"{', '.join(COMPILE_OPTION_NAMES)}."
        )
    if options and not config.compile:
        errors.add(f"compile_options={options!r} set, but compile=False. Set compile=True, or drop compile_options.")


def _check_zero_static(config: Par3DConfig, errors: _Errors) -> None:
    stage = config.zero_stage
    if stage is not None and (isinstance(stage, bool) or stage not in ZERO_STAGES):
        errors.add(
            f"zero_stage={stage!r} is not a ZeRO stage. Allowed: 0 (replicate everything, DDP), 1 (shard optimizer "
            "state), 2 (shard optimizer state and gradients), 3 (shard everything, FSDP2), or None (3 when "
            "dp_shard > 1)."
        )
    if config.grad_compression is not None and config.grad_compression not in GRAD_COMPRESSIONS:
        errors.add(
            f"grad_compression={config.grad_compression!r} is not a compression. Allowed: "
            f"{', '.join(map(repr, GRAD_COMPRESSIONS))}, or None."
        )
    _check_positive_int(errors, "powersgd_rank", config.powersgd_rank, "PowerSGD approximation rank")
    if isinstance(config.powersgd_start_iter, bool) or not isinstance(config.powersgd_start_iter, int):
        errors.add(f"powersgd_start_iter={config.powersgd_start_iter!r} must be an integer ≥ 2.")
    elif config.powersgd_start_iter < 2:
        errors.add(
            f"powersgd_start_iter={config.powersgd_start_iter} must be at least 2 (torch's PowerSGD with error "
            "feedback needs plain all-reduces first). Set it to 2 or more."
        )


def _check_zero_layout(config: Par3DConfig, layout: Layout, errors: _Errors) -> None:
    """Checks of the ZeRO stage, offload and compression against the resolved sizes."""
    stage = layout.zero
    if config.zero_stage in (1, 2, 3) and layout.dp_shard == 1:
        errors.add(
            f"zero_stage={config.zero_stage} shards across the dp_shard ranks, but dp_shard=1 here ({layout}): there "
            "is nothing to shard over. Give dp_shard the data-parallel ranks (e.g. dp_shard=auto, dp_replicate=1), "
            "or use zero_stage=0."
        )
    if stage == 2 and layout.pp > 1:
        errors.add(
            f"zero_stage=2 reduce-scatters gradients in every backward pass, and a pipeline step runs one per "
            f"microbatch (pp={layout.pp}). Use zero_stage=1 (one all-reduce per step) or zero_stage=3 (FSDP2, "
            "gradients reduced once after the last microbatch)."
        )
    if config.reshard_after_forward is not None and stage != 3:
        errors.add(
            f"reshard_after_forward={config.reshard_after_forward} applies to FSDP2 (zero_stage=3), but zero_stage="
            f"{stage} keeps parameters whole. Remove reshard_after_forward, or use zero_stage=3."
        )
    if config.offload and stage != 3:
        errors.add(
            f"offload=True moves the shards of parameters, gradients and optimizer state to CPU memory (FSDP2's "
            f"CPUOffloadPolicy), which needs zero_stage=3; here zero_stage={stage}. Use zero_stage=3 with "
            "dp_shard > 1, or drop offload."
        )
    ddp = stage == 0 and layout.tp == 1 and layout.pp == 1 and layout.dp > 1
    if config.grad_compression is not None and not ddp:
        errors.add(
            f"grad_compression={config.grad_compression!r} compresses DDP's gradient all-reduce, which par3d runs "
            f"for pure replication only (zero_stage=0, tp=1, pp=1, more than one replica); here zero_stage={stage}, "
            f"{layout}. Remove grad_compression, or replicate (e.g. zero_stage=0 with tp=1 and pp=1)."
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
    problem = microbatch_problem(name, m, pp, v)
    if problem is not None:
        errors.add(problem)


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
    if config.layout == "auto":
        raise ValueError(
            "layout='auto' is chosen at launch, once the model and the batch are known (Par3DEngine.choose_layout, "
            "which the strategies call): resolve the configuration it returns, or plan beforehand with "
            "lightning_par3d.plan(...)."
        )
    dp_shard = _resolve_dp_shard(config, world_size, errors)
    layout = Layout(
        pp=config.pp,
        dp_replicate=config.dp_replicate,
        dp_shard=dp_shard,
        tp=config.tp,
        zero_stage=config.zero_stage,
        schedule=config.pipeline_schedule,
        virtual_stages=config.virtual_stages,
        microbatches=config.microbatches,
        reshard_after_forward_setting=config.reshard_after_forward,
    )
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
    if not errors.messages:
        _check_zero_layout(config, layout, errors)
    errors.raise_if_any()
    if layout.zero == 0 and layout.dp_shard > 1:
        # Stage 0 shards nothing: the dp_shard ranks are replicas like dp_replicate's.
        layout = replace(layout, dp_replicate=layout.dp_replicate * layout.dp_shard, dp_shard=1, zero_stage=0)
    return layout
