"""Tensor parallelism: find the plan, check it against the model, apply it with ``parallelize_module``.

A plan maps module-name patterns to style strings (:mod:`lightning_par3d.config.tp_vocabulary`). ``*`` stands
for one name segment, and a pattern matches the trailing segments of a module's full name, so the plan
``{"h.*.attn.c_attn": "colwise"}`` matches ``model.transformer.h.0.attn.c_attn``, and a transformers model's
``base_model_tp_plan`` works from whatever attribute the LightningModule keeps the model in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_par3d.config.tp_vocabulary import (
    OWNER_STYLES,
    PACK,
    PARAMETER_STYLES,
    SPLITTING_STYLES,
    STYLE_NAMES,
    canonical,
    unknown_style_message,
)
from lightning_par3d.parallel.ties import tied_groups
from lightning_par3d.parallel.tp_styles import build_style, split_size
from lightning_par3d.utils.patterns import is_transformers_model, matches
from lightning_par3d.utils.torch_private import dtensor_local

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

# Attribute names under which models keep their attention head counts; tp must divide each of them.
HEAD_COUNT_ATTRS = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_head", "n_kv_heads")


def find_plan(module: nn.Module, override: Mapping[str, str] | str | None) -> dict[str, str]:
    """The plan to apply: the config's override, else the module's ``tp_plan`` attribute or ``tp_plan()`` hook.
    ``"auto"`` (either place) means the plan of the Hugging Face transformers model inside ``module``."""
    if override == "auto":
        return transformers_plan(module)
    if override:
        return dict(override)  # type: ignore[arg-type]
    plan = getattr(module, "tp_plan", None)
    if callable(plan):
        plan = plan()
    if plan is None:
        return {}
    if plan == "auto":
        return transformers_plan(module)
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{type(module).__name__}.tp_plan must be a dict of module-name pattern → style string, a method "
            f"returning one, or 'auto' (the transformers model's own plan); got {type(plan).__name__}."
        )
    return dict(plan)


class ModelsOwnPlan(dict[str, str]):
    """The plan a transformers model declares for itself (``tp_plan="auto"``). It is written for every config of
    its architecture, so an entry for a kind of module this config lacks (the dense MLP entries of an all-sparse
    mixture-of-experts config) is skipped, where a user's own plan must match (a typo there is caught)."""


def transformers_plan(module: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of the outermost Hugging Face transformers model in ``module`` (its ``tp_plan``:
    the config's ``base_model_tp_plan`` plus the head's rules), with its keys prefixed by where it lives: a
    :class:`ModelsOwnPlan`."""
    for name, sub in module.named_modules():
        plan = getattr(sub, "tp_plan", None) if is_transformers_model(sub) else None
        if isinstance(plan, Mapping) and plan:
            return ModelsOwnPlan({f"{name}.{key}" if name else key: style for key, style in plan.items()})
    raise ValueError(
        f"tp_plan='auto' takes the plan of a Hugging Face transformers model, but {type(module).__name__} holds none "
        "with a tp_plan. Give the plan as a dict (module-name pattern → style) instead."
    )


def expand_plan(module: nn.Module, plan: Mapping[str, str], allow_missing: bool = False) -> dict[str, str]:
    """Maps each module full name matched by a pattern of ``plan`` to its style, and each parameter full name
    matched by a pattern that matches no module (``experts.gate_up_proj``) to its own (see
    :func:`parameter_entries`).

    Raises ``ValueError`` for an unknown style, a pattern that matches nothing (unless ``allow_missing``: a
    pipeline stage holds only part of a plan checked against the whole model; or the plan is the model's own,
    :class:`ModelsOwnPlan`, whose entries for modules this config lacks are skipped, said at debug level), a module
    matched by two patterns with different styles, and a parameter entry whose style splits no parameter or whose
    module's style does not run on local shards.
    """
    names = [name for name, _ in module.named_modules() if name]
    params = [
        f"{name}.{p}" for name, sub in module.named_modules() if name for p, _ in sub.named_parameters(recurse=False)
    ]
    expanded: dict[str, str] = {}
    problems: list[str] = []
    skipped: list[str] = []
    for pattern, style in plan.items():
        if style not in STYLE_NAMES:
            problems.append(unknown_style_message(pattern, style))
            continue
        hits = [name for name in names if matches(pattern, name)] or [p for p in params if matches(pattern, p)]
        if not hits and isinstance(plan, ModelsOwnPlan):
            skipped.append(pattern)
        elif not hits and not allow_missing:
            sample = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
            problems.append(
                f"tp_plan pattern {pattern!r} matches no module of {type(module).__name__}. "
                f"Module names look like: {sample}. Fix the pattern or remove it."
            )
        for name in hits:
            if canonical(expanded.get(name, style)) != canonical(style):
                problems.append(f"module {name!r} is matched with two styles, {expanded[name]!r} and {style!r}.")
            expanded[name] = style
    problems += _parameter_entry_problems(expanded, set(names))
    if problems:
        raise ValueError("Invalid tensor-parallel plan:\n" + "\n".join(f"  - {p}" for p in problems))
    if skipped:
        log.debug("The model's own tensor-parallel plan: no module of this config matches %s; skipped.", skipped)
    return expanded


def parameter_entries(fqn_styles: Mapping[str, str], modules: Mapping[str, nn.Module]) -> dict[str, dict[str, str]]:
    """The entries of an expanded plan that name parameters, by the full name of the module holding them: owner →
    {parameter name → style}."""
    owned: dict[str, dict[str, str]] = {}
    for name, style in fqn_styles.items():
        if name not in modules:
            owner, _, param = name.rpartition(".")
            owned.setdefault(owner, {})[param] = canonical(style)
    return owned


def _parameter_entry_problems(expanded: Mapping[str, str], modules: set[str]) -> list[str]:
    problems = []
    owners = {name.rpartition(".")[0] for name in expanded if name not in modules}
    for name, style in expanded.items():
        if name in modules:
            if canonical(style) == "moe_tp_experts" and name not in owners:
                problems.append(
                    f"{name!r} has style 'moe_tp_experts', which runs a mixture-of-experts block's experts on the "
                    "shards of its 3-D weights that entries naming them split ('experts.gate_up_proj': "
                    "'packed_colwise', 'experts.down_proj': 'rowwise'); the plan names none of its parameters."
                )
            continue
        owner = name.rpartition(".")[0]
        if canonical(style) not in PARAMETER_STYLES:
            problems.append(
                f"{name!r} is a parameter; an entry naming a parameter splits it with one of "
                f"{', '.join(map(repr, PARAMETER_STYLES))}, not {style!r}."
            )
        elif canonical(expanded.get(owner, "")) not in OWNER_STYLES:
            problems.append(
                f"the plan splits the parameter {name!r}, but its module {owner!r} has "
                f"{repr(expanded[owner]) if owner in expanded else 'no entry'}: give it a style that runs on local "
                f"shards ({' or '.join(map(repr, OWNER_STYLES))})."
            )
    return problems


def check_divisibility(module: nn.Module, fqn_styles: Mapping[str, str], tp: int) -> None:
    """Raises ``ValueError`` where ``tp`` does not divide a dimension the plan splits or an attention head count."""
    problems: list[str] = []
    modules = dict(module.named_modules())
    for name, style in fqn_styles.items():
        if name not in modules:  # an entry naming a parameter
            problems += _parameter_split_problems(name, module.get_parameter(name), canonical(style), tp)
            continue
        sub = modules[name]
        if style in SPLITTING_STYLES:
            split = split_size(style, sub)
            if split is None:
                problems.append(
                    f"{name!r} is a {type(sub).__name__}; style {style!r} applies to nn.Linear and nn.Embedding."
                )
            elif split[1] % tp:
                problems.append(
                    f"tp={tp} does not divide {name}.{split[0]}={split[1]} that style {style!r} splits. "
                    f"Choose tp among {_divisors(split[1])}, or resize the layer."
                )
    for name, sub in modules.items():
        owners = [(sub, name)]
        if is_transformers_model(sub):  # a transformers model keeps its head counts in its config
            owners.append((sub.config, f"{name}.config" if name else f"{type(sub).__name__}.config"))
        for owner, where in owners:
            problems += _head_count_problems(owner, where or type(sub).__name__, tp)
    if problems:
        raise ValueError("Tensor parallelism cannot split this model:\n" + "\n".join(f"  - {p}" for p in problems))


def _parameter_split_problems(name: str, param: torch.Tensor, style: str, tp: int) -> list[str]:
    dim = PARAMETER_STYLES[style]
    if param.dim() < -dim:
        return [f"{name!r} has {param.dim()} dimension(s); style {style!r} splits its dimension {dim}."]
    size = param.shape[dim] // (PACK if style.startswith("packed") else 1)
    if size % tp:
        return [f"tp={tp} does not divide {name} dimension {dim} ({size}) that style {style!r} splits. "
                f"Choose tp among {_divisors(size)}."]  # fmt: skip
    return []


def _head_count_problems(owner: Any, where: str, tp: int) -> list[str]:
    problems = []
    for attr in HEAD_COUNT_ATTRS:
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            problems.append(
                f"tp={tp} does not divide the head count {where}.{attr}={value}: each tensor-parallel rank must hold "
                f"whole attention heads. Choose tp among {_divisors(value)}."
            )
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, fqn_styles: Mapping[str, str]) -> None:
    """Shards ``module`` in place over ``tp_mesh`` with ``parallelize_module``, one style per planned submodule.

    Works on the meta device: no data moves until the model is materialized.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if not fqn_styles or tp_mesh.size() == 1:
        return
    modules = dict(module.named_modules())
    owned = parameter_entries(fqn_styles, modules)
    plan = {
        name: build_style(style, modules[name], owned.get(name, {}))
        for name, style in fqn_styles.items()
        if name in modules
    }
    parallelize_module(module, tp_mesh, plan)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a DTensor (the storage FSDP2 and DCP use too, with no autograd in between:
    :func:`~lightning_par3d.utils.torch_private.dtensor_local`), or ``t``."""
    from torch.distributed.tensor import DTensor

    return dtensor_local(t) if isinstance(t, DTensor) else t


def match_param_layout(param: torch.Tensor) -> None:
    """Gives a DTensor parameter's gradient the parameter's own placements. A vocabulary-parallel embedding's
    gradient comes back replicated (the whole vocabulary on every tp rank); cutting it to the parameter's shard is a
    local slice, and it keeps each rank's gradient the size of its parameter."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def keep_grads_in_param_layout(module: nn.Module) -> int:
    """Registers :func:`match_param_layout` on every DTensor parameter of ``module`` (for layouts where no FSDP2
    unit does it); returns how many."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if isinstance(p, DTensor) and p.requires_grad]
    for param in params:
        param.register_post_accumulate_grad_hook(match_param_layout)
    return len(params)


_WEIGHT_SHARD = {
    "linear": {
        "colwise": 0,
        "colwise_gather_output": 0,
        "colwise_seq": 0,
        "colwise_seq_gather_output": 0,
        "rowwise": 1,
        "rowwise_split_input": 1,
    },
    "embedding": {"rowwise": 0, "rowwise_split_input": 0, "embedding_rowwise": 0, "colwise": 1, "embedding_colwise": 1},
}
"""The weight dim each style shards, per module kind (the rowwise_seq input side is left out: a tied weight must
be usable by every holder)."""
_TRANSPARENT = {
    ("linear", 0): "colwise_gather_output",
    ("linear", 1): "rowwise_split_input",
    ("embedding", 0): "embedding_rowwise",
    ("embedding", 1): "embedding_colwise",
}
"""For a tied module the plan leaves out: the style that shards its weight like its planned twin's while its inputs
and outputs stay whole, as if it were not parallelized."""


def plan_tied_weights(module: nn.Module, fqn_styles: dict[str, str]) -> dict[str, str]:
    """``fqn_styles`` with the tied twins of planned modules planned too: a weight shared by two modules must be one
    DTensor, sharded alike for both. A transformers plan shards ``lm_head`` (``colwise_gather_output``) but not the
    input embedding it is tied to; the embedding then gets ``embedding_rowwise`` (the same vocabulary shard; its
    output, all-reduced, is the unsplit embedding). Raises ``ValueError`` for twins the plan shards differently."""
    import torch.nn as tnn

    planned = dict(fqn_styles)
    modules = dict(module.named_modules(remove_duplicate=False))
    problems = []
    for group in tied_groups(module):
        styled = [(name, canonical(planned[name])) for name, _ in group if name in planned]
        if not styled:
            continue
        kinds = {name: _kind(modules[name], tnn) for name, _ in group}
        dims = {(name, _WEIGHT_SHARD.get(kinds[name] or "", {}).get(style)) for name, style in styled}
        shards = {dim for _, dim in dims}
        if len(shards) != 1 or None in shards or any(attr != "weight" or kinds[name] is None for name, attr in group):
            where = ", ".join(f"{name}.{attr} ({planned.get(name, 'not in the plan')})" for name, attr in group)
            problems.append(
                f"tied weights {where} would be sharded differently by tensor parallelism. Give the modules matching "
                "styles (an embedding 'embedding_rowwise' with an LM head 'colwise_gather_output'), or untie them "
                "(transformers: tie_word_embeddings=False)."
            )
            continue
        dim = shards.pop()
        for name, _ in group:
            planned.setdefault(name, _TRANSPARENT[(kinds[name], dim)])  # type: ignore[index]
    if problems:
        raise ValueError("Invalid tensor-parallel plan:\n" + "\n".join(f"  - {p}" for p in problems))
    return planned


def _kind(module: nn.Module, tnn: Any) -> str | None:
    if isinstance(module, tnn.Embedding):
        return "embedding"
    if isinstance(module, tnn.Linear):
        return "linear"
    return None
