"""Module-name patterns, shared by the tensor-parallel plan and the FSDP block selection.

A pattern is a dotted module name in which ``*`` stands for exactly one segment. It matches a module when it equals
the trailing segments of the module's full name: ``"h.*.mlp"`` matches ``model.transformer.h.3.mlp``.
"""

from __future__ import annotations

from torch import nn


def matches(pattern: str, fqn: str) -> bool:
    """Whether ``pattern`` matches the trailing segments of the module name ``fqn``."""
    want, have = pattern.split("."), fqn.split(".")
    if len(want) > len(have):
        return False
    return all(w in ("*", h) for w, h in zip(want, have[len(have) - len(want) :], strict=True))


def find_modules(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The (full name, module) pairs below ``module`` that ``pattern`` matches, in registration order."""
    return [(name, sub) for name, sub in module.named_modules() if name and matches(pattern, name)]


def repeated_members(module: nn.Module) -> list[nn.Module]:
    """The members of an ``nn.ModuleList`` or ``nn.ModuleDict`` that holds two or more modules of one type (a
    transformer's blocks; pipeline placeholders of the blocks another stage holds do not count); empty for anything
    else."""
    if isinstance(module, nn.ModuleDict):
        members = list(module.values())
    elif isinstance(module, nn.ModuleList):
        members = list(module)
    else:
        return []
    members = [m for m in members if type(m).__name__ != "NotOnThisStage"]
    return members if len(members) > 1 and len({type(m) for m in members}) == 1 else []


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face transformers model (a ``PreTrainedModel``), found without importing
    transformers."""
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(module).__mro__
    )


def find_transformers_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost Hugging Face transformers model in ``module`` (``module`` itself included), with its name."""
    for name, sub in module.named_modules():
        if is_transformers_model(sub):
            return name, sub
    return None


def is_peft_model(module: nn.Module) -> bool:
    """A ``peft`` model (what ``get_peft_model`` returns, a ``PeftModel``), found without importing peft."""
    return hasattr(module, "peft_config") and callable(getattr(module, "get_base_model", None))


def find_peft_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost ``peft`` model in ``module`` (``module`` itself included), with its name."""
    for name, sub in module.named_modules():
        if is_peft_model(sub):
            return name, sub
    return None
