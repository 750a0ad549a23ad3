"""Tied parameters (one parameter object held by two modules: a transformers model's input embedding and LM head
with ``tie_word_embeddings``) kept tied through the build.

``nn.Module.to("meta")`` and ``to_empty()`` give each module a new parameter of its own, and so does
``parallelize_module``: each would silently untie the pair on some ranks and not others (rank 0, which built real
weights, against the ranks that built on meta), and FSDP2 would then gather differently sized groups. Every step of
``parallelize`` that replaces parameters is therefore followed by :func:`retie` with the groups found before it.
"""

from __future__ import annotations

from torch import nn

TiedGroup = list[tuple[str, str]]
"""The (module name, parameter attribute) places that hold one parameter object."""


def tied_groups(module: nn.Module) -> list[TiedGroup]:
    """The places in ``module`` that share one parameter object, for every parameter held by more than one module
    (a module registered under two names counts once)."""
    places: dict[int, TiedGroup] = {}
    owners: dict[int, set[int]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None or id(sub) in owners.setdefault(id(param), set()):
                continue
            owners[id(param)].add(id(sub))
            places.setdefault(id(param), []).append((name, attr))
    return [group for group in places.values() if len(group) > 1]


def retie(module: nn.Module, groups: list[TiedGroup]) -> None:
    """Makes every place of each group hold the first place's parameter again."""
    for (first_module, first_attr), *others in groups:
        param = getattr(module.get_submodule(first_module), first_attr)
        for name, attr in others:
            sub = module.get_submodule(name)
            if getattr(sub, attr) is not param:
                sub.register_parameter(attr, param)
