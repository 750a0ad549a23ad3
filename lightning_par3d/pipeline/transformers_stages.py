"""Pipelining a Hugging Face transformers causal LM as it is.

A transformers decoder keeps its blocks in an ``nn.ModuleList`` and its forward expects the whole model (it embeds
the ids, builds the rotary tables and the causal mask, runs every layer, then the norm and the head). par3d splits
it like any trunk (:mod:`lightning_par3d.pipeline.split`: the layers a stage does not own, and the embedding, norm and
head where they do not belong, become placeholders, so every parameter keeps its name) and gives each stage module
the forward of its part, with the model's own modules:

* the first stage embeds the token ids (and adds learned positions and applies the embedding dropout, GPT-2);
* every stage computes the position ids, the rotary tables (``rotary_emb``, shared by all stages) and the causal
  mask the model's attention implementation wants (``create_causal_mask``, or the sliding-window one for
  Mistral-style configs and per layer type for Qwen2/3-style ones), and runs its own layers;
* the last stage applies the final norm and the LM head and returns the logits.

The structure is found from the model, not from a list of class names (:func:`decoder_layout`): the base model
(``base_model_prefix``), its input embedding (``get_input_embeddings()``), the one list of repeated layers, the
first parameterized module after them (the final norm), a parameterless module holding ``inv_freq`` (rotary), a
second embedding before the layers (learned positions) and a dropout before them, and the ``lm_head``. Llama,
Mistral, Qwen2, Qwen3 and GPT-2 have this shape. Tied input and output embeddings cannot be split between the first
and last stage, and are refused under pipelining. A ``peft`` model wrapping such a model is split as it is: the
layout's names are found in the transformers model inside it and prefixed with its place there
(``base_model.model.``), so each stage keeps its LoRA layers under their peft names.

Padded batches: the trunk call's ``attention_mask=`` (and ``position_ids=``) reach every stage (torch's schedule
passes the call's keyword arguments to each stage's forward, split into the same microbatches as the ids), and each
stage builds its masks with the model's own mask functions from them, so a padded batch gives the outputs the
model gives with the same mask. Without ``position_ids`` the positions are ``0 … T-1`` on every row, whatever the
padding, as the model's own forward computes them (Llama, Qwen2, Mistral, GPT-2). The stage forward takes only
``input_ids``, ``attention_mask``, ``position_ids`` and ``use_cache`` by keyword; anything else (``labels``,
``inputs_embeds``, …, or the mask passed positionally, which would reach the first stage only) is refused before
the schedule runs (:func:`lightning_par3d.pipeline.runner.check_pipeline_call`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_par3d.utils.patterns import find_transformers_model, is_peft_model, is_transformers_model


@dataclass(frozen=True)
class DecoderLayout:
    """Where a transformers causal LM keeps its parts (names within the model)."""

    embed: str
    layers: str
    norm: str
    head: str
    positions: str | None = None
    dropout: str | None = None
    rotary: str | None = None
    model: str = ""
    """The transformers model itself: ``""``, or its name inside a ``peft`` model that wraps it."""


def decoder_layout(model: nn.Module) -> DecoderLayout | None:
    """The layout of a transformers causal LM, or of a ``peft`` model wrapping one (its names then within the
    ``peft`` model: ``base_model.model.model.layers``, …), or None for anything else."""
    if is_peft_model(model):
        found = find_transformers_model(model)
        inner = decoder_layout(found[1]) if found is not None else None
        if found is None or inner is None:
            return None
        head = found[0] + "."
        return DecoderLayout(
            **{key: head + value if value else value for key, value in vars(inner).items() if key != "model"},
            model=found[0],
        )
    if not is_transformers_model(model) or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module):
        return None
    children = list(base.named_children())
    lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList) and len(m) > 1]
    get_embeddings = getattr(base, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    if len(lists) != 1 or embedding is None:
        return None
    at = lists[0]
    names = {id(m): n for n, m in children}
    after = [(n, m) for n, m in children[at + 1 :] if any(True for _ in m.parameters())]
    before = children[:at]
    if not after or id(embedding) not in names:
        return None

    def path(name: str | None) -> str | None:
        return f"{prefix}.{name}" if name else None

    positions = next((n for n, m in before if isinstance(m, nn.Embedding) and m is not embedding), None)
    dropout = next((n for n, m in before if isinstance(m, nn.Dropout)), None)
    rotary = next((n for n, m in children if hasattr(m, "inv_freq") and not any(True for _ in m.parameters())), None)
    return DecoderLayout(
        embed=f"{prefix}.{names[id(embedding)]}",
        layers=f"{prefix}.{children[at][0]}",
        norm=f"{prefix}.{after[0][0]}",
        head="lm_head",
        positions=path(positions),
        dropout=path(dropout),
        rotary=path(rotary),
    )


def check_pipelinable(model: nn.Module) -> None:
    """Refuses what the stage split cannot serve: input and output embeddings tied into one parameter."""
    layout = decoder_layout(model)
    if layout is None:
        return
    embed = model.get_submodule(layout.embed)
    head = model.get_submodule(layout.head)
    if getattr(embed, "weight", None) is getattr(head, "weight", object()):
        raise ValueError(
            f"{type(model).__name__} ties its input embedding and its LM head (tie_word_embeddings=True): under "
            "pp > 1 they sit on the first and the last stage and cannot share one parameter. Untie them "
            "(config.tie_word_embeddings=False) or train without pipeline parallelism."
        )


def install_stage_forward(
    stage: nn.Module, layout: DecoderLayout, layers: list[int], first: bool, last: bool, shards: int = 1
) -> None:
    """Makes ``stage`` (a copy of the model holding this stage's parts) run only its part: see the module
    docstring. ``shards``: under sequence parallelism, the hidden states a later stage receives are this rank's
    ``1 / shards`` of the sequence; its positions and masks are still those of the whole sequence."""
    stage.forward = _stage_forward(stage, layout, layers, first, last, shards)


def _stage_forward(
    stage: nn.Module, layout: DecoderLayout, layers: list[int], first: bool, last: bool, shards: int
) -> Callable[..., torch.Tensor]:
    config = stage.get_submodule(layout.model).config

    def part(name: str | None) -> Any:
        return stage.get_submodule(name) if name else None

    def forward(
        x: torch.Tensor | None = None,
        /,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> torch.Tensor:
        """``x``: the token ids on the first stage (or ``input_ids=``), the previous stage's hidden states on the
        others. The keyword arguments reach every stage (torch's schedule passes them to each stage's forward,
        microbatched along dim 0). ``use_cache`` changes nothing here: the stages return logits, never a cache."""
        h = x if x is not None else input_ids  # token ids (B, T) on the first stage, else hidden states (B, T, hidden)
        assert h is not None, "a pipeline stage got no input"
        given_positions = position_ids  # the masks look for packed sequences in positions the batch gives only
        length = h.shape[1] * (1 if first else shards)  # T: a later stage may hold a sequence shard (B, T/tp, hidden)
        if position_ids is None:  # as the model's own forward: 0…T-1 on every row, whatever the padding mask
            position_ids = torch.arange(length, device=h.device).unsqueeze(0)  # (1, T)
        if first:  # token ids (B, T) → embeddings (B, T, hidden)
            h = _embed(part, layout, h, position_ids)
        whole = h if h.shape[1] == length else h.new_empty(h.shape[0], length, 0)  # the masks read (B, T) only
        extra: dict[str, Any] = {"position_ids": position_ids}
        if layout.rotary:
            extra["position_embeddings"] = part(layout.rotary)(whole, position_ids)  # (cos, sin), on every stage
        masks: dict[str, Any] = {}
        decoder = part(layout.layers)
        for index in layers:
            kind = _attention_kind(config, index)
            if kind not in masks:
                masks[kind] = _causal_mask(config, whole, attention_mask, given_positions, kind)
            out = decoder[index](h, attention_mask=masks[kind], **extra)
            h = out[0] if isinstance(out, tuple) else out
        if last:  # (B, T, hidden) → logits (B, T, vocab)
            h = part(layout.head)(part(layout.norm)(h))
        return h

    return forward


def _embed(part: Callable[[str | None], Any], layout: DecoderLayout, ids: torch.Tensor, positions: torch.Tensor) -> Any:
    """The first stage's embeddings: token embeddings, plus learned positions and embedding dropout (GPT-2)."""
    h = part(layout.embed)(ids)
    if layout.positions:
        h = h + part(layout.positions)(positions)
    if layout.dropout:
        h = part(layout.dropout)(h)
    return h


def _attention_kind(config: Any, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return str(types[index])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _causal_mask(
    config: Any, h: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None, kind: str
) -> Any:
    """The mask the model's attention implementation expects, from the model's own mask functions with the
    batch's padding mask (None where SDPA's own causal flag does it). ``positions`` are the batch's own position ids
    (None when it gave none: the default 0…T-1 packs nothing, and transformers would otherwise read the tensor's
    values to look for packed sequences, which a planner's probe on the meta device cannot)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    return make(
        config=config, inputs_embeds=h, attention_mask=attention_mask, past_key_values=None, position_ids=positions
    )


IGNORE_INDEX = -100
"""The label transformers' causal-LM losses ignore (``ForCausalLMLoss``'s default), and pad their shifted labels
with."""


def own_loss_of(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A pipelined transformers causal LM's own ``labels=`` loss, as the last stage applies it: ``(logits,
    shifted_labels) -> loss``, the model's ``loss_function`` given the labels already shifted
    (:func:`shifted_labels`, so that the token mean counts the targets the loss counts). None for a model without
    one (not a transformers causal LM, or a model whose loss par3d does not recognize)."""
    found = find_transformers_model(model)
    if found is None or not isinstance(getattr(found[1], "lm_head", None), nn.Module):  # (a placeholder once split)
        return None
    inner = found[1]
    loss_function = getattr(inner, "loss_function", None)
    vocab_size = getattr(getattr(inner, "config", None), "vocab_size", None)
    if not callable(loss_function) or not isinstance(vocab_size, int):
        return None

    def own_loss(logits: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        return loss_function(logits, None, vocab_size, shift_labels=shifted)

    return own_loss


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's labels as its own loss shifts them: each position's target is the next position's label, the
    last position's ignored (``(batch, sequence)`` kept, so the rows split into microbatches as the ids do)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
