"""PEFT LoRA adapters under tensor parallelism: a plan entry on a LoRA-wrapped layer, split as its base layer is.

``peft.get_peft_model`` replaces each targeted ``nn.Linear`` by a LoRA layer that holds the original as
``base_layer`` and the adapters as ``lora_A[<adapter>]`` (``in → r``) and ``lora_B[<adapter>]`` (``r → out``), and
computes ``base_layer(x) + lora_B(lora_A(dropout(x))) · scaling``. A model's own tensor-parallel plan (or yours)
names the layer itself (``layers.*.self_attn.q_proj``), which is now the wrapper. :func:`adapter_plan` moves each
such entry to the base layer and splits the adapters so that the two terms agree, with no collective of their own
beyond the base layer's kind:

* a column-wise base layer (its output split, or gathered): ``lora_A`` whole on every rank (its input is whole),
  ``lora_B`` in the base layer's style (its output columns split, or gathered, as the base layer's);
* a row-wise base layer (its input split, the outputs summed): ``lora_A`` in the base layer's style (its input
  columns split, the ``r`` outputs summed), ``lora_B`` whole (its input, the summed ``r`` features, is whole);
* under sequence parallelism, a row-wise base into sequence shards (``rowwise_seq``): ``lora_A`` as the base,
  ``lora_B`` whole with its gradient summed over tp (``replicated_with_grad_allreduce``: it sees this rank's tokens
  only); a column-wise base from sequence shards (``colwise_seq``): ``lora_A`` whole with its gradient summed over
  tp (it sees this rank's tokens), ``lora_B`` as the base.

``r`` is small (8–64), so the whole factors cost little memory and one extra all-reduce of ``B × T × r`` for a
row-wise layer. A LoRA layer whose base is not an ``nn.Linear`` (an embedding, a convolution) under a splitting
style, or a DoRA / other variant with extra parameters, is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_par3d.config.tp_vocabulary import canonical

COLUMN = ("colwise", "colwise_gather_output", "colwise_seq", "colwise_seq_gather_output")
ROW = ("rowwise", "rowwise_split_input")


def is_lora_layer(module: nn.Module) -> bool:
    """A ``peft`` LoRA layer: a module with a ``base_layer`` and ``lora_A`` / ``lora_B`` dicts of adapters."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def adapter_plan(module: nn.Module, fqn_styles: Mapping[str, str]) -> dict[str, str]:
    """``fqn_styles`` with every entry on a LoRA layer moved to its base layer and its adapters split to match (see
    the module docstring); ``ValueError`` naming each layer it cannot split."""
    modules = dict(module.named_modules())
    plan: dict[str, str] = {}
    problems = []
    for name, style in fqn_styles.items():
        layer = modules.get(name)
        if layer is None or not is_lora_layer(layer):
            plan[name] = style
            continue
        problem = _split_adapters(name, layer, canonical(style), plan)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError(
            "Invalid tensor-parallel plan for the LoRA adapters:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nLeave those layers out of the adapters' target_modules, or out of the plan."
        )
    return plan


def _split_adapters(name: str, layer: nn.Module, style: str, plan: dict[str, str]) -> str:
    base = layer.base_layer
    if not isinstance(base, nn.Linear) and style in COLUMN + ROW + ("rowwise_seq",):
        return f"{name}: a LoRA layer over {type(base).__name__} under {style!r}; par3d splits LoRA over nn.Linear"
    extra = [
        attr
        for attr in ("lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B")
        if len(getattr(layer, attr, {}) or {}) > 0
    ]
    if extra:
        return f"{name}: a LoRA variant with {', '.join(extra)} (DoRA or embedding adapters), not split by par3d"
    plan[f"{name}.base_layer"] = style
    adapters: Any = layer.lora_A
    for adapter in adapters:
        a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
        if style in ("colwise_seq", "colwise_seq_gather_output"):  # its input, and so lora_A's, a sequence shard
            plan[a] = "replicated_with_grad_allreduce"
            plan[b] = style
        elif style in COLUMN:
            plan[b] = style
        elif style in ROW:
            plan[a] = style
        elif style == "rowwise_seq":
            plan[a] = style
            plan[b] = "replicated_with_grad_allreduce"
        else:
            return f"{name}: LoRA adapters under {style!r}; par3d splits them under column- and row-wise styles"
    return ""
