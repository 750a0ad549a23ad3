"""One validation pass over a :class:`~lightning_par3d.config.settings.Par3DConfig`, and the layout it resolves to.

Everything here is plain Python. :func:`resolve_layout` runs before any process group exists (in the strategy's
constructor and again when the world size is known, before the launcher starts processes), so a bad setting fails
in the launching process with a message that names the value, what is allowed, and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_par3d.config.layout import Layout
from lightning_par3d.config.schedules import SCHEDULE_NAMES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES, microbatch_problem
from lightning_par3d.config.settings import (
    AC_MODES,
    COMPILE_OPTION_NAMES,
    GRAD_COMPRESSIONS,
    INIT_MODES,
    LAYOUT_MODES,
    LOSS_MEANS,
    ZERO_STAGES,
    Par3DConfig,
)
from lightning_par3d.config.tp_vocabulary import STYLE_NAMES, unknown_style_message


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
    if config.adapter_path is not None and config.init != "pretrained":
        errors.add(
            f"adapter_path={config.adapter_path!r} is set but init={config.init!r}: set init='pretrained' to start "
            "from the saved adapters on the pretrained base, or drop adapter_path."
        )
    elif config.adapter_path is not None and not (Path(config.adapter_path) / "adapter_model.safetensors").is_file():
        errors.add(
            f"adapter_path={config.adapter_path!r} holds no adapter_model.safetensors: give the directory peft's "
            "save_pretrained (or par3d's SavePretrained on a peft model) wrote."
        )
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
    names = ("plan_machine", "plan_device_memory", "plan_batch", "global_batch", "measure")
    planning = {name: getattr(config, name) for name in names}
    given = [f"{name}={value!r}" for name, value in planning.items() if value is not None]
    if config.layout is None and given:
        errors.add(
            f"{', '.join(given)} set, but layout=None: they tell layout='auto' how to plan. Set layout='auto', or "
            "drop them."
        )
    if config.global_batch is not None and (
        isinstance(config.global_batch, bool) or not isinstance(config.global_batch, int) or config.global_batch < 1
    ):
        errors.add(f"global_batch={config.global_batch!r} must be a positive number of samples per optimizer step.")
    if config.measure is not None and (
        isinstance(config.measure, bool) or not isinstance(config.measure, int) or config.measure < 0
    ):
        errors.add(
            f"measure={config.measure!r} must be how many of the fastest predicted layouts to measure: 0 or more "
            "(0: none; None: 3 where a batch is at hand)."
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
    _check_expert_static(config, errors)
    _check_context_static(config, errors)
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
    _check_sequence_parallel(config, errors)
    _check_loss_mean(config, errors)
    if isinstance(config.tp_plan, dict):
        for pattern, style in config.tp_plan.items():
            if style not in STYLE_NAMES:
                errors.add(unknown_style_message(pattern, style))
    elif config.tp_plan != "auto":
        errors.add(
            f"tp_plan={config.tp_plan!r} must be a dict of module-name pattern → style, or 'auto' (the transformers "
            "model's own plan)."
        )


def _check_sequence_parallel(config: Par3DConfig, errors: _Errors) -> None:
    if not isinstance(config.sequence_parallel, bool):
        errors.add(f"sequence_parallel={config.sequence_parallel!r} must be True or False.")
    elif config.sequence_parallel and config.tp == 1 and config.layout != "auto":
        errors.add(
            "sequence_parallel=True splits the sequence over the tensor-parallel ranks, but tp=1. Set tp > 1, or "
            "sequence_parallel=False."
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


def _check_loss_mean(config: Par3DConfig, errors: _Errors) -> None:
    if config.loss_mean not in LOSS_MEANS:
        errors.add(
            f"loss_mean={config.loss_mean!r} is not a loss mean. Allowed: 'tokens' (the global batch's token mean) or "
            "'microbatches' (the mean of each microbatch's own mean)."
        )
    if isinstance(config.ignore_index, bool) or not isinstance(config.ignore_index, int):
        errors.add(f"ignore_index={config.ignore_index!r} must be an integer (the ignored target value, e.g. -100).")
    tokens = config.loss_tokens
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, (str, int))):
        errors.add(
            f"loss_tokens={tokens!r} must be a key of a dict batch ('labels'), an index of a tuple batch (-1), or None."
        )


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
    if config.zero_stage in (1, 2, 3) and layout.shard_ranks == 1:
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


def _check_expert_static(config: Par3DConfig, errors: _Errors) -> None:
    _check_positive_int(errors, "ep", config.ep, "expert-parallel degree, taken from dp_shard")


def _check_context_static(config: Par3DConfig, errors: _Errors) -> None:
    """Context parallelism and what it does not compose with yet, each refused with its fix."""
    _check_positive_int(errors, "cp", config.cp, "context-parallel degree: ranks that split each sequence")
    if not isinstance(config.cp, int) or isinstance(config.cp, bool) or config.cp <= 1:
        return
    cp = config.cp
    refusals = {
        f"loss_mean={config.loss_mean!r}": (config.loss_mean != "tokens", "each rank holds a slice of every row, and "
                                            "only the token mean weighs the slices as one process does: use "
                                            "loss_mean='tokens'"),
        f"zero_stage={config.zero_stage}": (config.zero_stage in (0, 1, 2), "the context-parallel ranks' gradients "
                                             "are reduce-scattered by FSDP2 over dp_shard × cp: use zero_stage=3 "
                                             "(the default)"),
    }  # fmt: skip
    for setting, (refused, fix) in refusals.items():
        if refused:
            errors.add(f"cp={cp} with {setting}: {fix}.")


def _check_expert_layout(layout: Layout, errors: _Errors) -> None:
    """Expert parallelism takes its ranks from ``dp_shard``, whose FSDP2 shards what the experts' ranks leave."""
    ep = layout.ep
    if ep == 1:
        return
    if layout.shard_ranks % ep:
        within = f"dp_shard × cp = {layout.shard_ranks}" if layout.cp > 1 else f"dp_shard={layout.dp_shard}"
        errors.add(
            f"ep={ep} splits the experts over ranks taken from dp_shard{' × cp' if layout.cp > 1 else ''}, but "
            f"{within} is not a multiple of {ep} ({layout}). Make dp_shard a multiple of ep (e.g. dp_shard={ep * 2} "
            f"or dp_shard={ep}), or choose an ep that divides it."
        )
    elif layout.zero != 3:
        errors.add(
            f"ep={ep} runs under FSDP2 (zero_stage=3), which shards the experts over the ranks that hold the same "
            f"ones and reduces each expert's gradient over exactly those; here zero_stage={layout.zero}. Use "
            "zero_stage=3 (the default with dp_shard > 1)."
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
    fixed = config.pp * config.dp_replicate * config.tp * config.cp
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
            f"pp × dp_replicate × {'cp × ' if config.cp > 1 else ''}tp = {config.pp} × {config.dp_replicate} × "
            f"{f'{config.cp} × ' if config.cp > 1 else ''}{config.tp} = {fixed}. "
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
        ep=config.ep,
        cp=config.cp,
    )
    if config.dp is not None and layout.dp != config.dp:
        errors.add(
            f"dp={config.dp} disagrees with dp_replicate × dp_shard = {layout.dp_replicate} × {layout.dp_shard} "
            f"= {layout.dp}. Set only one of them, or make them agree."
        )
    if not errors.messages and layout.world_size != world_size:
        cp_name, cp_size = ("cp × ", f"{layout.cp} × ") if layout.cp > 1 else ("", "")
        errors.add(
            f"pp × dp_replicate × dp_shard × {cp_name}tp = {layout.pp} × {layout.dp_replicate} × {layout.dp_shard} × "
            f"{cp_size}{layout.tp} = {layout.world_size}, but the world size (devices × num_nodes) is {world_size}. "
            f"Change the sizes so that their product is {world_size}, or set dp_shard='auto'."
        )
    if not errors.messages:
        _check_zero_layout(config, layout, errors)
        _check_expert_layout(layout, errors)
    errors.raise_if_any()
    if layout.zero == 0 and layout.dp_shard > 1:
        # Stage 0 shards nothing: the dp_shard ranks are replicas like dp_replicate's.
        layout = replace(layout, dp_replicate=layout.dp_replicate * layout.dp_shard, dp_shard=1, zero_stage=0)
    return layout
