"""What the ``par3d`` commands share: ``key=value`` arguments, and the user's model and data built from the command
line (a class named ``package.module:Class``, or, for a model, the Hydra app's model config)."""

from __future__ import annotations

import ast
import importlib
import os
import sys
import textwrap
from typing import Any


def example_of(doc: str | None) -> str:
    """A command's ``--help`` epilog: the example block of its module docstring (the second paragraph)."""
    block = (doc or "").split("\n\n")[1]
    return "example:\n" + textwrap.indent(textwrap.dedent(block).strip(), "  ")


def parse_pairs(items: str | list[str], what: str) -> dict[str, Any]:
    """``"pp=2,dp_shard=2,tp=2"``, or a list of such items (a repeated ``--model-arg``), as a dict of Python values
    (``"2"`` → 2, ``"[8, 64]"`` → a list, anything else stays a string). Raises ``ValueError`` naming ``what``."""
    text = ",".join(items) if isinstance(items, list) else items
    pairs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in _split_top_level(text))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} {item!r}: write key=value, e.g. tp=2.")
        try:
            pairs[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            pairs[key.strip()] = raw.strip()
    return pairs


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (``plan_batch=[8, 64],tp=2`` is two items)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def load_object(spec: str, what: str) -> Any:
    """The object ``package.module:Name`` names, imported with the working directory first on the path (a user's
    project, run from its folder). Raises ``ValueError`` naming ``what`` (the option) and the fix."""
    path, sep, name = spec.partition(":")
    if not sep or not path or not name:
        raise ValueError(f"{what} {spec!r}: write package.module:Class, e.g. examples.gpt:GPTModule.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        owner = importlib.import_module(path)  # the user's module, named on the command line
    except ImportError as error:
        raise ValueError(f"{what} {spec!r}: cannot import {path!r} ({error}). Run from the project's folder.") from None
    found = getattr(owner, name, None)
    if found is None:
        raise ValueError(f"{what} {spec!r}: {path} has no {name!r}.")
    return found


def build_model(module: str | None, model_config: str | None, arguments: dict[str, Any]) -> Any:
    """The LightningModule of ``--module package.module:Class`` or of ``--model-config FILE.yaml`` (a Hydra model
    config: its ``_target_`` and arguments, as the Hydra app builds it), built with ``arguments`` on top."""
    if (module is None) == (model_config is None):
        raise ValueError("Give the model as either --module package.module:Class or --model-config FILE.yaml.")
    if module is not None:
        return load_object(module, "--module")(**arguments)
    assert model_config is not None
    return _from_hydra_config(model_config, arguments)


def _from_hydra_config(path: str, arguments: dict[str, Any]) -> Any:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if not os.path.isfile(path):
        raise ValueError(f"--model-config {path!r}: no such file (a Hydra model config, e.g. conf/model/gpt.yaml).")
    config = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(arguments))
    if "_target_" not in config:
        raise ValueError(f"--model-config {path!r} has no _target_: it must name the model class, as Hydra's do.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return instantiate(config)


def describe_model(module: Any) -> str:
    """``examples.gpt.GPTModule: 0.87 M parameters; blocks: model.transformer.h: 4 × Block``: the model as built (on
    the meta device, no memory), for a person to check that a command works on the model they mean."""
    from lightning_par3d.planning.probe import build_meta
    from lightning_par3d.utils.patterns import repeated_members

    built = build_meta(module)
    params = sum(p.numel() for p in built.parameters())
    containers = [(name, members) for name, sub in built.named_modules() if (members := repeated_members(sub))]
    blocks = ", ".join(f"{name}: {len(members)} × {type(members[0]).__name__}" for name, members in containers)
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}: {params / 1e6:,.2f} M parameters; blocks: {blocks or 'none found'}"
