"""The par3d settings: :class:`Par3DConfig`, the one place each setting is written (its name, type, default and
meaning), and how the front-ends take its fields as keywords (:func:`field_keywords`, :func:`config_from`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar, get_type_hints

F = TypeVar("F", bound=Callable[..., Any])

AC_MODES = ("none", "full", "selective", "op")
"""Activation checkpointing modes (see :mod:`lightning_par3d.parallel.activation_checkpoint`)."""
INIT_MODES = ("rank0", "meta", "pretrained")
LAYOUT_MODES = (None, "auto")
"""``layout=``: the sizes as given (None), or chosen at launch (``"auto"``)."""
ZERO_STAGES = (0, 1, 2, 3)
COMPILE_OPTION_NAMES = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")
"""The keywords of ``torch.compile`` that ``compile_options`` may set."""
GRAD_COMPRESSIONS = ("fp16", "bf16", "powersgd")
LOSS_MEANS = ("tokens", "microbatches")
"""``loss_mean=``: the global batch's token mean, or the mean of each microbatch's own mean."""


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

    ep: int = 1
    """Expert-parallel degree: a mixture-of-experts model's experts split over ``ep`` ranks taken from ``dp_shard``
    (it adds no ranks; ``ep`` must divide ``dp_shard``). Each rank holds ``num_experts / ep`` whole experts; the
    routed tokens go to the rank that holds their expert and back by all-to-all. The experts are sharded by FSDP2
    over the ``dp_shard / ep`` ranks (and replicated over ``dp_replicate``) that hold the same experts. The experts
    are found by the transformers model's own expert-parallel plan (``base_model_ep_plan``). With ``tp > 1`` and the
    model's own tp plan, each expert is also cut over tp (``moe_tp_experts``). 1 means disabled."""

    cp: int = 1
    """Context-parallel degree: each sequence split over ``cp`` ranks, for sequences too long for one rank's
    activations. The ``cp`` ranks read the same rows and each holds ``1 / cp`` of every row's tokens, load-balanced
    for the causal mask (chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp``); attention gathers the keys and values of the
    whole sequence and masks them by the tokens' global positions, so that it computes what one process computes,
    with padding (``attention_mask``) and packed rows (``position_ids`` restarting per document). It adds ranks:
    ``world = pp × dp_replicate × dp_shard × cp × tp``; FSDP2 shards over ``dp_shard × cp``. The sequence length
    must divide by ``2·cp`` (see lightning_par3d.parallel.context_parallel). 1 means disabled."""

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
    :mod:`lightning_par3d.config.tp_vocabulary`."""

    fsdp_blocks: str | None = None
    """Module-name pattern of the blocks that FSDP2 wraps one by one before the root (``"transformer.h.*"``).
    None wraps each member of every ``nn.ModuleList``/``nn.ModuleDict`` of repeated same-typed blocks."""

    reshard_after_forward: bool | None = None
    """FSDP2: free the gathered parameters of each block after its forward and gather again for backward (ZeRO-3
    behaviour). False keeps them gathered from forward to backward: more memory, fewer all-gathers. None: True,
    except under pp > 1, where parameters stay gathered across the microbatches of a step."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism over the tp ranks: the residual stream between the tensor-parallel regions
    (norms, dropouts, residual additions) is split along the sequence, so its activations take ``1 / tp`` of the
    memory, for the same communication volume. The plan (the model's own or ``tp_plan``, written without it) gets
    its sequence-parallel entries derived (see lightning_par3d.parallel.sequence_parallel); the sequence length must
    divide by tp. Needs tp > 1 (under ``layout="auto"``, nothing changes where the chosen tp is 1)."""

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

    async_save: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``): a save copies this rank's
    shards to CPU memory and training goes on while a thread writes them; the checkpoint takes its name (``last.ckpt``
    included) only once every rank's shards are written, the previous one staying until then. The next save, a load
    and the end of training wait for a save still in flight. Costs a CPU copy of the rank's model and optimizer
    shards while it writes."""

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
    Hugging Face ``save_pretrained`` directory (safetensors) into its shards
    (:mod:`lightning_par3d.checkpoint.pretrained`).
    """

    pretrained_path: str | None = None
    """With ``init="pretrained"``: the local ``save_pretrained`` directory to read. None: the directory the
    transformers model's config was loaded from (``AutoConfig.from_pretrained(path)``)."""

    adapter_path: str | None = None
    """With ``init="pretrained"`` and a ``peft`` model: the local directory of its saved adapters (peft's
    ``save_pretrained``: ``adapter_model.safetensors``), each rank reading only its slices, as the base's. None:
    the adapters start fresh, drawn as peft initializes them (``lora_B`` zero) from the seed and each adapter's name,
    the same at every layout (:func:`~lightning_par3d.checkpoint.peft_files.init_fresh_adapters`)."""

    loss_mean: str = "tokens"
    """What the step's loss and gradient average over. ``"tokens"``: the global batch's token mean, the sum of the
    token losses over every pipeline microbatch, data-parallel rank and batch of the accumulation window divided by
    their real-token count (targets equal to ``ignore_index`` do not count), as one process computes it on the whole
    global batch, whatever the layout. par3d sees the loss where it can scale it (a LightningModule's declared
    ``pipeline_loss``, a transformers model's own ``loss_function``, the ``loss_fn`` of Fabric's and Accelerate's
    ``train_step``), counts the real tokens of its targets, and multiplies its mean by the count over the global
    batch's (see lightning_par3d.engine.tokens). ``"microbatches"``: the mean over microbatches and ranks of each
    one's own mean (what DDP does); the two agree where every microbatch holds as many real tokens."""

    ignore_index: int = -100
    """With ``loss_mean="tokens"``: the target value of positions the loss ignores (padding), as in
    ``F.cross_entropy(..., ignore_index=-100)`` and transformers' losses."""

    loss_tokens: str | int | None = None
    """With ``loss_mean="tokens"`` and gradient accumulation: where a training batch holds the targets its loss
    counts (a key of a dict batch, or an index of a tuple batch), read ahead for each accumulation window. None: a
    dict's ``"labels"``, else a tuple's last element; for a transformers model computing its own loss from
    ``labels``, those shifted by one, as it shifts them."""

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

    global_batch: int | None = None
    """With ``layout="auto"``: the samples of one optimizer step over every data-parallel rank, which every layout
    the planner weighs keeps, so that the layout changes the speed and never the training math. None: the training
    dataloader's ``batch_size`` × the data-parallel size the configuration names without ``"auto"`` (``dp`` if set,
    else the world size ÷ the ``tp`` × ``pp`` set here) × ``accumulate_grad_batches``. Under the Trainer the chosen
    layout takes it as its own per-rank batch and ``accumulate_grad_batches`` (the planner takes the fewest
    accumulated batches whose per-rank batch fits; the dataloader is re-made with that ``batch_size``); under Fabric
    and Accelerate, whose loops accumulate as the user writes them, as one batch per data-parallel rank."""

    measure: int | None = None
    """With ``layout="auto"``: train ``measure`` of the layouts the planner predicts fastest (its first choice, then
    the fastest of each next kind: pp, tp and data-parallel engine) for a few steps each, in the job's own
    processes, and keep the fastest measured (``lightning_par3d.planning.measuring``; the run starts from
    what it would have had without measuring). None: 3 where the front-end has a batch to measure with at launch
    (the Trainer, Accelerate), else none (Fabric plans before any dataloader). 0: train the predicted fastest. Costs
    about ``measure × 4`` steps and a model build each, once per launch."""

    plan_batch: list[int] | None = None
    """With ``layout="auto"``: ``[samples per data-parallel rank, sequence length]`` of a training batch, which the
    planner sizes activations and time by. None: read at launch from the training dataloader (its ``batch_size``
    and the first sample's last dimension; Fabric, which has no dataloader then, needs it given)."""

    elastic: bool = False
    """Train on when the world size changes between launches (torchrun ``--nnodes=MIN:MAX``, or a restart at another
    size): the sizes set here stay where they still divide the world (``pp``, ``tp``), data parallelism takes the
    rest, and a run resumed from a checkpoint keeps the global batch (``accumulate_grad_batches`` adjusted) and the
    epoch's global sample order (:mod:`lightning_par3d.engine.elastic`). The Trainer only, for now."""

    @classmethod
    def from_accelerate(cls, parallelism_config: Any, **fields: Any) -> Par3DConfig:
        """The par3d config of an Accelerate ``ParallelismConfig``: ``dp_replicate_size``, ``dp_shard_size``,
        ``cp_size`` and ``tp_size`` map onto ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``; ``fields`` add par3d's
        own (``pp=2``, ``zero_stage=1``, …). DeepSpeed-Ulysses sequence parallelism (``sp_size`` > 1) is refused:
        par3d splits long sequences with ``cp``."""
        sp = getattr(parallelism_config, "sp_size", 1) or 1
        if sp > 1:
            raise ValueError(
                f"par3d does not offer DeepSpeed-Ulysses sequence parallelism (sp_size={sp}). Set sp_size=1 and split "
                "long sequences with context parallelism instead (cp_size, par3d's cp=...)."
            )
        mapped = {
            "dp_replicate": getattr(parallelism_config, "dp_replicate_size", None) or 1,
            "dp_shard": getattr(parallelism_config, "dp_shard_size", None) or 1,
            "tp": getattr(parallelism_config, "tp_size", None) or 1,
            "cp": getattr(parallelism_config, "cp_size", None) or 1,
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


def field_keywords(init: F) -> F:
    """Gives a front-end's ``__init__(self, config=None, *, ..., **settings)`` the :class:`Par3DConfig` fields as
    typed keyword-only parameters in its signature (``inspect.signature``, which IDEs, ``help()`` and LightningCLI's
    jsonargparse read), each with the field's default (None for a list or dict field: its own empty default, fresh
    per config). The fields are written once, in the dataclass; the front-end receives them in ``settings`` and
    picks them out with :func:`split_settings`. A front-end that takes other keywords too (``Par3DAccelerator``:
    Accelerate's) keeps its ``**kwargs`` after the fields."""
    hints = get_type_hints(Par3DConfig)
    parameters = list(inspect.signature(init).parameters.values())
    own = [p for p in parameters if p.kind is not p.VAR_KEYWORD]
    rest = [p for p in parameters if p.kind is p.VAR_KEYWORD and p.name != "settings"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [
        inspect.Parameter(f.name, keyword, default=_keyword_default(f), annotation=hints[f.name])
        for f in fields(Par3DConfig)
    ]
    init.__signature__ = inspect.Signature([*own, *added, *rest], return_annotation=None)  # type: ignore[attr-defined]
    init.__annotations__ = {**init.__annotations__, **{f.name: hints[f.name] for f in fields(Par3DConfig)}}
    return init


def _keyword_default(f: Field[Any]) -> Any:
    return None if f.default is MISSING else f.default


def split_settings(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``keywords`` split into (:class:`Par3DConfig` fields, everything else)."""
    names = {f.name for f in fields(Par3DConfig)}
    return {k: v for k, v in keywords.items() if k in names}, {k: v for k, v in keywords.items() if k not in names}


def config_from(
    owner: str, config: Par3DConfig | None, settings: Mapping[str, Any], name: str = "config"
) -> Par3DConfig:
    """The config of the front-end ``owner``: the ``Par3DConfig`` given as its argument ``name``, or one made of
    ``settings`` (its fields as keywords; None for a list or dict field means the field's own empty default), not
    both. An unknown keyword raises ``TypeError`` naming it and the fields."""
    known = {f.name: f for f in fields(Par3DConfig)}
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(
            f"{owner} got unknown keyword argument(s) {', '.join(map(repr, unknown))}. The par3d settings are "
            f"Par3DConfig's fields: {', '.join(known)}."
        )
    given = explicit_settings(settings)
    if config is None:
        return Par3DConfig(**given)
    changed = changed_settings(given)
    if changed:
        raise TypeError(
            f"Pass either a Par3DConfig or its fields to {owner}, not both (got {name} and {', '.join(changed)})."
        )
    return config


def explicit_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without the Nones that stand for a list or dict field's own empty default."""
    factory = {f.name for f in fields(Par3DConfig) if f.default is MISSING}
    return {k: v for k, v in settings.items() if not (v is None and k in factory)}


def changed_settings(settings: Mapping[str, Any]) -> list[str]:
    """The names in ``settings`` whose values differ from the field's default: the settings a user passed."""
    defaults = Par3DConfig()
    return sorted(
        name
        for name, value in settings.items()
        if value != getattr(defaults, name) or type(value) is not type(getattr(defaults, name))
    )
